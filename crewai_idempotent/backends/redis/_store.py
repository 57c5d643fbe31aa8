"""A ledger in Redis, for teams that already run it.

Each record is a hash (`status`, `token`, `revision`, `doc`) under `<prefix>r:<key>`, and
each status has a sorted set `<prefix>i:<STATUS>` of keys scored by their last update, so
listing the UNCERTAIN records never walks the whole keyspace. The package's own documents
(`crewai-idempotent/...`: the outbox, approvals, caps) are also in `<prefix>docs`, scored
0, so `scan_prefix` of them is one ZRANGEBYLEX. Secondary sorted sets (`<prefix>x:...`:
records that need an operator, receipts by expiry, documents by state and subject), kept
by the same scripts, answer the listings' selects (`_layout`, `_select`); `_backfill` fills
them for records written before this release or by the previous one beside it.

Every operation that writes is one Lua script (`_scripts`), which Redis runs
atomically: the claim is "create the record unless the key exists, else return the
holder", and every later transition is "write only if the stored token and revision still
match". Nothing is read in one round trip and written in another. The scripts are
idempotent (a script whose effect is already stored reports success), so this backend may
safely send one again after a connection drops before the reply.

How durable a claim is depends on the server's persistence settings: see docs/backends.md.
The backend warns when the server it talks to persists nothing, or only RDB snapshots.

Every operation ends within `timeout_s`, resends included: the socket timeouts of each
attempt are set to the time the operation has left (`_deadline`), so neither a
frozen server nor a network that drops packets can stretch it.

Beside the class: the check of the server's persistence settings (also used by `doctor`),
and the options a Redis URL may carry, checked against the installed redis-py.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Self, TypeVar
from urllib.parse import urlsplit, urlunsplit

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.connection import (
        URL_QUERY_ARGUMENT_PARSERS,
        Connection,
        SSLConnection,
        UnixDomainSocketConnection,
    )
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        f"the Redis ledger needs redis-py ({exc}), which the 'crewai-idempotent[redis]' "
        "extra installs"
    ) from exc

from ..._errors import LedgerUnavailable, RedisDurabilityWarning
from ...ledger import _fork
from ...ledger._backend import DOCUMENTS, CacheBackend, prefix_end
from ...ledger._record import Record, Status, read_record
from ...ledger._select import Select
from .._clock import ServerClock
from .._options import configuration_errors, flag, redact, split_server_options, with_options
from .._scan import BATCH, ScanCounter, ScanStats
from . import _backfill
from ._deadline import bounded, deadline
from ._layout import Layout
from ._scripts import Scripts
from ._select import answer, glob_escape

log = logging.getLogger("crewai_idempotent")

T = TypeVar("T")

DEFAULT_PREFIX = "crewai-idempotent:"


class RedisCacheBackend(CacheBackend):
    """A ledger in Redis, shared by every worker that connects to the same server.

    `url_or_client` is a `redis://` / `rediss://` URL or a `redis.Redis` client you manage
    (it is not closed by `close()`). `prefix` namespaces every key the ledger writes.
    `timeout_s` bounds each operation as a whole: connecting, the command, and the
    resends after a dropped connection or a timeout (up to `retries`, backing off 50 ms to
    0.5 s, while time is left); then `LedgerUnavailable` is raised, so a guarded body
    never runs unclaimed. (A client you pass in keeps its own socket timeouts, so each
    attempt can take that long.) A client you pass in should not retry by itself
    (`retry=Retry(NoBackoff(), 0)`): a script it resends cannot tell that it is a resend,
    and a landed claim then looks taken.
    With `check_persistence` (the default) the first use reads the server's persistence
    settings and warns (`RedisDurabilityWarning`) if a restart would lose the ledger.
    `clock_refresh_s` is how often the server's clock is read again (leases and TTLs are
    judged by it).

    Raises `ValueError` for a duration or `retries` out of range and `TypeError` for a
    `prefix` that is not a str or a `url_or_client` that is neither; nothing is connected
    until first use (or `check_reachable()`).
    """

    def __init__(
        self,
        url_or_client: str | redis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float = 5.0,
        clock_refresh_s: float = 60.0,
        check_persistence: bool = True,
        retries: int = 3,
    ) -> None:
        for name, value in (("timeout_s", timeout_s), ("clock_refresh_s", clock_refresh_s)):
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be a whole number >= 0, not {retries!r}")
        self.prefix = prefix
        self.timeout_s = float(timeout_s)
        self.check_persistence = check_persistence
        self.retries = retries
        if isinstance(url_or_client, str):
            self._url: str | None = url_or_client
        elif isinstance(url_or_client, redis.Redis):
            self._url = None
        else:
            raise TypeError(
                f"RedisCacheBackend needs a redis:// URL or a redis.Redis client, "
                f"not {type(url_or_client).__name__}"
            )
        self._owns_client = self._url is not None
        self._use_client(url_or_client if isinstance(url_or_client, redis.Redis) else None)
        self.where = _describe(self.client)
        self.layout = Layout(prefix)
        self._indexes = self.layout.indexes
        self._documents = self.layout.documents
        # Once this process has seen the secondary indexes complete, they stay so.
        self._ready = False
        self._ready_checked = False
        # Set once every document is in `_documents`, those written before it existed too.
        self._documents_complete = f"{prefix}docs:complete"
        self._documents_checked = False
        self._scans = ScanCounter()
        self._clock = ServerClock("Redis", self._read_clock, clock_refresh_s)
        self._checked = not check_persistence
        self._check_lock = threading.Lock()
        self._closed = False
        _fork.register(self)

    def _use_client(self, given: redis.Redis | None) -> None:
        if given is not None:
            self.client = given
        else:
            assert self._url is not None
            self.client = redis.Redis.from_url(
                self._url,
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
                # Resending is done here, where a resent script knows it is one.
                retry=Retry(NoBackoff(), 0),
            )
            pool = self.client.connection_pool
            pool.connection_class = bounded(pool.connection_class)
        self.lua = Scripts(self.client)

    # -- fork() (see _fork) ------------------------------------------------------------

    def before_fork(self) -> None:
        pass

    def after_fork_in_parent(self) -> None:
        pass

    def after_fork_in_child(self) -> None:
        # A lock held by another thread at fork() would stay held forever in the child.
        self._check_lock = threading.Lock()
        self._clock.after_fork()
        if self._owns_client:
            # A client of our own is replaced rather than trusted to notice the fork: its
            # pool's lock may have been held by a thread the child does not have. The old
            # one is dropped, never closed: its sockets are the parent's. (redis-py closes
            # only its own process's sockets when it collects a connection.)
            self._use_client(None)
        # A client passed in resets its pool in the child by itself (redis-py compares the
        # pid on every checkout) and opens new connections there.

    def __repr__(self) -> str:
        return f"RedisCacheBackend({self.where!r}, prefix={self.prefix!r})"

    @property
    def url(self) -> str:
        """The URL that names this ledger, its password as `***` (for messages and the
        CLI's --ledger)."""
        options = {"prefix": self.prefix} if self.prefix != DEFAULT_PREFIX else {}
        if self._url is not None:
            base = redact(self._url)
        elif self.where.startswith("unix:"):
            path, _, db = self.where.removeprefix("unix:").rpartition("/")
            base = f"unix://{path}?db={db}"
        else:
            base = f"redis://{self.where}"
        return with_options(base, options)

    @classmethod
    def from_url(cls, url: str) -> Self:
        """`redis://[:password@]host:port/db?prefix=...`, `rediss://` for TLS; redis-py's
        own options (client_name, ssl_ca_certs, ...) go to redis-py exactly as written;
        any other option is refused (`LedgerConfigurationError`), as is a malformed `url`."""
        scheme = urlsplit(url).scheme.lower()
        parts, options = split_server_options(
            url, "Redis", _OPTIONS, redis_py_options(scheme), _REFUSED
        )
        with configuration_errors():
            return cls(urlunsplit(parts), **options)

    def _record_key(self, key: str) -> str:
        return f"{self.prefix}r:{key}"

    def check_reachable(self) -> None:
        """One PING within timeout_s: `LedgerUnavailable` if the server does not answer.
        For a configuration step (`configure()`, `Crew(...)`), so that a wrong host or a
        server that is down is reported where it was named. Raises `LedgerUnavailable`
        then."""
        self._call("checking that it answers", lambda resent: self.client.ping(), retry=False)

    def _index(self, status: Status) -> str:
        return f"{self.prefix}i:{status.value}"

    def _call(self, what: str, op: Callable[[bool], T], *, retry: bool = True) -> T:
        """Run `op(resent)` within timeout_s. After a dropped connection or a timeout,
        and when `retry` is set, run it again with `resent=True` (a few times, backing
        off, while time is left): the first send may or may not have been applied, and
        the scripts account for that."""
        if self._closed:
            raise LedgerUnavailable(f"the ledger {self.url} is closed")
        outer = getattr(deadline, "at", None)
        ends = time.monotonic() + self.timeout_s
        deadline.at = ends if outer is None else min(outer, ends)
        try:
            if not self._checked:
                self._check_server()
            delay = 0.05
            attempts = 1 + (self.retries if retry else 0)
            for attempt in range(1, attempts + 1):
                try:
                    return op(attempt > 1)
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    left = deadline.at - time.monotonic()
                    if (
                        attempt == attempts
                        or left <= delay
                        or isinstance(exc, redis.AuthenticationError)
                    ):
                        raise LedgerUnavailable(self._explain(exc, what)) from exc
                    log.info("Redis connection failed while %s; trying again", what)
                    time.sleep(delay)
                    delay = min(delay * 2, 0.5)
                except redis.RedisError as exc:
                    raise LedgerUnavailable(self._explain(exc, what)) from exc
            raise AssertionError("unreachable")
        finally:
            deadline.at = outer

    def _explain(self, exc: BaseException, what: str) -> str:
        if isinstance(exc, redis.TimeoutError):
            why = (
                f"did not answer within timeout_s={self.timeout_s} (a frozen or overloaded "
                "server, or a network that drops packets)"
            )
        elif isinstance(exc, redis.AuthenticationError | redis.exceptions.NoPermissionError):
            why = "refused our credentials"
        elif isinstance(exc, redis.ConnectionError):
            why = "cannot be reached"
        elif isinstance(exc, redis.exceptions.ReadOnlyError):
            why = "is a read-only replica; the ledger needs the primary"
        elif isinstance(exc, redis.exceptions.OutOfMemoryError):
            why = "is out of memory (maxmemory reached)"
        else:
            why = "failed"
        text = " ".join(str(exc).split())
        return f"Redis at {self.where} {why} while {what}: {type(exc).__name__}: {text}"

    # -- the server's persistence --------------------------------------------------------

    def _check_server(self) -> None:
        with self._check_lock:
            if self._checked:
                return
            try:
                pipe = self.client.pipeline(transaction=False)
                for name in ("appendonly", "save", "appendfsync"):
                    pipe.config_get(name)
                config = {k: v for part in pipe.execute() for k, v in part.items()}
            except redis.ResponseError as exc:  # CONFIG is often renamed on managed Redis
                log.info("cannot read the persistence settings of Redis at %s (%s); make sure "
                         "it runs with appendonly yes", self.where, exc)  # fmt: skip
                self._checked = True
                return
            except redis.RedisError as exc:
                raise LedgerUnavailable(self._explain(exc, "reading its settings")) from exc
            self._checked = True
            problem = persistence_problem(_text(config))
            if problem:
                message = f"Redis at {self.where}: {problem}"
                log.warning("%s", message)
                warnings.warn(message, RedisDurabilityWarning, stacklevel=2)

    # -- clock -------------------------------------------------------------------------

    def now(self) -> float:
        return self._clock.now()

    def now_blocks(self) -> bool:
        return self._clock.blocks()

    def _read_clock(self) -> float:
        seconds, micros = self._call("reading the server clock", lambda _: self.client.time())
        return float(seconds) + micros / 1e6

    # -- protocol ----------------------------------------------------------------------

    def insert(self, record: Record) -> Record | None:
        layout = self.layout
        if not self._ready_checked:
            # A ledger no one has written yet starts with complete secondary indexes.
            self._ready = self._ready or _backfill.ready(self)
            self._ready_checked = True
        keys = [
            layout.record(record.key), layout.index(record.status), layout.documents,
            layout.changes, layout.needs, layout.expiry, layout.buckets,
        ]  # fmt: skip
        args = [
            record.key, record.status.value, record.token, record.revision,
            repr(record.updated_at), record.to_json(),
        ]  # fmt: skip
        entries = layout.entries(record).args()
        held = self._call(
            f"claiming {record.key!r}",
            lambda resent: self.lua.claim(keys=keys, args=[*args, int(resent), *entries]),
        )
        return None if held is None else self._decode(held)

    def replace(self, current: Record, new: Record) -> bool:
        layout = self.layout
        keys = [
            layout.record(current.key), *layout.indexes, layout.changes, layout.needs,
            layout.expiry, layout.buckets,
        ]  # fmt: skip
        args: list[str | int | float] = [
            current.key, current.token, current.revision, new.status.value, new.token,
            new.revision, repr(new.updated_at), new.to_json(), *layout.entries(new).args(),
        ]  # fmt: skip
        done = self._call(
            f"updating {current.key!r}",
            lambda _: self.lua.replace(keys=keys, args=args),
        )
        return bool(done)

    def get(self, key: str) -> Record | None:
        record_key = self._record_key(key)
        held = self._call(f"reading {key!r}", lambda _: self.client.hget(record_key, "doc"))
        return None if held is None else self._decode(held)

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        if status is None:
            # Every record's hash, by SCAN over the keyspace: a record's hash keeps its
            # name through every write, while a scan of the status indexes one after
            # another would miss a record that moves to one already read.
            pattern = f"{glob_escape(self.prefix)}r:*"
            start = len(self.prefix) + 2

            def step(cursor: int) -> tuple[int, list[str]]:
                at, names = self.client.scan(cursor, match=pattern, count=BATCH)
                return at, [_text(name)[start:] for name in names]

            return self._scan_cursor(step, None, own=True)
        index = self._index(status)

        def step_index(cursor: int) -> tuple[int, list[str]]:
            at, members = self.client.zscan(index, cursor, count=BATCH)
            return at, [_text(member) for member, _score in members]

        return self._scan_cursor(step_index, status)

    def _scan_cursor(
        self, step: Callable[[int], tuple[int, list[str]]], status: Status | None, own: bool = False
    ) -> Iterator[Record]:
        """Walk a SCAN-family cursor, reading each step's records before the next step.

        Redis promises that a full walk returns every element present from its start to
        its end, whatever is written meanwhile, and may return one twice (when the table
        is resized under the walk): a repeat is told apart here only within a step."""
        cursor = 0
        while True:

            def walk(_resent: bool, at: int = cursor) -> tuple[int, list[str]]:
                return step(at)

            cursor, keys = self._call("listing records", walk)
            yield from self._read_records(keys, status, own)
            if not cursor:
                return

    def _read_records(
        self, keys: list[str], status: Status | None = None, own: bool = False
    ) -> Iterator[Record]:
        """The records under `keys` (in that order), those deleted since they were listed
        (and, with `status`, those that have left it) left out: one round trip. With
        `own`, only records whose key is the one they are stored under: a SCAN of this
        prefix's records also matches those of a ledger whose prefix extends this one's
        (`p:` and `p:r:x:`)."""
        if not keys:
            self._scans.read(0)
            return
        keys = list(dict.fromkeys(keys))

        def read(_resent: bool) -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.hget(self._record_key(key), "doc")
            return pipe.execute()

        docs = self._call("reading records", read)
        self._scans.read(len(keys))
        for key, doc in zip(keys, docs, strict=True):
            if doc is not None:
                record = self._decode(doc)
                if (status is None or record.status is status) and (not own or record.key == key):
                    yield record

    def scan_prefix(self, prefix: str) -> Iterator[Record]:
        if not prefix.startswith(DOCUMENTS):
            return super().scan_prefix(prefix)
        self._index_documents()
        end = prefix_end(prefix)
        return self._scan_documents(f"[{prefix}", "+" if end is None else f"({end}")

    def _scan_documents(self, low: str, high: str) -> Iterator[Record]:
        """The documents between `low` and `high` (ZRANGEBYLEX bounds) in byte order, a
        batch at a time, each after the last member read: a member of the documents'
        index never moves (all score 0), so a document that stays is read once."""
        while True:

            def listing(_resent: bool, low: str = low) -> Any:
                return self.client.zrangebylex(self._documents, low, high, start=0, num=BATCH)

            keys = [_text(member) for member in self._call("listing documents", listing)]
            yield from self._read_records(keys)
            if len(keys) < BATCH:
                return
            low = f"({keys[-1]}"

    def scan_stats(self) -> ScanStats:
        """What this backend's scans have read in this process: see `ScanStats`.
        Raises nothing."""
        return self._scans.stats()

    def _index_documents(self) -> None:
        """Documents written before the index existed join it, once per prefix: the
        status indexes are walked (ZSCAN, matching the documents' prefix) and a mark set."""
        if self._documents_checked:
            return
        client, documents = self.client, self._documents

        def complete(_resent: bool) -> bool:
            return bool(client.exists(self._documents_complete))

        if not self._call("reading the documents' index", complete):
            for index in self._indexes:
                cursor = 0
                while True:

                    def step(_resent: bool, index: str = index, at: int = cursor) -> Any:
                        at, found = client.zscan(index, at, match=f"{DOCUMENTS}*", count=1000)
                        if found:
                            members: dict[Any, float] = {m: 0 for m, _score in found}
                            client.zadd(documents, members)
                        return at

                    cursor = self._call("indexing documents", step)
                    if not cursor:
                        break
            self._call("indexing documents", lambda _: client.set(self._documents_complete, 1))
        self._documents_checked = True

    def delete(self, current: Record) -> bool:
        layout = self.layout
        keys = [
            layout.record(current.key), *layout.indexes, layout.documents, layout.changes,
            layout.needs, layout.expiry,
        ]  # fmt: skip
        args: list[str | int | float] = [current.key, current.token, current.revision]
        done = self._call(
            f"deleting {current.key!r}", lambda _: self.lua.delete(keys=keys, args=args),
            retry=False,
        )  # fmt: skip
        return bool(done)

    # -- selects and the secondary indexes ---------------------------------------------

    def select(self, query: Select) -> Iterator[Record]:
        return self._select(query)

    def _select(self, query: Select) -> Iterator[Record]:
        if query.prefix.startswith(DOCUMENTS):
            self._index_documents()
        yield from answer(self, query, self.indexes_ready())

    def indexes_ready(self) -> bool:
        """True when the secondary indexes (`x:`: needs an operator, receipts by expiry,
        documents by state and subject) hold every record: the backfill has stamped those
        written before this release, and a last look found none that the previous release
        was still writing. Until then `select` answers right by a slower path (it also
        walks, on the server, the status index or documents' index that holds every
        possible match, for records without their stamp). One GET, until it is True (then
        never again in this process). Raises `LedgerUnavailable` if Redis cannot be read."""
        if not self._ready:
            self._ready = _backfill.ready(self)
        return self._ready

    def backfill_indexes(self, *, limit: int | None = None, rescan: bool = False) -> bool:
        """Put the records written before this release (or by the previous one, beside it)
        in the secondary indexes, a bounded step at a time (each one script that looks at
        about 250 records on the server, so a claim waits at most one step), and return
        `indexes_ready()`. Progress is kept in Redis, so a run stopped, or started in many
        processes at once, continues where it was. It stops when the indexes are complete,
        after about `limit` records (None: no limit; a bounded run also stops when another
        process holds the step), or when a step finds records a
        worker of the previous release wrote after the walk began (False then: run it
        again once no worker of that release writes this ledger). With `rescan`, indexes
        already complete are walked again: for a ledger the previous release went on
        writing after they were (docs/backends.md). Raises `LedgerUnavailable` if Redis
        cannot be read or written, `ValueError` for a `limit` below 1."""
        if limit is not None and (isinstance(limit, bool) or limit < 1):
            raise ValueError(f"limit must be a positive count or None, not {limit!r}")
        if rescan:
            _backfill.restart(self)
            self._ready = False
        looked = 0
        waits = 0
        # A window begun in this run after the first one: the previous release writes.
        began = max(_backfill.windows(self), 1)
        while not self.indexes_ready():
            done, count = _backfill.step(self)
            if done:
                self._ready = True
                break
            if count < 0:  # another process holds the step
                if limit is not None:
                    break  # a bounded run leaves the rest to the one that holds it
                waits += 1
                time.sleep(min(0.01 * waits, 0.2))
                continue
            looked += count
            if (limit is not None and looked >= limit) or _backfill.windows(self) > began:
                break
        return self._ready

    def changes(self) -> object | None:
        """A mark that moves with every write: the counter this release's scripts
        increment, and, for the previous release's writes (which do not), the size and
        newest entry of each status index and the documents' count. One round trip."""
        layout = self.layout

        def mark(_resent: bool) -> tuple[Any, ...]:
            pipe = self.client.pipeline(transaction=False)
            pipe.get(layout.changes)
            pipe.zcard(layout.documents)
            for index in layout.indexes:
                pipe.zcard(index)
                pipe.zrange(index, -1, -1, withscores=True)
            return tuple(
                tuple((bytes(m), s) for m, s in part) if isinstance(part, list) else part
                for part in pipe.execute()
            )

        return self._call("reading the change mark", mark)

    def _decode(self, doc: bytes | str) -> Record:
        return read_record(doc, f"the prefix {self.prefix!r} at Redis {self.where}")

    def close(self) -> None:
        self._closed = True
        if self._owns_client:
            self.client.close()


def persistence_problem(config: dict[str, str]) -> str | None:
    """What a restart of a server with these settings would lose, or None if nothing
    acknowledged is lost when the Redis process restarts or crashes."""
    appendonly = config.get("appendonly", "").lower()
    save = config.get("save", "").strip()
    if appendonly == "yes":
        return None
    if not save:
        return (
            "persistence is disabled (appendonly no, save ''): every claim and receipt is "
            "lost when the server restarts, and a retried tool then runs again. Run it with "
            "appendonly yes (and appendfsync always for tools that move money)"
        )
    return (
        f"only RDB snapshots are taken (appendonly no, save {save!r}): the claims and "
        "receipts written since the last snapshot are lost when the server restarts, and "
        "those tools then run again. Run it with appendonly yes (and appendfsync always "
        "for tools that move money)"
    )


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, dict):
        return {_text(k): _text(v) for k, v in value.items()}
    return value


