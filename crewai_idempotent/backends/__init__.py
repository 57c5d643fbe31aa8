"""The stores a ledger keeps its records in, each a `CacheBackend` subclass.

Embedded: `sqlite` (the default; one file, WAL), `filelock` (a folder of JSON files under
flock), `memory` (tests only: not durable). Shared by many hosts: `postgres`, `redis`.
Each opens from its own URL with `from_url`, which refuses any option it does not know.

Beside them: `_url` (the scheme table behind `backend_from_url`), `_options` (URL options
and `redact`), `_paths` (refusing files another user could tamper with), `_clock` (a
server's clock, for hosts whose clocks differ). The SQLite, PostgreSQL and Redis stores
are packages whose parts sit beside them: `sqlite/_fork` (closing SQLite around fork())
and `sqlite/_group` (group commit); `postgres/_schema` and `postgres/_deadline` (the
table and its migrations; the client-side bound on every call); `redis/_scripts` and
`redis/_deadline` (the atomic writes; the bound on every socket wait).

Nothing here is imported until used, so `import crewai` with the integration active pays
for no store and no client library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .._errors import PostgresDurabilityWarning, RedisDurabilityWarning
    from ._url import backend_from_url
    from .filelock import FileLockCacheBackend
    from .memory import InMemoryCacheBackend
    from .postgres import PostgresCacheBackend
    from .redis import RedisCacheBackend
    from .sqlite import SQLiteCacheBackend

_WHERE = {
    "FileLockCacheBackend": ".filelock",
    "InMemoryCacheBackend": ".memory",
    "PostgresCacheBackend": ".postgres",
    "PostgresDurabilityWarning": ".._errors",
    "RedisCacheBackend": ".redis",
    "RedisDurabilityWarning": ".._errors",
    "SQLiteCacheBackend": ".sqlite",
    "backend_from_url": "._url",
}


__getattr__ = lazy_attributes(__name__, _WHERE)


__all__ = [
    "FileLockCacheBackend",
    "InMemoryCacheBackend",
    "PostgresCacheBackend",
    "PostgresDurabilityWarning",
    "RedisCacheBackend",
    "RedisDurabilityWarning",
    "SQLiteCacheBackend",
    "backend_from_url",
]
