"""A ledger in PostgreSQL, for workers on many hosts: one row per key.

The claim is one `INSERT ... ON CONFLICT (key) DO NOTHING` statement that also returns the
holder when the key is taken, so a claim and a replay each cost one round trip. Every later
transition is one `UPDATE ... WHERE key AND token AND revision` (a compare-and-set on the
fencing token). Connections come from a `psycopg_pool.ConnectionPool`.

Every operation is bounded on the client, whatever the server does: a watchdog thread
shuts down the socket of a connection whose statements run past their deadline, because
the server's `statement_timeout` cannot fire when the server is frozen or the network
drops packets (`_deadline`). The table, its SQL and its migrations are in
`_schema`.

Leases and TTLs are measured on the server's clock: the backend reads the server's time
when it opens a connection and at most every `clock_refresh_s` afterwards, and counts the
local monotonic clock forward from that reading. A claim costs no extra round trip for
the time, and a host whose wall clock is wrong (or jumps) cannot expire another host's
lease early: all hosts measure against the same server.

How durable an acknowledged claim is depends on the server's settings: `fsync`,
`synchronous_commit` (as the server reports it for this backend's own sessions, so a role's
or a database's setting counts), `full_page_writes`, and, where standbys stream from the
server, `synchronous_standby_names`. The first use reads them and warns
(`PostgresDurabilityWarning`) if one of them can lose an acknowledged claim, whose body
would then run again; `doctor` reports the same (`durability_problems`).

A connection's life is told in one class: the pool, the direct bridge beside it while
the pool reconnects, what fork() leaves of them, the deadline of each call and the one
resend after a lost connection decide together whether a call may be sent again.
"""

from __future__ import annotations

import itertools
import logging
import math
import select
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Self, TypeVar
from urllib.parse import urlunsplit

try:
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg.conninfo import conninfo_to_dict
    from psycopg.pq import Conninfo, ConnStatus
    from psycopg_pool import ConnectionPool, PoolTimeout
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        f"the PostgreSQL ledger needs psycopg 3 and psycopg_pool ({exc}), which the "
        "'crewai-idempotent[postgres]' extra installs"
    ) from exc

from ..._errors import LedgerUnavailable, PostgresDurabilityWarning
from ...ledger import _fork
from ...ledger._backend import DOCUMENTS, CacheBackend, prefix_end
from ...ledger._record import Record, Status, read_record
from ...ledger._select import Order, Select
from .._clock import ServerClock
from .._options import configuration_errors, flag, redact, split_server_options, with_options
from .._scan import BATCH, ScanCounter, ScanStats
from ._deadline import GRACE_S, Budget, Connecting, watchdog
from ._durability import durability_problems, read_durability
from ._schema import DEFAULT_TABLE, SCHEMA_VERSION, Statements, check_version, migrate
from ._select import Plan
from ._upgrade import (
    Found,
    Objects,
    build,
    create_with_table,
    inspect,
    statements_for_a_person,
)

log = logging.getLogger("crewai_idempotent")

T = TypeVar("T")


