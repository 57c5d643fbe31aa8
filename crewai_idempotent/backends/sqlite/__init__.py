"""The embedded default: one SQLite file in WAL mode."""

from ._store import SCHEMA_VERSION, SQLiteCacheBackend, SQLiteStats, sqlite_url

__all__ = ["SCHEMA_VERSION", "SQLiteCacheBackend", "SQLiteStats", "sqlite_url"]
