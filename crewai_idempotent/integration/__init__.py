"""The crewai integration: `idempotent=True` on tools, guarded on every path.

The only part of crewai_idempotent that imports crewai, and only when crewai is in use:
importing this package imports nothing from crewai; `install()` (run when crewai is
imported: `import crewai_idempotent` or the start-up hook `_crewai_idempotent_autoload`
asks for it) does.

Activation stays cheap (the budget: under 10 ms added to `import crewai`, measured by
bench/startup.py; tests/crewai/test_activation.py checks what loads): this package
loads only what `install()` patches into crewai (`_patch`, `_tools`, `_call`, `_stash`,
`_compat`, and `_release`, the release gate);
the options, the ledgers, the guard and the gates load on first use, as do the names
below that need them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._errors import UnsupportedCrewAIVersion, UnverifiedCrewAIVersion
from .._lazy import lazy_attributes
from ._patch import install, is_installed, uninstall

if TYPE_CHECKING:
    from ._config import IdempotencyConfig, configure
    from ._keying import KeyContext
    from ._ledgers import URL_ENV, default_ledger_path
    from ._wrap import idempotent

_LAZY = {
    "IdempotencyConfig": "._config",
    "configure": "._config",
    "KeyContext": "._keying",
    "URL_ENV": "._ledgers",
    "default_ledger_path": "._ledgers",
    "idempotent": "._wrap",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "URL_ENV",
    "IdempotencyConfig",
    "KeyContext",
    "UnsupportedCrewAIVersion",
    "UnverifiedCrewAIVersion",
    "configure",
    "default_ledger_path",
    "idempotent",
    "install",
    "is_installed",
    "uninstall",
]
