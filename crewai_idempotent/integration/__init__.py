"""The crewai integration: `idempotent=True` on tools, guarded on every path.

The only part of crewai_idempotent that imports crewai, and only when crewai is in use:
importing this package imports nothing from crewai; `install()` (run automatically when
crewai is imported, see `crewai_idempotent._autoload`) does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._config import URL_ENV, IdempotencyConfig, configure, default_ledger_path
from ._keying import KeyContext
from ._patch import UnsupportedCrewAIVersion, install, is_installed, uninstall

if TYPE_CHECKING:
    from crewai.tools.base_tool import BaseTool

__all__ = [
    "URL_ENV",
    "IdempotencyConfig",
    "KeyContext",
    "UnsupportedCrewAIVersion",
    "activate",
    "configure",
    "default_ledger_path",
    "idempotent",
    "install",
    "is_installed",
    "uninstall",
]


def activate() -> None:
    """Install now if crewai is imported, else as soon as it is (what `import
    crewai_idempotent` does; CREWAI_IDEMPOTENT_AUTOLOAD does not switch it off)."""
    from .._autoload import install_import_hook

    install_import_hook(force=True)


def idempotent(tool: BaseTool, key: Any = None, **options: Any) -> BaseTool:
    """A guarded copy of a tool someone else wrote: `idempotent(tool, key="charge:{id}")`.

    Options: `key` (or `idempotency_key`), `wait_s`, `lease_s`, `ttl`, `reconcile`,
    `on_stale`, `fingerprint`, as for `@tool(..., idempotent=True)`.
    """
    from ._tools import idempotent as _idempotent

    return _idempotent(tool, key, **options)
