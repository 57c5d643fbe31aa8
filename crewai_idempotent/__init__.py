"""Make side-effecting CrewAI tools safe to retry: claim durably, run once, replay after.

Importing this package activates the crewai integration (now if crewai is imported, else
when it is), whatever CREWAI_IDEMPOTENT_AUTOLOAD says: that variable switches off only the
automatic start-up hook. Everything else loads on first use (the ledger and asyncio, the
backends and their client libraries, approvals, spend caps), so that `import crewai` with
the integration active pays for none of it.
"""

from typing import TYPE_CHECKING

from _crewai_idempotent_autoload import install_import_hook

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
from ._lazy import lazy_attributes
from .integration import install, uninstall

if TYPE_CHECKING:
    from ._approvals import ApprovalRequest, Approvals, ApprovalState
    from ._backend import CacheBackend
    from ._keys import fingerprint, validate_key
    from ._ledger import Ledger
    from ._reconcile import Absent, Found, Unknown
    from ._record import Event, Owner, Record, Status
    from ._spend import Money, SpendCap, SpendLedger
    from ._steps import Outcome
    from .backends._url import backend_from_url
    from .backends.filelock import FileLockCacheBackend
    from .backends.memory import InMemoryCacheBackend
    from .backends.postgres import PostgresCacheBackend, PostgresDurabilityWarning
    from .backends.redis import RedisCacheBackend, RedisDurabilityWarning
    from .backends.sqlite import SQLiteCacheBackend
    from .integration import IdempotencyConfig, KeyContext, configure, idempotent
    from .integration._strict import IdempotentTool, idempotent_tool

# Where each name loaded on first use lives.
_LAZY = {
    "ApprovalRequest": "._approvals",
    "ApprovalState": "._approvals",
    "Approvals": "._approvals",
    "CacheBackend": "._backend",
    "fingerprint": "._keys",
    "validate_key": "._keys",
    "Ledger": "._ledger",
    "Outcome": "._steps",
    "Absent": "._reconcile",
    "Found": "._reconcile",
    "Unknown": "._reconcile",
    "Event": "._record",
    "Owner": "._record",
    "Record": "._record",
    "Status": "._record",
    "Money": "._spend",
    "SpendCap": "._spend",
    "SpendLedger": "._spend",
    "backend_from_url": ".backends._url",
    "FileLockCacheBackend": ".backends.filelock",
    "InMemoryCacheBackend": ".backends.memory",
    "PostgresCacheBackend": ".backends.postgres",
    "PostgresDurabilityWarning": ".backends.postgres",
    "RedisCacheBackend": ".backends.redis",
    "RedisDurabilityWarning": ".backends.redis",
    "SQLiteCacheBackend": ".backends.sqlite",
    "IdempotencyConfig": ".integration",
    "KeyContext": ".integration",
    "configure": ".integration",
    "idempotent": ".integration",
    # The strict tool forms import crewai.
    "IdempotentTool": ".integration._strict",
    "idempotent_tool": ".integration._strict",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


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
    "PostgresDurabilityWarning",
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

# Activate: install now if crewai is loaded, else the moment it is (the start-up hook may
# already be waiting with the same install).
install_import_hook(install, force=True)
