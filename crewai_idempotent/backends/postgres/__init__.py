"""A ledger in PostgreSQL, for workers on many hosts (the `postgres` extra)."""

from ..._errors import PostgresDurabilityWarning
from ._durability import durability_problems
from ._store import SCHEMA_VERSION, PostgresCacheBackend, libpq_parameters

__all__ = [
    "SCHEMA_VERSION",
    "PostgresCacheBackend",
    "PostgresDurabilityWarning",
    "durability_problems",
    "libpq_parameters",
]
