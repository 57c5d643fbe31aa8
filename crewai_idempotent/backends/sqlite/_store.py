"""The embedded default: one SQLite file in WAL mode, one connection per thread.

Every operation checks that the file is still the one opened (a ledger deleted or replaced
under a running process must not become an empty one), and the file and its -wal and -shm
must belong to this user (`_paths`). Around fork() every backend closes its connections so
that no SQLite state crosses into the child (`_fork` says why and how); concurrent
threads' synced writes share one transaction (`_group`).

The connections, the fork hooks and the identity checks are one class with its
statements because they share the backend's state: every operation passes all three.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import secrets
import socket
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar
from urllib.parse import quote, unquote, urlsplit

from ..._errors import LedgerConfigurationError, LedgerUnavailable
from ...ledger import _fork
from ...ledger._backend import CacheBackend, prefix_end
from ...ledger._fork import unforked
from ...ledger._hostclock import this_host
from ...ledger._record import Peek, Record, Status, read_peek, read_record
from ...ledger._select import Select
from .._options import flag, local_options, seconds, with_options
from .._paths import check_existing_file, private_file
from .._scan import BATCH, ScanCounter, ScanStats
from . import _indexes
from ._fork import Gate, refusal_message, taint, tainted
from ._group import Group
from ._query import Query

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
_DELETE = "DELETE FROM idempotency_records WHERE key = ? AND token = ? AND revision = ?"
# Scans read `BATCH` rows per statement in key order, the first from the scan's start
# (`>=`), each later one after the last key read (`>`): keyset pagination. The primary key
# serves every one, and the status index too, whose entries in a WITHOUT ROWID table end
# with the primary key (status, key). A key never changes, so a record that stays is read
# once, however often it is written meanwhile.
_SELECT = "SELECT key, doc FROM idempotency_records WHERE "
_SCANS = {
    (kind, op): _SELECT + where.format(op=op) + " ORDER BY key LIMIT ?"
    for kind, where in (
        ("all", "key {op} ?"),
        ("status", "status = ? AND key {op} ?"),
        ("range", "key {op} ? AND key < ?"),
    )
    for op in (">=", ">")
}

# The slots of a thread's connections (`_ready`).
_PLAIN, _CLAIM, _SWEEP = "conn", "claim_conn", "sweep_conn"

# A purge's deletes (`delete_many`): a few per transaction, then a pause as long as they
# took, waiting for the write lock in SQLite's busy handler as claims do. SQLite's write
# lock is one per file and the handler sleeps 1, 2, 5, 10 ms... between tries: a purge
# that held the lock for a hundred synced deletes kept claims waiting through several of
# those sleeps (a claim's p99 went from 1 ms to 19 ms during a purge of 1M records; one
# that polled for the lock and held it 1 ms starved them worse). This one gives way: under
# a worker claiming flat out it is slow (100k records in 15 minutes), and claims keep
# their latency; with the lock idle between claims, as it mostly is, it runs at once.
_SWEEP_ROWS = 16

# Each connection opened to ask `PRAGMA data_version` (`changes()`) gets a number of its
# own: a mark read on one never equals one read on another, whose versions count anew.
_watchers = itertools.count(1)

# The backfill of the index tables (`_indexes.backfill`): the write lock is held for one
# chunk at a time, sized to take about `_CHUNK_S`, and let go for at least twice that
# before the next, so a claim waits one chunk at most and the building takes a third of
# the lock's time.
_CHUNK_S = 0.02
_CHUNK_ROWS = (50, 200, 5000)  # least, first, most records per chunk
_PAUSE_S = 0.01
_WAIT_S = 2.0  # between looks at a backfill another process holds (a read each)

log = logging.getLogger("crewai_idempotent")

# Every backend of this process, so that one opening a file can tell that another object
# holds connections to it inherited through a fork that skipped the hooks.
_backends: weakref.WeakSet[SQLiteCacheBackend] = weakref.WeakSet()


@dataclass(frozen=True, slots=True)
class SQLiteStats:
    """What a SQLite backend is doing right now (`SQLiteCacheBackend.stats()`).

    `writing`: a synced write of this backend (alone, or a group commit's batch) is being
    committed. `queued`: writes of other threads waiting to share the next transaction
    (group commit). `closing`: close() (or a fork) has begun, and no new operation is let in.
    """

    writing: bool
    queued: int
    closing: bool


class SQLiteCacheBackend(CacheBackend):
    """A ledger in one SQLite file.

    `synchronous="FULL"` (the default) fsyncs the WAL on every commit, so a committed claim
    survives power loss; `"NORMAL"` survives a crash of the process but may lose the last
    transactions on power loss, and is several times faster.

    The file is created mode 0600; its folder must exist, unless `create_parents=True`
    (then it is created 0700). A path that is a symlink,
    a folder or file (or -wal, -shm) that another user owns or may write to, is refused
    unless `allow_insecure_path=True`; so is a ledger file deleted or replaced while the
    backend is open. Safe across fork(): see the module docstring.

    `path` is the ledger file; `busy_timeout_s` how long a write waits for another
    process's write lock before `LedgerUnavailable`. A ledger an older release made gets
    the index tables behind `select` when this opens it, and a thread fills them with its
    records in short chunks (`build_indexes`); `background_indexing=False` leaves that to
    an explicit `build_indexes()` (a deploy step). Raises `ValueError` for an unknown
    `synchronous`, `LedgerConfigurationError` for a path that cannot hold a ledger (a
    missing folder, one another user may write to, a symlink) and `LedgerUnavailable`
    for a file that cannot be opened or is not a ledger.
    """

    read_first = True  # a read is local and cheap: replays peek before claiming

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: str = "FULL",
        busy_timeout_s: float = 5.0,
        allow_insecure_path: bool = False,
        create_parents: bool = False,
        background_indexing: bool = True,
    ) -> None:
        synchronous = synchronous.upper()
        if synchronous not in ("FULL", "NORMAL", "EXTRA", "CLAIMS"):
            raise ValueError(
                f"synchronous must be FULL, NORMAL, EXTRA or CLAIMS, not {synchronous!r}"
            )
        self.synchronous = synchronous
        # CLAIMS: writes that let a body start (a claim, a takeover) go through a FULL
        # connection and are synced before they return; every other write goes through a
        # NORMAL one and rides the next claim's sync (docs/backends.md, "Durability").
        self._lazy = synchronous == "CLAIMS"
        # A thread's connections, by slot: the one for every operation, and the one for
        # writes that let a body start (the same slot unless claims alone are synced).
        # A purge's deletes are never synced on their own: one lost to a power cut
        # leaves a record that had expired or was settled, and the next synced commit's
        # fsync of the log covers them anyway.
        self._syncs = {
            _PLAIN: "NORMAL" if self._lazy else synchronous,
            _CLAIM: "FULL",
            _SWEEP: "NORMAL",
        }
        self._claim_slot = _CLAIM if self._lazy else _PLAIN
        # The synced writes of concurrent threads share one fsync (`_group`).
        # NORMAL syncs nothing when a write commits: nothing to share.
        self._group = None if synchronous == "NORMAL" else Group(busy_timeout_s)
        self.busy_timeout_s = busy_timeout_s
        # Every process that opens it runs on this host: leases go by the host's clock.
        self.host_clock = this_host()
        self.allow_insecure_path = allow_insecure_path
        self.path, st = private_file(Path(path), allow_insecure_path, create_parents=create_parents)
        self._identity = (st.st_dev, st.st_ino)
        self._dev, self._ino = st.st_dev, st.st_ino  # compared apart: no tuple per operation
        self._path_text = str(self.path)  # os.stat of a str skips __fspath__ on every call
        self._where = f"the ledger file {self.path}"  # what a corrupt record names
        _pin_inode(self, self.path)
        # SQLite creates -wal and -shm itself; they must never be created through a new
        # file at `path`, so every connection opens the existing file (mode=rw).
        self._uri = f"{self.path.as_uri()}?mode=rw"
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._gate = Gate()
        self._pid = os.getpid()
        self._quiesced = False
        self._closed = False
        self._scans = ScanCounter()
        # The index tables (`_indexes`): True once complete (they stay so), and the thread
        # of this process that fills them meanwhile.
        self._indexes_complete = False
        self.background_indexing = background_indexing
        self._builder: threading.Thread | None = None
        self._stop_building = threading.Event()
        self._building_lock = threading.Lock()
        self._chunk_rows = _CHUNK_ROWS[1]
        self._holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        # The connection that only asks PRAGMA data_version (`changes()`), and its number.
        self._watch: sqlite3.Connection | None = None
        self._watch_id = 0
        self._watch_lock = threading.Lock()
        _backends.add(self)
        _fork.register(self)

    def __repr__(self) -> str:
        return f"SQLiteCacheBackend({str(self.path)!r}, synchronous={self.synchronous!r})"

    @property
    def url(self) -> str:
        """The URL that names this ledger (for messages and the CLI's --ledger)."""
        options: dict[str, Any] = {}
        if self.allow_insecure_path:
            options["allow_insecure_path"] = True
        if not self.background_indexing:
            options["background_indexing"] = False
        return with_options(sqlite_url(self.path), options)

    # -- URL (SQLAlchemy's convention) ---------------------------------------------------

    @classmethod
    def from_url(cls, url: str) -> Self:
        """`sqlite:///relative.db` (relative to the current directory, made absolute now),
        `sqlite:////abs/ledger.db`, with the options `synchronous`, `busy_timeout_s`,
        `allow_insecure_path`, `create_parents` and `background_indexing`; anything else is a
        `LedgerConfigurationError`, as is a `url` that does not name a file. Raises what
        the constructor raises."""
        options = local_options(url, _URL_OPTIONS, "sqlite")
        path = cls.path_from_url(url)
        text = unquote(urlsplit(url).path[1:])
        if not Path(text).is_absolute() and not options.get("create_parents"):
            absolute = Path("/", text)
            if not path.parent.is_dir():
                # Meant as absolute, most likely: say so before anything is made.
                raise LedgerConfigurationError(
                    f"{url} names {path} (three slashes: relative to the current directory, "
                    f"as in SQLAlchemy), whose folder {path.parent} does not exist; {absolute} "
                    f"is {sqlite_url(absolute)} (four slashes), and ?create_parents=true "
                    "makes the folders for a new ledger here"
                )
        try:
            return cls(path, **options)
        except LedgerConfigurationError as exc:
            raise LedgerConfigurationError(f"{url}: {exc}") from None
        except ValueError as exc:
            raise LedgerConfigurationError(f"{url!r}: {exc}") from None

    @staticmethod
    def path_from_url(url: str) -> Path:
        """The absolute file a `sqlite:` URL names, without opening it. The options are
        checked too: a misspelt one is refused before anyone looks for the file."""
        local_options(url, _URL_OPTIONS, "sqlite")
        parts = urlsplit(url)
        if parts.netloc:
            raise LedgerConfigurationError(
                f"{url!r}: a sqlite URL has no host ({parts.netloc!r}); its forms are "
                "sqlite:///relative.db and sqlite:////absolute/path.db"
            )
        if not parts.path.startswith("/") or parts.path == "/":
            raise LedgerConfigurationError(
                f"{url!r} names no file (SQLAlchemy's in-memory form is not a durable ledger; "
                "memory:// is the test store); its forms are sqlite:///relative.db and "
                "sqlite:////absolute/path.db"
            )
        text = unquote(parts.path[1:])
        if text == ":memory:":
            raise LedgerConfigurationError(
                f"{url!r} is an in-memory SQLite database, not a durable ledger (memory:// is "
                "the test store)"
            )
        path = Path(text)
        if path.is_absolute():
            return path
        absolute = Path("/", text)
        resolved = Path.cwd() / path
        if not resolved.exists() and absolute.is_file():
            # Development versions read three slashes as an absolute path: refuse rather
            # than start an empty ledger next to the one holding the receipts.
            raise LedgerConfigurationError(
                f"{url!r} names {resolved} (three slashes: relative to the current directory, "
                f"as in SQLAlchemy), which does not exist, while {absolute} does: the existing "
                f"ledger is sqlite:///{absolute} (four slashes), a new one here "
                "sqlite:///./" + text
            )
        return resolved

    # -- fork ----------------------------------------------------------------------------

    def before_fork(self) -> None:
        self._quiesced = False
        if self._pid != os.getpid():
            # This process was forked without the hooks: what it holds is the parent's,
            # never to be closed here. Refuse the file, and fork with nothing open.
            self._forked_without_hook()
        if not self._gate.close(self.busy_timeout_s + 1.0):
            return  # an operation is still running: its connection cannot be closed
        self._drop_connections(close=True)
        self._quiesced = True

    def after_fork_in_parent(self) -> None:
        self._quiesced = False
        self._gate.open()

    def after_fork_in_child(self) -> None:
        self._own_process()
        if not self._quiesced and self._connections:
            self._refuse_file(
                f"an operation on it was still running in the parent (pid {os.getppid()}) "
                "when it forked"
            )
        self._quiesced = False

    def _refuse_file(self, why: str) -> None:
        """In a child: keep the inherited connections unclosed forever and refuse the file."""
        with self._lock:
            connections, self._connections = self._connections, []
        self._local = threading.local()
        taint(self._identity, why, connections)

    def _forked_without_hook(self) -> None:
        # os.fork() always runs the hooks; a fork made in C (or through ctypes) does not.
        if self._connections:
            self._refuse_file("the fork bypassed os.register_at_fork")
        self._own_process()

    def _own_process(self) -> None:
        """In a child: threads that waited at the gate or in a batch did not cross the
        fork, so both start fresh, and the backend belongs to this process now."""
        self._gate = Gate()
        self._group = None if self._group is None else Group(self.busy_timeout_s)
        self._pid = os.getpid()
        # The parent's builder thread did not cross the fork: this process starts its own
        # when it opens the file, if the index tables are still being filled.
        self._builder = None
        self._stop_building = threading.Event()
        self._building_lock = threading.Lock()
        self._watch_lock = threading.Lock()
        self._watch = None
        self._holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"

    # -- connections -------------------------------------------------------------------

    def _ready(self, slot: str) -> sqlite3.Connection:
        """This thread's connection in `slot` for one operation, which the caller runs
        inside the fork gate: once this is still the process the backend's connections
        belong to, and the file at the path still the one opened."""
        self._check_file()
        conn: sqlite3.Connection | None = getattr(self._local, slot, None)
        if conn is None:
            conn = self._connect(slot, self._syncs[slot])
        return conn

    def _check_file(self) -> None:
        """Still the process the backend's connections belong to, and the file at the
        path still the one opened."""
        # `unforked` is a byte in memory the kernel zeroes in a forked child: only then is
        # the pid (a system call) worth asking (`_fork._fork_marker`).
        if not unforked[0] and self._pid != os.getpid():
            self._forked_without_hook()
        # One stat per operation: a ledger deleted or replaced under a running process
        # must not become a fresh, empty ledger in which committed keys run again.
        try:
            st = os.stat(self._path_text)
        except FileNotFoundError:
            raise LedgerUnavailable(self._deleted()) from None
        if st.st_ino != self._ino or st.st_dev != self._dev:
            raise LedgerUnavailable(self._replaced(st.st_ino))

    def _connect(self, slot: str, synchronous: str) -> sqlite3.Connection:
        conn = self._tracked(synchronous)
        setattr(self._local, slot, conn)
        return conn

    def _tracked(self, synchronous: str) -> sqlite3.Connection:
        """A new connection, in the list that close() and the fork hooks close."""
        if self._closed:
            raise LedgerUnavailable(f"the ledger {self.url} is closed")
        why = tainted(self._identity) or _inherited_without_hook(self._identity)
        if why is not None:
            raise LedgerUnavailable(refusal_message(self.path, why))
        conn = self._open(synchronous)
        with self._lock:
            self._connections.append(conn)
        return conn

    def _check_sidecars(self) -> None:
        for suffix in ("-wal", "-shm"):
            check_existing_file(
                Path(f"{self.path}{suffix}"), f"ledger {suffix[1:]} file", self.allow_insecure_path
            )

    def _open(self, synchronous: str | None = None) -> sqlite3.Connection:
        if synchronous is None:
            synchronous = "NORMAL" if self._lazy else self.synchronous
        self._check_sidecars()
        conn = sqlite3.connect(
            self._uri,
            uri=True,
            isolation_level=None,
            timeout=self.busy_timeout_s,
            check_same_thread=False,
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            self._retry_busy(self._use_wal, conn)
            conn.execute(f"PRAGMA synchronous = {synchronous}")
            self._retry_busy(self._migrate, conn)
            if not self._indexes_complete:
                self._upgrade(conn)
            # SQLite opened (or created) the -wal and -shm by now: one planted by another
            # user between the check above and the open is caught here.
            self._check_sidecars()
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
                f"ledger {self.path} cannot use WAL mode (got {mode!r}), which SQLite refuses "
                "on network and read-only filesystems"
            )

    def _migrate(self, conn: sqlite3.Connection) -> None:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            raise LedgerUnavailable(
                f"ledger {self.path} has schema version {version}; this crewai-idempotent "
                f"understands up to {SCHEMA_VERSION}: a newer crewai-idempotent wrote it"
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

    def _upgrade(self, conn: sqlite3.Connection) -> None:
        """Make the index tables if they are missing (`_indexes.install`: no longer than
        making empty tables), and start filling them in the background if they are not
        complete. A ledger this process cannot write (a read-only file) keeps its listings
        on the primary key; so does one whose lock stays taken past the busy timeout,
        until a later connection tries again."""
        try:
            self._retry_busy(_indexes.install, conn)
            complete = _indexes.ready(conn)
        except sqlite3.Error as exc:
            log.debug("ledger %s: the index tables are not made now: %s", self.path, exc)
            return
        if complete:
            self._indexes_complete = True
        elif self.background_indexing:
            self._start_building()

    def _guard(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(connection, *args)` as one operation: inside the fork gate, on this
        thread's connection, after checking the process and the file (`_ready`). SQLite's
        failures become a LedgerUnavailable that names the cause. `peek`, `insert` and
        `replace` spell the same steps out: they are every call's path, and the layers
        cost a microsecond each."""
        return self._guard_in(_PLAIN, fn, *args)

    def _guard_in(self, slot: str, fn: Callable[..., T], *args: Any) -> T:
        """`_guard` on this thread's connection in `slot`."""
        gate = self._gate
        gate.enter()
        try:
            return fn(self._ready(slot), *args)
        except (sqlite3.Error, OSError) as exc:
            raise LedgerUnavailable(self._explain(exc)) from exc
        finally:
            gate.leave()

    def _deleted(self) -> str:
        return (
            f"the ledger file {self.path} was deleted while this process had it open; "
            "refusing to start an empty ledger (committed keys would run again). Restore "
            "it from a backup, or open a new ledger deliberately"
        )

    def _replaced(self, inode: int) -> str:
        return (
            f"the ledger file {self.path} was replaced while this process had it open "
            f"(it was inode {self._ino}, it is now inode {inode}); refusing "
            "to use a different ledger than the one opened. Open the ledger again "
            "deliberately if the replacement is intended"
        )

    def _drop_connections(self, *, close: bool) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        self._local = threading.local()
        self._watch = None
        if close:
            for conn in connections:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()

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
        params = (
            record.key, record.status.value, record.token, record.revision, record.updated_at,
            record.to_json(),
        )  # fmt: skip
        gate = self._gate
        gate.enter()
        try:
            # Every insert is synced: a claim lets a body start, and the rare other one (a
            # fenced record whose key was purged meanwhile) must not vanish either. Threads
            # claiming at once share one sync (`_group`).
            conn = self._ready(self._claim_slot)
            group = self._group
            doc = _claim(conn, params) if group is None else group.run(conn, _claim, params)
        except (sqlite3.Error, OSError) as exc:
            raise LedgerUnavailable(self._explain(exc)) from exc
        finally:
            gate.leave()
        return None if doc is None else read_record(doc, self._where)

    def replace(self, current: Record, new: Record) -> bool:
        params = (
            new.status.value, new.token, new.revision, new.updated_at, new.to_json(),
            current.key, current.token, current.revision,
        )  # fmt: skip
        # A takeover (PENDING under a new token) lets a body start: synced. A commit, a
        # failure, a lease renewal, a reconciliation may be lost to a power cut: the record
        # then falls back to the last synced state, which never lets a body run again.
        takeover = new.status is Status.PENDING and new.token != current.token
        gate = self._gate
        gate.enter()
        try:
            conn = self._ready(self._claim_slot if takeover else _PLAIN)
            group = self._group
            if group is None or (self._lazy and not takeover):  # a write that syncs nothing
                return conn.execute(_REPLACE, params).rowcount == 1
            return bool(group.run(conn, _changed, _REPLACE, params))
        except (sqlite3.Error, OSError) as exc:
            raise LedgerUnavailable(self._explain(exc)) from exc
        finally:
            gate.leave()

    def get(self, key: str) -> Record | None:
        doc = self._guard(_fetch_doc, key)
        return None if doc is None else read_record(doc, self._where)

    def stats(self) -> SQLiteStats:
        """What this backend is doing right now, in this process: see `SQLiteStats`.
        Raises nothing."""
        group = self._group
        writing, queued = (False, 0) if group is None else group.state()
        return SQLiteStats(writing, queued, self._gate.closed)

    def peek(self, key: str) -> Peek | None:
        gate = self._gate
        gate.enter()
        try:
            # A plain SELECT: a read transaction on the WAL, never the write lock. The
            # cursor goes with the expression, so the read ends inside the gate.
            row = self._ready(_PLAIN).execute(_GET, (key,)).fetchone()
        except (sqlite3.Error, OSError) as exc:
            raise LedgerUnavailable(self._explain(exc)) from exc
        finally:
            gate.leave()
        return None if row is None else read_peek(row[0], self._where)

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        if status is None:
            return self._scan_batches("all", (), "")
        return self._scan_batches("status", (status.value,), "")

    def scan_prefix(self, prefix: str) -> Iterator[Record]:
        # A range of the primary key: TEXT compares as UTF-8 bytes, code point order.
        end = prefix_end(prefix)
        if end is None:
            return self._scan_batches("all", (), prefix)
        return self._scan_batches("range", (), prefix, (end,))

    def _scan_batches(
        self, kind: str, head: tuple[str, ...], start: str, tail: tuple[str, ...] = ()
    ) -> Iterator[Record]:
        """Yield the rows of the scan `kind` from the key `start` on, a batch at a time.
        Each batch is one statement, read whole: no read transaction is held while the
        caller has a record (it may write, and the WAL must be free to checkpoint)."""
        rows = self._guard(_fetch_all, _SCANS[kind, ">="], (*head, start, *tail, BATCH))
        while True:
            self._scans.read(len(rows))
            for _key, doc in rows:
                yield read_record(doc, self._where)
            if len(rows) < BATCH:
                return
            after = rows[-1][0]
            rows = self._guard(_fetch_all, _SCANS[kind, ">"], (*head, after, *tail, BATCH))

    def scan_stats(self) -> ScanStats:
        """What this backend's scans have read in this process: see `ScanStats`.
        Raises nothing."""
        return self._scans.stats()

    def delete(self, current: Record) -> bool:
        return self._guard(_changed, _DELETE, (current.key, current.token, current.revision))

    def delete_many(self, records: Sequence[Record]) -> list[bool]:
        """The deletes a few at a time (`_SWEEP_ROWS`), each few one transaction on a
        connection that does not sync (a purge's deletes need not survive a power cut:
        the next synced commit's fsync of the log covers them anyway), each followed by a
        pause as long as it took, so claims waiting for the write lock get it between
        them. Raises `LedgerUnavailable` if the ledger cannot be written (the
        transactions committed before stay done)."""
        rows = [(record.key, record.token, record.revision) for record in records]
        done: list[bool] = []
        for start in range(0, len(rows), _SWEEP_ROWS):
            began = time.monotonic()
            done += self._guard_in(_SWEEP, _deleted_together, rows[start : start + _SWEEP_ROWS])
            time.sleep(time.monotonic() - began)
        return done

    # -- listings: the index tables (`_indexes`) and `Select` (`_query`) ------------------

    def select(self, query: Select) -> Iterator[Record]:
        """The records `query` selects, answered from the index tables (`_query` says
        which serves which select); while they are still being filled, from the primary
        key or the status index, filtered. Raises what `scan` raises, while iterated."""
        return self._select(query)

    def _select(self, query: Select) -> Iterator[Record]:
        plan = Query(query, self._fetch, self._scans.read, self._where)
        records = plan.indexed() if self.indexes_ready() else plan.unindexed()
        yield from records

    def _fetch(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        return self._guard(_fetch_all, sql, params)

    def indexes_ready(self) -> bool:
        """True when the index tables behind `select` hold every record, so a listing
        reads what it finds; False while an upgraded ledger's records are still being
        added to them (a listing then reads the primary key or the status index, as a
        scan does: slower, never wrong). `build_indexes()` finishes the work now. Raises
        `LedgerUnavailable` if the ledger cannot be read."""
        if not self._indexes_complete and self._guard(_indexes.ready):
            self._indexes_complete = True
        return self._indexes_complete

    def build_indexes(self, timeout_s: float | None = None) -> bool:
        """Fill the index tables of a ledger an older release made, in this thread, until
        they are complete or `timeout_s` seconds have passed (None: until complete); True
        once complete. What a process does in the background anyway, a chunk of records
        per short write transaction with pauses between (claims go on meanwhile, waiting
        for one chunk at most); another process already at it is waited for. Safe to call
        from many processes at once. Raises `ValueError` for a negative `timeout_s` and
        `LedgerUnavailable` if the ledger cannot be read or written."""
        if timeout_s is not None and not timeout_s >= 0:
            raise ValueError(f"timeout_s must be a number of seconds, 0 or more, not {timeout_s!r}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.indexes_ready():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            pause = _pause_after(*self._build_chunk())
            if deadline is not None:
                pause = min(pause, max(deadline - time.monotonic(), 0.0))
            time.sleep(pause)
        return True

    def _build_chunk(self) -> tuple[bool | None, float]:
        """One chunk of the backfill (`_indexes.backfill`); what it returned and how long
        it held the write lock. The chunk's size follows its time."""
        rows = self._chunk_rows
        started = time.monotonic()
        done = self._guard(_indexes.backfill, self._holder, rows)
        took = time.monotonic() - started
        if done is False:
            least, _, most = _CHUNK_ROWS
            scaled = int(rows * _CHUNK_S / max(took, 1e-4))
            self._chunk_rows = max(least, min(most, scaled, rows * 2))
        if done:
            self._indexes_complete = True
        return done, took

    def _start_building(self) -> None:
        with self._building_lock:
            if self._builder is not None and self._builder.is_alive():
                return
            if self._closed:
                return
            self._builder = threading.Thread(
                target=self._build_in_background,
                args=(self._stop_building,),
                name=f"crewai-idempotent index build {self.path.name}",
                daemon=True,
            )
            self._builder.start()

    def _build_in_background(self, stop: threading.Event) -> None:
        """The builder thread: chunks with pauses until the tables are complete, the
        backend closes, or the ledger cannot be used (a later connection starts again)."""
        failures = 0
        while not stop.is_set() and not self._closed:
            try:
                done, took = self._build_chunk()
            except LedgerUnavailable as exc:
                failures += 1
                if failures >= 5 or self._closed:
                    log.debug("ledger %s: index build stopped: %s", self.path, exc)
                    return
                stop.wait(self.busy_timeout_s)
                continue
            failures = 0
            if done:
                log.debug("ledger %s: index tables complete", self.path)
                return
            stop.wait(_pause_after(done, took))

    # -- changes -------------------------------------------------------------------------

    def changes(self) -> object:
        """A mark that moves when any connection (any process, this one included, the
        previous release's too) commits a write to the ledger: `PRAGMA data_version` on a
        connection kept only for asking it, which reads the WAL index's header, no record.
        Raises `LedgerUnavailable` if the ledger cannot be opened."""
        gate = self._gate
        gate.enter()
        try:
            self._check_file()
            with self._watch_lock:
                conn = self._watch
                if conn is None:
                    # Never used for a write: its own commits would not move the version.
                    conn = self._watch = self._tracked("NORMAL")
                    self._watch_id = next(_watchers)
                version = conn.execute("PRAGMA data_version").fetchone()[0]
                return (self._pid, self._watch_id, version)
        except (sqlite3.Error, OSError) as exc:
            raise LedgerUnavailable(self._explain(exc)) from exc
        finally:
            gate.leave()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_building.set()
        if self._pid != os.getpid():
            # Inherited without the fork hooks: these connections are the parent's.
            self._forked_without_hook()
            return
        # Let running operations finish before their connections go.
        quiet = self._gate.close(self.busy_timeout_s + 1.0)
        try:
            if quiet:
                self._drop_connections(close=True)
                _fork.unregister(self)
            else:
                # An operation still uses its connection: it stays tracked, so that a later
                # fork() still knows the file is open here, and closes with the object.
                self._local = threading.local()
        finally:
            self._gate.open()


_URL_OPTIONS: dict[str, Callable[[str], Any]] = {
    "synchronous": str,
    "busy_timeout_s": seconds,
    "allow_insecure_path": flag,
    "create_parents": flag,
    "background_indexing": flag,
}


def sqlite_url(path: str | os.PathLike[str]) -> str:
    """The `sqlite:` URL of `path`, made absolute."""
    return "sqlite:///" + quote(str(Path(path).absolute()), safe="/")


def _pause_after(done: bool | None, took: float) -> float:
    """How long a builder lets go of the lock after a chunk that held it `took` seconds
    (twice that); after finding another process at the work (`done` None), how long until
    it looks again."""
    return _WAIT_S if done is None else max(2 * took, _PAUSE_S)


def _claim(conn: sqlite3.Connection, params: tuple[Any, ...]) -> str | None:
    """Insert the record if its key is absent: None, else the holder's document."""
    while True:
        # Alone, one autocommit statement: SQLite runs it as its own write transaction, so
        # the insert-if-absent is atomic across threads and processes. In a batch, the
        # holder is read in the batch's transaction, so it is the record the insert met.
        if conn.execute(_INSERT, params).rowcount == 1:
            return None
        row = conn.execute(_GET, (params[0],)).fetchone()
        if row is not None:
            return str(row[0])
        # deleted between the two statements: try the claim again


def _changed(conn: sqlite3.Connection, sql: str, params: tuple[Any, ...]) -> bool:
    return conn.execute(sql, params).rowcount == 1


def _deleted_together(conn: sqlite3.Connection, rows: list[tuple[str, int, int]]) -> list[bool]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        done = [conn.execute(_DELETE, row).rowcount == 1 for row in rows]
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return done


def _fetch_doc(conn: sqlite3.Connection, key: str) -> str | None:
    row = conn.execute(_GET, (key,)).fetchone()
    return None if row is None else str(row[0])


def _fetch_all(conn: sqlite3.Connection, sql: str, params: tuple[Any, ...]) -> list[Any]:
    return conn.execute(sql, params).fetchall()


def _pin_inode(owner: object, path: Path) -> None:
    """Hold the file's inode for as long as `owner` lives.

    Without it a deleted ledger's inode number can be handed straight to a new file at the
    same path, which then passes the identity check. Only an O_PATH descriptor will do:
    closing any other descriptor of the file would drop this process's SQLite locks on it.
    """
    if not hasattr(os, "O_PATH"):
        return  # not Linux: identity rests on the open connections alone
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise LedgerUnavailable(f"cannot open ledger file {path}: {exc}") from exc
    weakref.finalize(owner, os.close, fd)


def _inherited_without_hook(identity: tuple[int, int]) -> str | None:
    """Why a backend object inherited from a fork that skipped the hooks taints the file."""
    pid = os.getpid()
    for backend in list(_backends):
        if backend._identity == identity and backend._pid != pid and backend._connections:
            return "the fork bypassed os.register_at_fork"
    return None


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
