"""A ledger in Redis, for teams that already run it (the `redis` extra)."""

from ..._errors import RedisDurabilityWarning
from ._store import (
    DEFAULT_PREFIX,
    RedisCacheBackend,
    persistence_problem,
    redis_py_options,
)

__all__ = [
    "DEFAULT_PREFIX",
    "RedisCacheBackend",
    "RedisDurabilityWarning",
    "persistence_problem",
    "redis_py_options",
]
