"""Make side-effecting CrewAI tools safe to retry: claim durably, run once, replay after."""

from typing import TYPE_CHECKING, Any

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

# The crewai integration imports crewai only once crewai itself is imported.
from .integration import IdempotencyConfig, KeyContext, configure, idempotent, install, uninstall
from .integration import activate as _activate

if TYPE_CHECKING:
    from ._postgres import PostgresCacheBackend
    from ._redis import RedisCacheBackend, RedisDurabilityWarning

# Server backends load their client library (psycopg, redis-py: optional extras) on use.
_LAZY = {
    "PostgresCacheBackend": "._postgres",
    "RedisCacheBackend": "._redis",
    "RedisDurabilityWarning": "._redis",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Absent",
    "CacheBackend",
    "Event",
    "FileLockCacheBackend",
    "Found",
    "IdempotencyConfig",
    "IdempotencyError",
    "IdempotencyKeyConflict",
    "InMemoryCacheBackend",
    "InvalidIdempotencyKey",
    "KeyContext",
    "Ledger",
    "LedgerUnavailable",
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
    "Status",
    "Unknown",
    "backend_from_url",
    "configure",
    "fingerprint",
    "idempotent",
    "install",
    "uninstall",
    "validate_key",
]

_activate()
