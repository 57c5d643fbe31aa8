"""Make side-effecting CrewAI tools safe to retry: claim durably, run once, replay after.

Importing this package activates the crewai integration (now if crewai is imported, else
when it is), whatever CREWAI_IDEMPOTENT_AUTOLOAD says: that variable switches off only the
automatic start-up hook. Backends and their libraries load when first used.
"""

from typing import TYPE_CHECKING, Any

from ._approvals import ApprovalRequest, Approvals, ApprovalState
from ._backend import CacheBackend
from ._errors import (
    ApprovalDenied,
    ApprovalRequired,
    GuardInactive,
    IdempotencyError,
    IdempotencyKeyConflict,
    InvalidIdempotencyKey,
    LedgerConfigurationError,
    LedgerUnavailable,
    OperationInProgress,
    OutcomeUncertain,
    OutcomeUnknown,
    ResolutionRefused,
    SpendCapExceeded,
)
from ._keys import fingerprint, validate_key
from ._ledger import Ledger, Outcome
from ._reconcile import Absent, Found, Unknown
from ._record import Event, Owner, Record, Status
from ._spend import Money, SpendCap, SpendLedger

# The crewai integration imports crewai only once crewai itself is imported.
from .integration import IdempotencyConfig, KeyContext, configure, idempotent, install, uninstall
from .integration import activate as _activate

if TYPE_CHECKING:
    from .backends._url import backend_from_url
    from .backends.filelock import FileLockCacheBackend
    from .backends.memory import InMemoryCacheBackend
    from .backends.postgres import PostgresCacheBackend
    from .backends.redis import RedisCacheBackend, RedisDurabilityWarning
    from .backends.sqlite import SQLiteCacheBackend
    from .integration._strict import IdempotentTool, idempotent_tool

# Loaded on first use, so that `import crewai` with the integration active pays for none of
# them: backends (and filelock, sqlite3, psycopg, redis-py), and the strict tool forms
# (which import crewai).
_LAZY = {
    "FileLockCacheBackend": ".backends.filelock",
    "InMemoryCacheBackend": ".backends.memory",
    "SQLiteCacheBackend": ".backends.sqlite",
    "backend_from_url": ".backends._url",
    "PostgresCacheBackend": ".backends.postgres",
    "RedisCacheBackend": ".backends.redis",
    "RedisDurabilityWarning": ".backends.redis",
    "IdempotentTool": ".integration._strict",
    "idempotent_tool": ".integration._strict",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Absent",
    "ApprovalDenied",
    "ApprovalRequest",
    "ApprovalRequired",
    "ApprovalState",
    "Approvals",
    "CacheBackend",
    "Event",
    "FileLockCacheBackend",
    "Found",
    "GuardInactive",
    "IdempotencyConfig",
    "IdempotencyError",
    "IdempotencyKeyConflict",
    "IdempotentTool",
    "InMemoryCacheBackend",
    "InvalidIdempotencyKey",
    "KeyContext",
    "Ledger",
    "LedgerConfigurationError",
    "LedgerUnavailable",
    "Money",
    "OperationInProgress",
    "Outcome",
    "OutcomeUncertain",
    "OutcomeUnknown",
    "Owner",
    "PostgresCacheBackend",
    "Record",
    "RedisCacheBackend",
    "RedisDurabilityWarning",
    "ResolutionRefused",
    "SQLiteCacheBackend",
    "SpendCap",
    "SpendCapExceeded",
    "SpendLedger",
    "Status",
    "Unknown",
    "backend_from_url",
    "configure",
    "fingerprint",
    "idempotent",
    "idempotent_tool",
    "install",
    "uninstall",
    "validate_key",
]

_activate()
