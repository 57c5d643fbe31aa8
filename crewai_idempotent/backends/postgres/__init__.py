"""A ledger in PostgreSQL, for workers on many hosts (the `postgres` extra)."""

from ._store import (
    SCHEMA_VERSION,
    PostgresCacheBackend,
    PostgresDurabilityWarning,
    durability_problems,
    libpq_parameters,
)

__all__ = [
    "SCHEMA_VERSION",
    "PostgresCacheBackend",
    "PostgresDurabilityWarning",
    "durability_problems",
    "libpq_parameters",
]
