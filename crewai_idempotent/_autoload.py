"""Activation on crewai import: the start-up hook lives in the top-level module
`_crewai_idempotent_autoload` (see its docstring for why it is outside this package)."""

from _crewai_idempotent_autoload import (
    autoload_enabled,
    install_import_hook,
    remove_import_hook,
)

__all__ = ["autoload_enabled", "install_import_hook", "remove_import_hook"]
