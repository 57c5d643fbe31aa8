"""Make side-effecting CrewAI tools safe to retry: claim durably, run once, replay after."""

from ._backend import CacheBackend
from ._errors import (
    IdempotencyError,
    IdempotencyKeyConflict,
    InvalidIdempotencyKey,
    LedgerUnavailable,
    OperationInProgress,
    OutcomeUncertain,
    OutcomeUnknown,
    ResolutionRefused,
)
from ._filelock import FileLockCacheBackend
from ._keys import fingerprint, validate_key
from ._ledger import Ledger, Outcome
from ._memory import InMemoryCacheBackend
from ._reconcile import Absent, Found, Unknown
from ._record import Event, Owner, Record, Status
from ._sqlite import SQLiteCacheBackend
from ._url import backend_from_url

__all__ = [
    "Absent",
    "CacheBackend",
    "Event",
    "FileLockCacheBackend",
    "Found",
    "IdempotencyError",
    "IdempotencyKeyConflict",
    "InMemoryCacheBackend",
    "InvalidIdempotencyKey",
    "Ledger",
    "LedgerUnavailable",
    "OperationInProgress",
    "Outcome",
    "OutcomeUncertain",
    "OutcomeUnknown",
    "Owner",
    "Record",
    "ResolutionRefused",
    "SQLiteCacheBackend",
    "Status",
    "Unknown",
    "backend_from_url",
    "fingerprint",
    "validate_key",
]

# The crewai integration. It imports crewai only once crewai itself is imported.
from .integration import (
    IdempotencyConfig,
    KeyContext,
    configure,
    idempotent,
    install,
    uninstall,
)
from .integration import activate as _activate

__all__ += ["IdempotencyConfig", "KeyContext", "configure", "idempotent", "install", "uninstall"]

_activate()
