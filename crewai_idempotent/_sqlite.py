"""The embedded default: one SQLite file in WAL mode, one connection per thread."""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from ._backend import CacheBackend
from ._errors import LedgerUnavailable
from ._paths import private_file
from ._record import Record, Status

SCHEMA_VERSION = 1
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency_records (
    key        TEXT PRIMARY KEY,
    status     TEXT NOT NULL,
    token      INTEGER NOT NULL,
    revision   INTEGER NOT NULL,
    updated_at REAL NOT NULL,
    doc        TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_records_status ON idempotency_records (status);
"""

_INSERT = (
    "INSERT INTO idempotency_records (key, status, token, revision, updated_at, doc) "
    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO NOTHING"
)
_REPLACE = (
    "UPDATE idempotency_records SET status = ?, token = ?, revision = ?, updated_at = ?, doc = ? "
    "WHERE key = ? AND token = ? AND revision = ?"
)
_GET = "SELECT doc FROM idempotency_records WHERE key = ?"


class SQLiteCacheBackend(CacheBackend):
    """A ledger in one SQLite file.

    `synchronous="FULL"` (the default) fsyncs the WAL on every commit, so a committed claim
    survives power loss; `"NORMAL"` survives a crash of the process but may lose the last
    transactions on power loss, and is several times faster.

    The file is created mode 0600 (its folder 0700 if created). A path that is a symlink,
    or whose folder is writable by group or others, is refused unless
    `allow_insecure_path=True`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: str = "FULL",
        busy_timeout_s: float = 5.0,
        allow_insecure_path: bool = False,
    ) -> None:
        synchronous = synchronous.upper()
        if synchronous not in ("FULL", "NORMAL", "EXTRA"):
            raise ValueError(f"synchronous must be FULL, NORMAL or EXTRA, not {synchronous!r}")
        self.synchronous = synchronous
        self.busy_timeout_s = busy_timeout_s
        self.path = private_file(Path(path), allow_insecure_path)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"SQLiteCacheBackend({str(self.path)!r}, synchronous={self.synchronous!r})"

    # -- connections -------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is not None and local.pid == os.getpid():
            return conn
        if self._closed:
            raise LedgerUnavailable(f"{self!r} is closed")
        # A connection inherited through fork() must never be used in the child.
        conn = self._guard(self._open)
        local.conn, local.pid = conn, os.getpid()
        with self._lock:
            self._connections.append(conn)
        return conn

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path, isolation_level=None, timeout=self.busy_timeout_s, check_same_thread=False
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            self._retry_busy(self._use_wal, conn)
            conn.execute(f"PRAGMA synchronous = {self.synchronous}")
            self._retry_busy(self._migrate, conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _retry_busy(
        self, step: Callable[[sqlite3.Connection], None], conn: sqlite3.Connection
    ) -> None:
        # Switching to WAL and recovering a WAL index return SQLITE_BUSY without calling
        # the busy handler when several processes open a new ledger at once; retry those
        # within the same time budget the busy timeout gives every other statement.
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                return step(conn)
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                if time.monotonic() > deadline:
                    raise
                time.sleep(random.uniform(0.001, 0.01))

    def _use_wal(self, conn: sqlite3.Connection) -> None:
        if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":
            return
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise LedgerUnavailable(
                f"ledger {self.path} cannot use WAL mode (got {mode!r}); "
                "is it on a network or read-only filesystem?"
            )

    def _migrate(self, conn: sqlite3.Connection) -> None:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            raise LedgerUnavailable(
                f"ledger {self.path} has schema version {version}; this crewai-idempotent "
                f"understands up to {SCHEMA_VERSION}. Upgrade crewai-idempotent."
            )
        conn.execute("BEGIN IMMEDIATE")  # one migrator at a time across processes
        try:
            if conn.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _guard(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn`, turning SQLite's failures into a LedgerUnavailable that names the cause."""
        try:
            return fn(*args)
        except LedgerUnavailable:
            raise
        except (sqlite3.Error, OSError) as exc:
            raise LedgerUnavailable(self._explain(exc)) from exc

    def _explain(self, exc: BaseException) -> str:
        text = str(exc)
        low = text.lower()
        code = getattr(exc, "sqlite_errorname", "") or ""
        if "readonly" in low or "read-only" in low or code.startswith("SQLITE_READONLY"):
            why = "the ledger file or its folder is read-only"
        elif "locked" in low or "busy" in low:
            why = f"the database stayed locked past the busy timeout ({self.busy_timeout_s} s)"
        elif "full" in low or code.startswith(("SQLITE_FULL", "SQLITE_IOERR")):
            why = _write_failure()
        elif "not a database" in low or "malformed" in low or code.startswith("SQLITE_CORRUPT"):
            why = "the ledger file is corrupt"
        elif "unable to open" in low or "permission" in low or code.startswith("SQLITE_CANTOPEN"):
            why = "the ledger file cannot be opened (permissions or missing folder)"
        else:
            why = "the ledger could not be written"
        return f"{why}: {self.path}: {type(exc).__name__} {code}: {text}".replace("  ", " ")

    # -- protocol ----------------------------------------------------------------------

    def insert(self, record: Record) -> Record | None:
        conn = self._conn()
        params = (
            record.key, record.status.value, record.token, record.revision,
            record.updated_at, record.to_json(),
        )  # fmt: skip
        try:
            while True:
                # One autocommit statement: SQLite runs it as its own write transaction, so
                # the insert-if-absent is atomic across threads and processes.
                if conn.execute(_INSERT, params).rowcount == 1:
                    return None
                row = conn.execute(_GET, (record.key,)).fetchone()
                if row is not None:
                    return self._decode(row[0])
                # deleted between the two statements: try the claim again
        except (sqlite3.Error, OSError) as exc:
            raise LedgerUnavailable(self._explain(exc)) from exc

    def replace(self, current: Record, new: Record) -> bool:
        conn = self._conn()
        try:
            cursor = conn.execute(
                _REPLACE,
                (
                    new.status.value, new.token, new.revision, new.updated_at, new.to_json(),
                    current.key, current.token, current.revision,
                ),
            )  # fmt: skip
        except (sqlite3.Error, OSError) as exc:
            raise LedgerUnavailable(self._explain(exc)) from exc
        return cursor.rowcount == 1

    def get(self, key: str) -> Record | None:
        row = self._guard(self._conn().execute, _GET, (key,)).fetchone()
        return None if row is None else self._decode(row[0])

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        conn = self._conn()
        params: tuple[str, ...] = ()
        if status is None:
            sql = "SELECT doc FROM idempotency_records ORDER BY updated_at"
        else:
            sql = "SELECT doc FROM idempotency_records WHERE status = ? ORDER BY updated_at"
            params = (status.value,)
        rows = self._guard(lambda: conn.execute(sql, params).fetchall())
        return iter([self._decode(row[0]) for row in rows])

    def delete(self, current: Record) -> bool:
        cursor = self._guard(
            self._conn().execute,
            "DELETE FROM idempotency_records WHERE key = ? AND token = ? AND revision = ?",
            (current.key, current.token, current.revision),
        )
        return cursor.rowcount == 1

    def _decode(self, doc: str) -> Record:
        try:
            return Record.from_json(doc)
        except (ValueError, KeyError, TypeError) as exc:
            raise LedgerUnavailable(
                f"the ledger file is corrupt: {self.path}: bad record {exc!r}"
            ) from exc

    def close(self) -> None:
        self._closed = True
        with self._lock:
            connections, self._connections = self._connections, []
        for conn in connections:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
        self._local = threading.local()


def _write_failure() -> str:
    # SQLite reports EFBIG and ENOSPC alike as an I/O error; name the limit when one is set.
    try:
        import resource
    except ImportError:  # not on Windows
        return "a write failed: the disk is full or failing"
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        return f"a write failed: a file size limit (RLIMIT_FSIZE={soft} bytes) or a full disk"
    return "a write failed: the disk is full or failing"
