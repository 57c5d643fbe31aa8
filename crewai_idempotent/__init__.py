"""Make side-effecting CrewAI tools safe to retry: claim durably, run once, replay after.

Importing this package activates the crewai integration (now if crewai is imported, else
when it is), whatever CREWAI_IDEMPOTENT_AUTOLOAD says: that variable switches off only the
automatic start-up hook. Everything else loads on first use (the ledger and asyncio, the
backends and their client libraries, approvals, spend caps), so that `import crewai` with
the integration active pays for none of it.
"""

from typing import TYPE_CHECKING

from _crewai_idempotent_autoload import install_import_hook

# Every error a public method raises (tests/project/test_public_errors.py keeps the list
# whole). The warnings are loaded on first use, below.
from ._errors import (
    AccountError,
    ApprovalAlreadyDecided,
    ApprovalDenied,
    ApprovalMovedOn,
    ApprovalNeedsAnother,
    ApprovalNotFound,
    ApprovalRequired,
    BodyFailed,
    CorruptRecord,
    DecisionRefused,
    DeliveryFailed,
    GuardInactive,
    IdempotencyError,
    IdempotencyKeyConflict,
    InvalidIdempotencyKey,
    LedgerConfigurationError,
    LedgerUnavailable,
    ListenError,
    OperationInProgress,
    OutcomeUncertain,
    OutcomeUnknown,
    ResolutionRefused,
    SigningConfigurationError,
    SpendCapExceeded,
    UnsupportedCrewAIVersion,
    UnverifiedCrewAIVersion,
)
from ._lazy import lazy_attributes
from .integration import install, uninstall

if TYPE_CHECKING:
    from ._errors import PostgresDurabilityWarning, RedisDurabilityWarning
    from .backends._url import backend_from_url
    from .backends.filelock import FileLockCacheBackend
    from .backends.memory import InMemoryCacheBackend
    from .backends.postgres import PostgresCacheBackend
    from .backends.redis import RedisCacheBackend
    from .backends.sqlite import SQLiteCacheBackend
    from .gates._approvals import ApprovalRequest, Approvals, ApprovalState
    from .gates._spend import Money, SpendCap, SpendLedger
    from .integration import IdempotencyConfig, KeyContext, configure, idempotent
    from .integration._strict import IdempotentTool, idempotent_tool
    from .ledger._backend import CacheBackend
    from .ledger._keys import fingerprint, validate_key
    from .ledger._ledger import Ledger
    from .ledger._reconcile import Absent, Found, Unknown
    from .ledger._record import Event, Owner, Record, Status
    from .ledger._select import Order, Select
    from .ledger._steps import Outcome

# Where each name loaded on first use lives.
_LAZY = {
    "ApprovalRequest": ".gates._approvals",
    "ApprovalState": ".gates._approvals",
    "Approvals": ".gates._approvals",
    "CacheBackend": ".ledger._backend",
    "fingerprint": ".ledger._keys",
    "validate_key": ".ledger._keys",
    "Ledger": ".ledger._ledger",
    "Outcome": ".ledger._steps",
    "Absent": ".ledger._reconcile",
    "Found": ".ledger._reconcile",
    "Unknown": ".ledger._reconcile",
    "Event": ".ledger._record",
    "Owner": ".ledger._record",
    "Record": ".ledger._record",
    "Status": ".ledger._record",
    "Order": ".ledger._select",
    "Select": ".ledger._select",
    "Money": ".gates._spend",
    "SpendCap": ".gates._spend",
    "SpendLedger": ".gates._spend",
    "backend_from_url": ".backends._url",
    "FileLockCacheBackend": ".backends.filelock",
    "InMemoryCacheBackend": ".backends.memory",
    "PostgresCacheBackend": ".backends.postgres",
    "PostgresDurabilityWarning": "._errors",
    "RedisCacheBackend": ".backends.redis",
    "RedisDurabilityWarning": "._errors",
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
    "AccountError",
    "ApprovalAlreadyDecided",
    "ApprovalDenied",
    "ApprovalMovedOn",
    "ApprovalNeedsAnother",
    "ApprovalNotFound",
    "ApprovalRequest",
    "ApprovalRequired",
    "ApprovalState",
    "Approvals",
    "BodyFailed",
    "CacheBackend",
    "CorruptRecord",
    "DecisionRefused",
    "DeliveryFailed",
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
    "ListenError",
    "Money",
    "OperationInProgress",
    "Order",
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
    "Select",
    "SigningConfigurationError",
    "SpendCap",
    "SpendCapExceeded",
    "SpendLedger",
    "Status",
    "Unknown",
    "UnsupportedCrewAIVersion",
    "UnverifiedCrewAIVersion",
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