class PostgresCacheBackend(CacheBackend):
    """A ledger table in PostgreSQL, shared by every worker that connects to it.

    `dsn_or_pool` is a libpq connection string or URL (`postgresql://user@host/db`), or a
    `psycopg_pool.ConnectionPool` you manage (give its connections `autocommit=True` to
    save a round trip per operation; this backend never closes a pool it did not create).

    The `table` (default `crewai_idempotency_records`, optionally in `schema`) is created or
    migrated on first use; its version is kept in `crewai_idempotency_schema`. Migrations
    take an advisory lock, so many workers can start at once.

    The pool keeps between `min_size` and `max_size` connections. With the default
    `min_size=0` it opens connections as calls need them, so a single-threaded worker
    keeps reusing one (psycopg_pool hands connections out in turn, and alternating
    between idle server processes costs latency on every call).

    Every call ends within `timeout_s + statement_timeout_s` (plus a quarter second),
    whatever the server does: `timeout_s` bounds getting a connection (from the pool, or
    a new one, each attempt also within `connect_timeout_s`), and `statement_timeout_s`
    the statements, on the server and, for a server that does not answer at all, on the
    client, which then drops the connection. A resend after a lost connection runs in
    what is left. Any of them running out raises `LedgerUnavailable`, so a guarded body
    never runs unclaimed.

    With `check_durability` (the default) the first use reads the server's durability
    settings and warns (`PostgresDurabilityWarning`) if one can lose an acknowledged claim.
    `clock_refresh_s` is how often the server's clock is read again (leases and TTLs are
    judged by it).

    A table made by an earlier version lacks the indexes this version's listings read by
    and the trigger behind `changes()`: with `build_in_background` (the default) the
    first use starts building them in a thread, on a connection of its own, without
    blocking claims (`build_indexes()`); without it, they wait for `build_indexes()`.
    `indexes_ready()` says whether they are there.

    Raises `ValueError` for a duration or size out of range and `TypeError` for a
    `dsn_or_pool` that is neither; nothing is connected until first use (or
    `check_reachable()`).
    """

    def __init__(
        self,
        dsn_or_pool: str | ConnectionPool[Any],
        *,
        table: str = DEFAULT_TABLE,
        schema: str | None = None,
        min_size: int = 0,
        max_size: int = 10,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        statement_timeout_s: float = 10.0,
        clock_refresh_s: float = 60.0,
        check_durability: bool = True,
        build_in_background: bool = True,
    ) -> None:
        for name, value in (
            ("timeout_s", timeout_s),
            ("connect_timeout_s", connect_timeout_s),
            ("statement_timeout_s", statement_timeout_s),
            ("clock_refresh_s", clock_refresh_s),
        ):
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
        if not 0 <= min_size <= max_size or max_size < 1:
            raise ValueError(
                f"need 0 <= min_size <= max_size and max_size >= 1, not {min_size}, {max_size}"
            )
        self.table = table
        self.schema = schema
        self.min_size, self.max_size = min_size, max_size
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.statement_timeout_s = float(statement_timeout_s)
        self._sql = Statements(table, schema)
        self._given_pool: ConnectionPool[Any] | None
        if isinstance(dsn_or_pool, ConnectionPool):
            self._given_pool = dsn_or_pool
            conninfo = dsn_or_pool.conninfo
            self._conninfo = conninfo if isinstance(conninfo, str) else ""
        elif isinstance(dsn_or_pool, str):
            self._given_pool = None
            self._conninfo = dsn_or_pool
        else:
            raise TypeError(
                "PostgresCacheBackend needs a connection string/URL or a psycopg_pool."
                f"ConnectionPool, not {type(dsn_or_pool).__name__}"
            )
        self.where = _describe(self._conninfo)
        # Once per backend, not per process: a forked child's server is its parent's.
        self.check_durability = check_durability
        self.build_in_background = build_in_background
        self._durability_checked = not check_durability
        self._clock = ServerClock("PostgreSQL", self._read_clock, clock_refresh_s)
        self._closed = False
        self._documents_indexed = False
        self._scans = ScanCounter()
        self._reset_process_state()
        _fork.register(self)

    def __repr__(self) -> str:
        return f"PostgresCacheBackend({self.where!r}, table={self._sql.label!r})"

    @property
    def url(self) -> str:
        """The URL that names this ledger, its password as `***` (for messages and the
        CLI's --ledger)."""
        options: dict[str, Any] = {}
        if self.table != DEFAULT_TABLE:
            options["table"] = self.table
        if self.schema is not None:
            options["schema"] = self.schema
        if self._conninfo.startswith(("postgresql://", "postgres://")):
            return with_options(redact(self._conninfo), options)
        return with_options(f"postgresql://{self.where}", options)  # key=value or a pool

    @classmethod
    def from_url(cls, url: str) -> Self:
        """`postgresql://user:pass@host:port/db?table=...&max_size=...`; libpq's own
        parameters (sslmode, application_name, ...) go to libpq exactly as written; any
        other option is refused (`LedgerConfigurationError`), as is a malformed `url`."""
        parts, options = split_server_options(
            url, "PostgreSQL", _OPTIONS, libpq_parameters(), _REFUSED
        )
        with configuration_errors():
            return cls(urlunsplit(parts._replace(scheme="postgresql")), **options)

    # -- connections -------------------------------------------------------------------

    def _reset_process_state(self, inherited: bool = False) -> None:
        """Fresh per-process state. After fork() the parent's pool must never be used:
        its sockets are shared with the parent and its worker threads are gone."""
        if inherited and self._given_pool is None and self._pool is not None:
            _abandon(self._pool)
        self._inherited = inherited
        self._lock = threading.Lock()
        self._pool: ConnectionPool[Any] | None = None
        self._schema_ready = False
        self._degraded = False
        self._direct = threading.BoundedSemaphore(2)
        self._clock.after_fork()
        # What the catalog holds of the indexes and the change mark (`_upgrade`), when it
        # was last read, and the thread that builds what a table made before lacks.
        self._found: Found | None = None
        self._objects: Objects | None = None
        self._found_at = -math.inf
        self._builder: threading.Thread | None = None
        self._stop_building = threading.Event()

    # -- fork() (see _fork) ------------------------------------------------------------

    def before_fork(self) -> None:
        pass  # nothing to quiesce: the child never touches what the parent holds

    def after_fork_in_parent(self) -> None:
        pass

    def after_fork_in_child(self) -> None:
        self._reset_process_state(inherited=True)

    def _pool_here(self) -> ConnectionPool[Any]:
        pool = self._pool
        if pool is not None:
            return pool
        with self._lock:
            if self._closed:
                raise LedgerUnavailable(f"the ledger {self.url} is closed")
            if self._pool is None:
                if self._given_pool is None:
                    self._pool = self._new_pool()
                elif self._inherited:
                    raise LedgerUnavailable(
                        f"{self.url}: a ConnectionPool passed in cannot be used after fork(); "
                        "only a pool and a backend made in the child process can"
                    )
                else:
                    self._pool = self._given_pool
            return self._pool

    def _new_pool(self) -> ConnectionPool[Any]:
        pool: ConnectionPool[Any] = ConnectionPool(
            self._conninfo,
            min_size=self.min_size,
            max_size=self.max_size,
            timeout=self.timeout_s,
            kwargs=self._connect_kwargs(),
            configure=self._configure,
            name="crewai-idempotent",
            open=False,
        )
        pool.open(wait=False)
        return pool

    def _connect_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "autocommit": True,
            # libpq counts whole seconds, at least 2; the caller's wait is bounded anyway
            "connect_timeout": max(2, math.ceil(self.connect_timeout_s)),
        }
        if "application_name" not in conninfo_to_dict(self._conninfo):
            kwargs["application_name"] = "crewai-idempotent"
        return kwargs

    def _configure(self, conn: psycopg.Connection[Any], by: float | None = None) -> None:
        """Every new connection: set the statement timeout and read the server clock,
        in one round trip, within connect_timeout_s (or by `by`, if sooner)."""
        deadline = time.monotonic() + self.connect_timeout_s
        guard = watchdog.arm(conn, min(deadline, by or deadline))
        sent = time.monotonic()
        try:
            row = conn.execute(
                "SELECT set_config('statement_timeout', %s, false), "
                "extract(epoch from clock_timestamp())::float8",
                (f"{round(self.statement_timeout_s * 1000)}ms",),
            ).fetchone()
        except BaseException:
            if watchdog.disarm(guard):
                conn.close()
            raise
        if watchdog.disarm(guard):
            conn.close()  # never hand out a connection whose socket was being cut
            raise psycopg.OperationalError("the new connection was cut: it answered too late")
        assert row is not None
        self._clock.record(float(row[1]), sent, time.monotonic())

    def _run(
        self,
        what: str,
        op: Callable[[psycopg.Connection[Any], bool], T],
        resent: bool,
        budget: Budget,
    ) -> T:
        pool = self._pool or self._pool_here()
        conn = self._checkout(pool, what, budget)
        if conn is not None:
            try:
                return self._use(conn, what, op, resent, budget)
            finally:
                pool.putconn(conn)  # the pool drops a connection that broke or was cut
        # A bridge while the pool reconnects, not a way around max_size: at most two
        # direct connections at a time, however many threads are waiting. Without it the
        # server-restart tests still pass, but a call to a server that is down would wait
        # out timeout_s and say only that no connection came: the pool keeps the cause to
        # its log. test_server_faults.py::test_no_server_means_no_run requires the cause.
        if not self._direct.acquire(timeout=max(budget.connect_by - time.monotonic(), 0.0)):
            raise LedgerUnavailable(
                f"no connection to PostgreSQL at {self.where} within timeout_s="
                f"{self.timeout_s} while {what}: the pool is reconnecting or all its "
                "connections are busy"
            )
        conn = self._connect_directly(what, budget)  # releases _direct when it fails
        try:
            return self._use(conn, what, op, resent, budget)
        finally:
            conn.close()
            self._direct.release()

    def _use(
        self,
        conn: psycopg.Connection[Any],
        what: str,
        op: Callable[[psycopg.Connection[Any], bool], T],
        resent: bool,
        budget: Budget,
    ) -> T:
        """Run `op` on `conn` within statement_timeout_s (and the operation's budget),
        enforced here as well as on the server."""
        deadline = min(time.monotonic() + self.statement_timeout_s, budget.done_by)
        guard = watchdog.arm(conn, deadline + GRACE_S)
        try:
            if not self._schema_ready:
                self._ensure_schema(conn)
            if conn.autocommit:
                result = op(conn, resent)
            else:
                with conn:  # a pool passed in may hand out connections that open transactions
                    result = op(conn, resent)
        except psycopg.Error as exc:
            if watchdog.disarm(guard):
                conn.close()
                raise LedgerUnavailable(
                    f"PostgreSQL at {self.where} did not answer within statement_timeout_s="
                    f"{self.statement_timeout_s} while {what} (a frozen or overloaded server, "
                    "or a network that drops packets); the connection was dropped"
                ) from exc
            raise
        except BaseException:
            if watchdog.disarm(guard):
                conn.close()
            raise
        if watchdog.disarm(guard):
            conn.close()  # the answer came in time, but the socket was being cut
        return result

    def _checkout(
        self, pool: ConnectionPool[Any], what: str, budget: Budget
    ) -> psycopg.Connection[Any] | None:
        """A live pooled connection, or None when the pool has none to give in time."""
        if self._degraded:
            # While the pool is reconnecting, take a ready connection if there is one,
            # else go direct at once rather than wait out the pool's back-off every call.
            until = time.monotonic() + 0.02
        else:
            # Keep time for a direct attempt, which names the cause if the server is gone.
            until = budget.connect_by - min(self.connect_timeout_s, self.timeout_s / 2)
        while True:
            try:
                conn = pool.getconn(timeout=max(until - time.monotonic(), 0.01))
            except PoolTimeout:
                return None
            except psycopg.Error as exc:  # e.g. the pool was closed under us
                raise LedgerUnavailable(self._explain(exc, what)) from exc
            if _alive(conn):
                self._degraded = False
                return conn
            # An idle connection the server already closed (it restarted, or an admin
            # ended the session): drop it, and take the next without a round trip lost.
            conn.close()
            pool.putconn(conn)

    def _connect_directly(self, what: str, budget: Budget) -> psycopg.Connection[Any]:
        """One connection outside the pool, used while the pool cannot provide one.

        The pool reconnects in the background with a growing back-off; meanwhile this
        gives the caller the specific reason the server is unreachable, or, once it is
        back, serves the call at once instead of waiting for the pool's next attempt.
        libpq's connect_timeout counts whole seconds per host address, so the attempt
        runs in a thread that the caller stops waiting for when its time is up. Holds
        `_direct` (taken by the caller) until the connection is closed; releases it
        itself when it raises.
        """
        pool = self._pool_here()
        conninfo = pool.conninfo if isinstance(pool.conninfo, str) else self._conninfo
        kwargs = dict(pool.kwargs) if isinstance(pool.kwargs, dict) else {}
        kwargs.setdefault("connect_timeout", max(2, math.ceil(self.connect_timeout_s)))
        attempt = Connecting(conninfo, kwargs, self._direct)
        wait = min(self.connect_timeout_s, budget.connect_by - time.monotonic())
        try:
            conn = attempt.result(max(wait, 0.01))
        except psycopg.Error as exc:
            self._degraded = True
            raise LedgerUnavailable(
                f"cannot reach PostgreSQL at {self.where} while {what} (no pooled connection "
                f"in time; a direct attempt failed): {_one_line(exc)}"
            ) from exc
        except TimeoutError:
            self._degraded = True
            raise LedgerUnavailable(
                f"cannot reach PostgreSQL at {self.where} while {what}: no connection within "
                f"timeout_s={self.timeout_s} (connect_timeout_s={self.connect_timeout_s}); "
                "the server does not answer (frozen, overloaded, or the network drops packets)"
            ) from None
        self._degraded = True
        try:
            if not conn.autocommit:
                conn.autocommit = True
            self._configure(conn, budget.done_by)
        except BaseException as exc:
            conn.close()
            self._direct.release()
            if isinstance(exc, psycopg.Error):
                raise LedgerUnavailable(
                    f"cannot reach PostgreSQL at {self.where} while {what}: a new connection "
                    f"did not answer within connect_timeout_s={self.connect_timeout_s}: "
                    f"{_one_line(exc)}"
                ) from exc
            raise
        return conn

    def _call(
        self, what: str, op: Callable[[psycopg.Connection[Any], bool], T], *, retry: bool
    ) -> T:
        """Run `op(conn, resent)` on a connection, within timeout_s to get the connection
        and statement_timeout_s for the statements. When a connection breaks under a
        statement and `retry` is set, `op` runs once more on another connection with
        `resent=True` (the first statement may or may not have been applied), within
        what is left of that time."""
        budget = Budget(self.timeout_s, self.statement_timeout_s)
        attempts = 2 if retry else 1
        for attempt in range(1, attempts + 1):
            try:
                return self._run(what, op, attempt > 1, budget)
            except LedgerUnavailable:
                raise
            except psycopg.OperationalError as exc:
                lost = not isinstance(exc, pg_errors.QueryCanceled)
                if lost and attempt < attempts and time.monotonic() < budget.connect_by:
                    log.info("PostgreSQL connection lost while %s; trying once more", what)
                    continue
                raise LedgerUnavailable(self._explain(exc, what)) from exc
            except psycopg.Error as exc:
                raise LedgerUnavailable(self._explain(exc, what)) from exc
        raise AssertionError("unreachable")

    def _explain(self, exc: BaseException, what: str) -> str:
        if isinstance(exc, pg_errors.QueryCanceled):
            why = f"did not finish within statement_timeout_s={self.statement_timeout_s}"
        elif isinstance(exc, pg_errors.UndefinedTable):
            why = f"has no ledger table {self._sql.label} (was it dropped?)"
        elif isinstance(exc, pg_errors.InsufficientPrivilege):
            why = f"refused access to {self._sql.label}"
        elif isinstance(exc, pg_errors.ReadOnlySqlTransaction):
            why = "is read-only (a standby?); the ledger needs the primary"
        elif isinstance(exc, psycopg.OperationalError):
            why = "lost the connection"
        else:
            why = "failed"
        return f"PostgreSQL at {self.where} {why} while {what}: {_one_line(exc)}"

    # -- schema ------------------------------------------------------------------------

    def _ensure_schema(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            if self._schema_ready:
                return
            sql = self._sql
            try:
                row = conn.execute(sql.version, (self.table,)).fetchone()
            except pg_errors.UndefinedTable:
                row = None
                if not conn.autocommit:
                    conn.rollback()
            if row is None or row[0] != SCHEMA_VERSION:
                check_version(row[0] if row else 0, sql, self.where)
                migrate(conn, sql, self.where, self._create_with_table)
            found = inspect(conn, sql)
            if not conn.autocommit:
                conn.commit()
            self._note(found)
            if (
                found is not None
                and not self._ready(found)
                and self.build_in_background
                and not self._closed
            ):
                self._start_building()
            self._schema_ready = True
            if not self._durability_checked:
                self._durability_checked = True
                self._warn_if_not_durable(conn)

    # -- durability --------------------------------------------------------------------

    def durability(self) -> dict[str, str]:
        """The server's durability settings as this backend's sessions see them:
        `fsync`, `synchronous_commit`, `full_page_writes`, `synchronous_standby_names`,
        and `standbys` (how many stream from it now). See `durability_problems`. Raises
        `LedgerUnavailable` if the server cannot be asked."""
        return self._call(
            "reading its durability settings",
            lambda conn, _resent: read_durability(conn),
            retry=True,
        )

    def _warn_if_not_durable(self, conn: psycopg.Connection[Any]) -> None:
        try:
            settings = read_durability(conn)
        except psycopg.Error as exc:
            log.info("cannot read the durability settings of PostgreSQL at %s (%s)",
                     self.where, _one_line(exc))  # fmt: skip
            if not conn.autocommit:
                conn.rollback()
            return
        for setting, risk in durability_problems(settings):
            message = f"PostgreSQL at {self.where}: {setting}: {risk}"
            log.warning("%s", message)
            warnings.warn(message, PostgresDurabilityWarning, stacklevel=2)

    # -- clock -------------------------------------------------------------------------

    def now(self) -> float:
        return self._clock.now()

    def now_blocks(self) -> bool:
        return self._clock.blocks()

    def _read_clock(self) -> float | None:
        def read(conn: psycopg.Connection[Any], _resent: bool) -> float | None:
            if not self._clock.due():
                return None  # the connection was just opened, and _configure read the clock
            row = conn.execute("SELECT extract(epoch from clock_timestamp())::float8").fetchone()
            assert row is not None
            return float(row[0])

        return self._call("reading the server clock", read, retry=True)

    # -- protocol ----------------------------------------------------------------------

    def insert(self, record: Record) -> Record | None:
        doc = record.to_json()
        params = {
            "key": record.key, "status": record.status.value, "token": record.token,
            "revision": record.revision, "updated_at": record.updated_at, "doc": doc,
        }  # fmt: skip

        def claim(conn: psycopg.Connection[Any], resent: bool) -> tuple[bool, str | None]:
            rows = conn.execute(self._sql.claim, params).fetchall()
            if rows:
                held = rows[0][0]
            else:
                # The holder committed after this statement's snapshot was taken.
                row = conn.execute(self._sql.get, (record.key,)).fetchone()
                held = None if row is None else row[0]
                if held is None:
                    return False, None
            # Sent again after a lost connection, finding exactly our record: the first
            # attempt landed. (The owner id in every claim is random, so no one else's
            # record is ever identical.)
            return held is None or (resent and held == doc), held

        while True:
            stored, held = self._call(f"claiming {record.key!r}", claim, retry=True)
            if stored:
                return None
            if held is not None:
                return self._decode(held)
            # deleted between the two statements: claim again

    def replace(self, current: Record, new: Record) -> bool:
        params = {
            "status": new.status.value, "token": new.token, "revision": new.revision,
            "updated_at": new.updated_at, "doc": new.to_json(), "key": current.key,
            "current_token": current.token, "current_revision": current.revision,
        }  # fmt: skip
        # A row that already holds exactly `new` counts as replaced: an earlier send of
        # this same write landed and its reply was lost, and this backend or the ledger
        # sent it again. No other writer produces an identical record: every record
        # carries its time and a random owner id.
        return self._call(
            f"updating {current.key!r}",
            lambda conn, _resent: conn.execute(self._sql.replace, params).rowcount == 1,
            retry=True,
        )

    def get(self, key: str) -> Record | None:
        row = self._call(
            f"reading {key!r}",
            lambda conn, _resent: conn.execute(self._sql.get, (key,)).fetchone(),
            retry=True,
        )
        return None if row is None else self._decode(row[0])

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        if status is None:
            return self._scan_batches("all", (), "")
        return self._scan_batches("status", (status.value,), "")

    def scan_prefix(self, prefix: str) -> Iterator[Record]:
        end = prefix_end(prefix)
        if end is not None and prefix.startswith(DOCUMENTS):
            self._check_documents_index()
            return self._scan_batches("documents", (end,), prefix)
        # Another prefix has no index in byte order (the primary key's is the collation's):
        # each batch would read and sort the table again, so it is one statement.
        params: tuple[str, ...] = (end, prefix) if end is not None else (prefix,)
        query = self._sql.scans["range" if end is not None else "from", True]
        query = query.removesuffix(" LIMIT %s")
        rows = self._call(
            "listing records by key",
            lambda conn, _resent: conn.execute(query, params).fetchall(),
            retry=True,
        )
        self._scans.read(len(rows))
        return iter([self._decode(doc) for _key, doc in rows])

    def _scan_batches(self, kind: str, head: tuple[str, ...], start: str) -> Iterator[Record]:
        """Yield the rows of the scan `kind` from the key `start` on, a batch at a time.
        Each batch is one call: its connection goes back to the pool before a record is
        yielded, so a caller that stops iterating holds none."""
        sql = self._sql.scans

        def batch(query: str, at: str) -> Callable[[psycopg.Connection[Any], bool], list[Any]]:
            # Never prepared: a generic plan, not knowing the status asked for, would
            # read a common status's rows through its index and sort them every batch.
            return lambda conn, _resent: conn.execute(
                query, (*head, at, BATCH), prepare=False
            ).fetchall()

        rows = self._call("listing records", batch(sql[kind, True], start), retry=True)
        while True:
            self._scans.read(len(rows))
            for _key, doc in rows:
                yield self._decode(doc)
            if len(rows) < BATCH:
                return
            after = rows[-1][0]
            rows = self._call("listing records", batch(sql[kind, False], after), retry=True)

    def scan_stats(self) -> ScanStats:
        """What this backend's scans have read in this process: see `ScanStats`.
        Raises nothing."""
        return self._scans.stats()

    # -- listings, and the indexes they read by (`_select`, `_upgrade`) ------------------

    def select(self, query: Select) -> Iterator[Record]:
        """The records `query` selects, in its order, from its `after` on, at most its
        `limit` (see `CacheBackend.select`), read from the table's indexes in batches of
        at most 500 rows, one statement each (`_select`), each counted in `scan_stats()`.
        Until a table made by an earlier version has its indexes (`indexes_ready()`) the
        same statements are answered without them: right, but slower. Raises `TypeError`
        for a `query` that is not a `Select`, and `LedgerUnavailable` while it is
        iterated, if the server cannot be read."""
        if not isinstance(query, Select):
            raise TypeError(f"select() takes a Select, not {type(query).__name__}")
        if "\x00" in query.prefix:
            return iter(())  # no key holds a NUL (and PostgreSQL text cannot)
        return self._select_batches(query)

    def _select_batches(self, query: Select) -> Iterator[Record]:
        found = self._upgrade_state()
        plan = Plan(self._sql, self._objects, found, query)
        limit, after, given = query.limit, query.after, 0

        def batch(text: str, params: list[Any]) -> Callable[[psycopg.Connection[Any], bool], Any]:
            return lambda conn, _resent: conn.execute(text, params, prepare=False).fetchall()

        while True:
            size = BATCH if limit is None else min(BATCH, limit - given)
            rows = self._call("listing records", batch(*plan.statement(after, size)), retry=True)
            self._scans.read(len(rows))
            for _key, doc, _at in rows:
                record = self._decode(doc)
                # An index may over-include (model content that reads like a field), and
                # fields without their function yet are not in the statement at all.
                if query.matches(record) and query.beyond(record):
                    yield record
                    given += 1
                    if limit is not None and given >= limit:
                        return
            if len(rows) < size:
                return
            key, _doc, at = rows[-1]
            after = key if query.order is Order.KEY else (at, key)

    def changes(self) -> object | None:
        """A mark that differs after any write to the ledger by any process (the previous
        release's writers included), read without reading a record: the value of a
        sequence that a trigger on the table moves with every row written. It is read
        settled only when no writer holds the table's ROW EXCLUSIVE lock (which each
        keeps from before its rows until its commit is visible); while one does, every
        mark is a new one, so a reader never settles on a mark whose write it cannot see
        yet. None until a table made by an earlier version has its trigger
        (`indexes_ready()`). Raises `LedgerUnavailable` if the server cannot be asked."""
        found = self._upgrade_state()
        objects = self._objects
        if found is None or objects is None or not found.has_mark:
            return None
        row = self._call(
            "reading the ledger's change mark",
            lambda conn, _resent: conn.execute(objects.read_mark).fetchone(),
            retry=True,
        )
        assert row is not None
        value, called, settled = row
        count = int(value) if called else 0
        if not settled:
            return ("moving", count, next(_moving))
        return ("settled", count)

    def indexes_ready(self) -> bool:
        """True when the table has every index this version's listings read by and the
        trigger behind `changes()`, all valid. A table made by an earlier version gets
        them in the background (`build_indexes`) when this version first opens it: until
        then `select` reads without them (right, slower) and `changes()` is None. Reads
        the catalog (one statement) every time. Raises `LedgerUnavailable` if the server
        cannot be asked."""
        found = self._upgrade_state(refresh=True)
        return found is not None and self._ready(found)

    def build_indexes(self) -> bool:
        """Build what `indexes_ready()` finds missing now, on a connection of this call's
        own without a statement timeout: CREATE INDEX CONCURRENTLY (claims go on
        meanwhile), after the functions, the sequence and the trigger (which waits at
        most 100 ms at a time for the writers in flight, and tries again). An index an
        interrupted build left INVALID is built again. True when everything is ready;
        False when another process is building them (it holds the table's build lock).
        A backend starts this in a thread of its own when it first opens a table that
        lacks them. Raises `LedgerUnavailable` if the server cannot be reached, or the
        role may not build them (the message holds the statements a table owner runs)."""
        try:
            return self._build_once(threading.Event())
        except pg_errors.InsufficientPrivilege as exc:
            raise LedgerUnavailable(self._refused(exc)) from exc
        except psycopg.Error as exc:
            raise LedgerUnavailable(self._explain(exc, "building the ledger's indexes")) from exc

    def _ready(self, found: Found) -> bool:
        objects = self._objects
        return objects is not None and not found.missing(objects)

    def _note(self, found: Found | None) -> None:
        if found is not None and self._objects is None:
            self._objects = Objects(self._sql, found.namespace)
        self._found, self._found_at = found, time.monotonic()

    def _create_with_table(self, conn: psycopg.Connection[Any]) -> None:
        found = inspect(conn, self._sql)
        if found is not None:
            create_with_table(conn, Objects(self._sql, found.namespace), found)

    def _upgrade_state(self, refresh: bool = False) -> Found | None:
        """What the catalog holds of the table's objects: read again while they are not
        ready, at most every few seconds, or now (`refresh`)."""
        found = self._found
        if (
            found is not None
            and not refresh
            and (self._ready(found) or time.monotonic() - self._found_at < 5.0)
        ):
            return found
        asked = time.monotonic()

        def read(conn: psycopg.Connection[Any], _resent: bool) -> Found | None:
            if self._found_at >= asked:
                return self._found  # the first call of this process has just read it
            return inspect(conn, self._sql)

        found = self._call("reading the ledger's indexes", read, retry=True)
        self._note(found)
        return found

    def _start_building(self) -> None:
        """Under `_lock`: the builder thread, unless one runs in this process."""
        if self._builder is not None and self._builder.is_alive():
            return
        self._builder = threading.Thread(
            target=self._build_in_background,
            args=(self._stop_building,),
            name="crewai-idempotent-pg-indexes",
            daemon=True,
        )
        self._builder.start()

    def _build_in_background(self, stop: threading.Event) -> None:
        pause = 1.0
        while not stop.is_set():
            try:
                if self._build_once(stop):
                    return
            except pg_errors.InsufficientPrivilege as exc:
                log.warning("%s", self._refused(exc))
                return
            except (psycopg.Error, OSError) as exc:
                log.info("building the indexes of %s at %s failed (%s); trying again",
                         self._sql.label, self.where, _one_line(exc))  # fmt: skip
            stop.wait(pause)
            pause = min(pause * 2, 60.0)

    def _build_once(self, stop: threading.Event) -> bool:
        pool = self._pool_here()
        conninfo = pool.conninfo if isinstance(pool.conninfo, str) else self._conninfo
        kwargs = dict(pool.kwargs) if isinstance(pool.kwargs, dict) else {}
        kwargs.update(autocommit=True, application_name="crewai-idempotent index build")
        kwargs.setdefault("connect_timeout", max(2, math.ceil(self.connect_timeout_s)))
        with psycopg.connect(conninfo, **kwargs) as conn:
            conn.execute("SET statement_timeout = 0")
            found = inspect(conn, self._sql)
            self._note(found)
            objects = self._objects
            if found is None or objects is None or self._ready(found):
                return found is not None
            held = conn.execute("SELECT pg_try_advisory_lock(%s)", (objects.build_lock,))
            if not held.fetchone()[0]:  # type: ignore[index]
                return False  # another process builds them
            log.info("ledger table %s at %s lacks %s: building them without blocking "
                     "claims", self._sql.label, self.where,
                     ", ".join(found.missing(objects)))  # fmt: skip
            found = build(conn, objects, stop)
            self._note(found)
            # The session's end releases the build lock.
            return found is not None and self._ready(found)

    def _refused(self, exc: psycopg.Error) -> str:
        objects = self._objects
        statements = "" if objects is None else statements_for_a_person(objects, self._found)
        return (
            f"ledger table {self._sql.label} at {self.where} lacks the indexes this version "
            f"lists records by, and this role may not build them ({_one_line(exc)}); listings read "
            "without them (slower) and changes() is None. The table's owner builds them "
            f"with:\n{statements}"
        )

    def _check_documents_index(self) -> None:
        """A table made by an earlier version has no index of the documents: their scans
        read the whole table then. Said once, with the statement that builds it."""
        if self._documents_indexed:
            return
        found = self._call(
            "looking for the documents' index",
            lambda conn, _resent: conn.execute(
                "SELECT to_regclass(%s) IS NOT NULL", (self._sql.docs_index_name,)
            ).fetchone(),
            retry=True,
        )
        self._documents_indexed = True
        if found is not None and not found[0]:
            log.warning(
                "ledger table %s at %s has no index of its documents (it was made before "
                "there was one): the outbox's dispatcher reads the whole table on every "
                "poll. Build it without blocking writes with: %s",
                self._sql.label, self.where, self._sql.create_docs_index,
            )  # fmt: skip

    def delete(self, current: Record) -> bool:
        # Not retried: a delete that landed before a lost connection would report False.
        return self._call(
            f"deleting {current.key!r}",
            lambda conn, _resent: conn.execute(
                self._sql.delete, (current.key, current.token, current.revision)
            ).rowcount == 1,
            retry=False,
        )  # fmt: skip

    def delete_many(self, records: Sequence[Record]) -> list[bool]:
        """The deletes as one statement, one commit for the batch; row locks only on the
        rows it deletes, so claims of other keys never wait for it. Not retried, as
        `delete` is not. Raises `LedgerUnavailable` if the ledger cannot be written."""
        if not records:
            return []
        columns = ([r.key for r in records], [r.token for r in records],
                   [r.revision for r in records])  # fmt: skip

        def run(conn: psycopg.Connection[Any], _resent: bool) -> set[str]:
            return {str(row[0]) for row in conn.execute(self._sql.delete_many, columns)}

        deleted = self._call(f"deleting {len(records)} records", run, retry=False)
        return [record.key in deleted for record in records]

    def _decode(self, doc: str) -> Record:
        return read_record(doc, f"{self._sql.label} at {self.where}")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._stop_building.set()
            pool, self._pool = self._pool, None
        if pool is not None and self._given_pool is None:
            pool.close(timeout=5.0)

    def check_reachable(self) -> None:
        """Connect once, outside the pool, within connect_timeout_s, and hang up:
        `LedgerUnavailable` if the server does not answer. For a configuration step
        (`configure()`, `Crew(...)`), so that a wrong host or a server that is down is
        reported where it was named. A pool passed in is yours to check. Raises
        `LedgerUnavailable` if the server does not answer."""
        if self._given_pool is not None:
            return
        try:
            conn = psycopg.connect(self._conninfo, **self._connect_kwargs())
        except psycopg.Error as exc:
            raise LedgerUnavailable(
                "the PostgreSQL server did not accept a connection within "
                f"connect_timeout_s={self.connect_timeout_s:g}: {_one_line(exc)}"
            ) from exc
        conn.close()


def _alive(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection is still open, without a round trip.

    An idle connection has nothing to read unless the server sent a termination (it is
    shutting down, or an admin ended the session) or closed the socket, so anything
    waiting on the socket means the connection is finished.
    """
    if conn.closed or conn.pgconn.status != ConnStatus.OK:
        return False
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError, psycopg.Error):
        return False
    return not readable


def _describe(conninfo: str) -> str:
    """host:port/dbname for messages; never the password."""
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.Error:
        return "<unparsable connection string>"
    host = params.get("host") or params.get("hostaddr") or "localhost"
    port = params.get("port") or "5432"
    user = params.get("user")
    who = f"{user}@" if user else ""
    return f"{who}{host}:{port}/{params.get('dbname') or user or ''}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# Each "moving" change mark is a new one (`changes()`).
_moving = itertools.count()

_abandoned: list[ConnectionPool[Any]] = []


def _abandon(pool: ConnectionPool[Any]) -> None:
    """Forget a pool inherited through fork() without touching its connections: closing
    one would send Terminate on a socket the parent is using. psycopg does not close a
    connection it collects in another process than the one that opened it, but the pool's
    finalizer would signal worker threads that the child does not have; so the pool is
    kept referenced and marked closed, which makes its finalizer do nothing."""
    _abandoned.append(pool)
    pool._closed = True


# URL options: the backend's own, and libpq's connection parameters (passed through).
_OPTIONS: dict[str, Callable[[str], Any]] = {
    "table": str,
    "schema": str,
    "min_size": int,
    "max_size": int,
    "timeout_s": float,
    "connect_timeout_s": float,
    "statement_timeout_s": float,
    "clock_refresh_s": float,
    "check_durability": flag,
    "build_in_background": flag,
}
_REFUSED = {
    "connect_timeout": "use connect_timeout_s (seconds), which bounds the ledger's own wait too",
}


def libpq_parameters() -> frozenset[str]:
    """The connection parameters the installed libpq knows (sslmode, application_name...)."""
    return frozenset(d.keyword.decode() for d in Conninfo.get_defaults()) - set(_REFUSED)