def _describe(client: redis.Redis) -> str:
    kwargs = client.connection_pool.connection_kwargs
    if kwargs.get("path"):
        return f"unix:{kwargs['path']}/{kwargs.get('db', 0)}"
    return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"


# URL options: the backend's own, and redis-py's connection options that a URL can carry.
_OPTIONS: dict[str, Callable[[str], Any]] = {
    "prefix": str,
    "timeout_s": float,
    "clock_refresh_s": float,
    "check_persistence": flag,
    "retries": int,
}
_SET_BY_US = "crewai-idempotent sets it from timeout_s and retries, which bound every operation"
_REFUSED = {
    **dict.fromkeys(
        ("socket_timeout", "socket_connect_timeout", "timeout", "retry", "retry_on_timeout",
         "retry_on_error"),
        _SET_BY_US,
    ),
    "decode_responses": "the ledger decodes replies itself",
    **dict.fromkeys(
        ("host", "port", "path", "username", "password"),
        "write it in the URL itself (redis://user:password@host:port/db, unix:///path)",
    ),
}  # fmt: skip
# redis-py options that a URL can express (text, numbers, yes/no), checked against the
# installed redis-py's connection classes below; objects and callbacks cannot come from
# a URL.
_PLAIN_OPTIONS = frozenset({
    "db", "client_name", "lib_name", "lib_version", "health_check_interval",
    "socket_keepalive", "socket_read_size", "protocol", "max_connections", "encoding",
    "encoding_errors", "ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs",
    "ssl_ca_path", "ssl_ca_data", "ssl_check_hostname", "ssl_password", "ssl_validate_ocsp",
    "ssl_validate_ocsp_stapled", "ssl_min_version", "ssl_ciphers", "ssl_include_verify_flags",
    "ssl_exclude_verify_flags",
})  # fmt: skip


def redis_py_options(scheme: str) -> frozenset[str]:
    """The redis-py connection options a `scheme` URL may carry, as the installed redis-py
    knows them."""
    classes: list[type[Any]] = [Connection]
    if scheme == "rediss":
        classes.append(SSLConnection)
    elif scheme == "unix":
        classes = [UnixDomainSocketConnection]
    known = set(URL_QUERY_ARGUMENT_PARSERS) | {"max_connections"}
    for cls in classes:
        for klass in cls.__mro__:
            if "__init__" in vars(klass):
                known |= set(inspect.signature(vars(klass)["__init__"]).parameters)
    return frozenset(known & _PLAIN_OPTIONS)
