"""The ledgers bench/scale.py measures: built in bulk in each store's own format, cached.

What a ledger of "N records" holds (`Shape`): N guarded-call receipts (COMMITTED with a
TTL, 10 % of them expired; 1 % FAILED), written in bulk, plus the same few thousand
records at every size, written through the package as crews and operators write them:
1,000 pending approval requests (and 100 approved, 100 denied), 20 UNCERTAIN records (5
flagged needs-operator), 5 PENDING claims whose lease lapsed, 20 spend-cap windows, and
the outbox entries all of those put there. A listing that looks for any of those finds
the same rows at 10k as at 10M: its time should not grow with N.

How each store is filled (the receipts; the rest goes through the package):

- SQLite: the backend creates its file and table (with whatever indexes or triggers the
  installed version makes), then one connection with `synchronous=OFF` inserts the rows
  with `executemany` in key order, one transaction per 500,000 rows, a WAL checkpoint
  after each. The row is what `SQLiteCacheBackend` writes: key, status, token, revision,
  updated_at and `Record.to_json()`.
- PostgreSQL: the backend creates its table, then `COPY ... FREEZE` into it in the
  transaction that truncates it (empty), then `VACUUM ANALYZE`, as an aged table would be.
- Redis: through the store's own `insert` (the claim) and `replace` (the commit), from 8
  threads: the scripts and key layout are the store's, whatever they are (10k and 1M).

Built ledgers are cached under `--cache` (default bench/.cache), keyed by a digest of the
code that decides their format (the store's package, the record, the gates, the outbox):
code that changes any of it gets ledgers of its own on the next run. Measurements run on
working copies (a file copy, `CREATE DATABASE ... TEMPLATE`, a Redis server started from
the saved RDB), so the cached ledgers stay as built.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import math
import os
import pwd
import random
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from crewai_idempotent import (  # noqa: E402
    ApprovalRequired,
    Approvals,
    Ledger,
    OutcomeUnknown,
    Record,
    Status,
    backend_from_url,
)
from crewai_idempotent.gates._plan import Plan  # noqa: E402
from crewai_idempotent.gates._spend import Money, SpendCap, Where  # noqa: E402
from crewai_idempotent.ledger._record import Event, Owner  # noqa: E402
from crewai_idempotent.ledger._results import encode  # noqa: E402
from crewai_idempotent.notifications import _outbox  # noqa: E402

#: Bump when what a loaded ledger holds changes: every cached ledger is then rebuilt.
LOADER = 1
DAY = 86_400.0
TOOLS = ("create_ticket", "pay_invoice", "send_email")  # key order: tool by tool
ROWS_PER_TRANSACTION = 500_000
DEFAULT_CACHE = ROOT / "bench" / ".cache"


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- what a ledger holds ---------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What one ledger holds. `receipts` is its size; the rest is the same at every size."""

    receipts: int
    expired_share: float = 0.10
    failed_share: float = 0.01
    pending_approvals: int = 1000
    approved: int = 100
    denied: int = 100
    uncertain: int = 20
    needs_operator: int = 5
    stale_pending: int = 5
    spend_windows: int = 20

    @property
    def label(self) -> str:
        """The name of its cache entry: the size, and what differs from the default."""
        parts = [str(self.receipts)]
        for name, default in asdict(Shape(0)).items():
            value = getattr(self, name)
            if name != "receipts" and value != default:
                parts.append(f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}")
        return "-".join(parts).replace("_", "").replace("=", "")

    @property
    def extras(self) -> int:
        """The records beside the receipts, roughly (documents and their outbox entries)."""
        requests = self.pending_approvals + self.approved + self.denied
        return (
            3 * requests
            + self.approved
            + self.denied
            + 2 * self.uncertain
            + (self.stale_pending + 2 * self.spend_windows)
        )


def purge_shape(receipts: int) -> Shape:
    """The ledger a purge of `receipts` expired records runs on: every receipt expired."""
    return Shape(receipts, expired_share=1.0, failed_share=0.0)


def receipts(shape: Shape, now: float, seed: int = 30) -> Iterator[tuple[Record, Record]]:
    """(claim, final) for each receipt, in key order: the claim a worker wrote, and the
    record as its commit (or failure) left it. Deterministic for a seed."""
    rng = random.Random(seed)
    owners = [
        Owner(f"worker-{n:02d}", 1000 + 37 * n, f"{rng.getrandbits(36):09x}") for n in range(32)
    ]
    per_tool = math.ceil(shape.receipts / len(TOOLS))
    made = 0
    for tool in TOOLS:
        for i in range(per_tool):
            if made == shape.receipts:
                return
            made += 1
            key = f"{tool}:inv-{i:010d}"
            owner = owners[rng.randrange(len(owners))]
            by = owner.label
            created = now - rng.uniform(300.0, 30 * DAY)
            fingerprint = hashlib.sha256(key.encode()).hexdigest()
            claim = Record(
                key,
                Status.PENDING,
                fingerprint,
                1,
                1,
                owner,
                1,
                created,
                created,
                created + 60.0,
                history=(Event(created, "claim", 1, by),),
            )
            done = created + rng.uniform(0.05, 3.0)
            roll = rng.random()
            if roll < shape.failed_share:
                final = claim.settled(
                    Event(done, "fail", 1, by),
                    Status.FAILED,
                    done,
                    error="HTTPStatusError: 502 Bad Gateway",
                )
            else:
                expired = roll < shape.failed_share + shape.expired_share
                expires = (
                    rng.uniform(done, now - 60.0)
                    if expired
                    else now + rng.uniform(180 * DAY, 365 * DAY)
                )
                result = encode(
                    {
                        "id": f"ch_{rng.getrandbits(96):024x}",
                        "object": "charge",
                        "amount": rng.randrange(100, 500_000),
                        "currency": "eur",
                        "status": "succeeded",
                    }
                )
                final = claim.settled(
                    Event(done, "commit", 1, by),
                    Status.COMMITTED,
                    done,
                    result=result,
                    expires_at=expires,
                )
            yield claim, final


def stale_claims(shape: Shape, now: float) -> list[Record]:
    """PENDING claims of workers that died: their leases lapsed an hour or more ago."""
    owner = Owner("worker-gone", 4242, "0badc0ffe")
    found = []
    for j in range(shape.stale_pending):
        at = now - 3600.0 * (j + 1)
        key = f"pay_invoice:stale-{j:04d}"
        found.append(
            Record(
                key,
                Status.PENDING,
                hashlib.sha256(key.encode()).hexdigest(),
                1,
                1,
                owner,
                1,
                at,
                at,
                at + 60.0,
                history=(Event(at, "claim", 1, owner.label),),
                call={"tool": "pay_invoice"},
            )
        )
    return found


def sample_keys(shape: Shape) -> dict[str, str]:
    """Keys the measurements look up: a receipt, and a record that needs an operator."""
    return {"receipt": f"{TOOLS[0]}:inv-{0:010d}", "uncertain": "pay_invoice:uncertain-0000"}


def add_documents(url: str, shape: Shape) -> dict[str, Any]:
    """What crews and operators put in a ledger beside the receipts, through the package:
    approval requests (asked by a gated call, as a crew's would be) and decisions, UNCERTAIN
    records and the flag of two executions, spend-cap windows; the outbox entries come
    with them. Returns what was made and how long it took."""
    began = time.perf_counter()
    ledger = Ledger(backend_from_url(url))
    backend = ledger.backend
    approvals = Approvals(backend)
    where = Where(kickoff="kickoff-bench", crew="billing", task="pay_invoices")
    asked: list[str] = []
    requests = shape.pending_approvals + shape.approved + shape.denied
    for i in range(requests):
        summary = {
            "invoice": f"INV-{i:06d}",
            "amount_cents": 50_000 + i,
            "currency": "EUR",
            "vendor": f"vendor-{i % 37}",
        }
        plan = Plan(
            tool="pay_invoice",
            fingerprint=f"fp-approval-{i:06d}",
            approval=True,
            approval_reason="invoices over 500 EUR need a person",
            summary=summary,
            where=where,
            origin={"crew": "billing", "task": "pay_invoices", "agent": "accounts payable"},
        )
        try:
            ledger.run(
                f"pay_invoice:approval-{i:06d}", _paid, fingerprint=plan.fingerprint, stage=plan
            )
        except ApprovalRequired as asking:
            asked.append(asking.request_id)
    for n, rid in enumerate(asked[shape.pending_approvals :]):
        if n < shape.approved:
            approvals.approve(
                rid, by="olga@example.com", reason="checked the invoice", ttl_s=30 * DAY, via="cli"
            )
        else:
            approvals.deny(rid, by="olga@example.com", reason="duplicate invoice", via="cli")
    for j in range(shape.uncertain):
        with contextlib.suppress(Exception):
            ledger.run(f"pay_invoice:uncertain-{j:04d}", _unknown, fingerprint=f"fp-u{j}")
    for j in range(shape.needs_operator):
        held = backend.get(f"pay_invoice:uncertain-{j:04d}")
        if held is None:
            continue
        now = backend.now()
        note = (
            f"worker worker-03:77:feedbeef0 (token {held.token}) finished (commit) after "
            "its claim was taken over: two executions may have happened"
        )
        evidence = {
            "token": held.token,
            "owner": "worker-03:77:feedbeef0",
            "outcome": "commit",
            "result": encode("ch_late"),
            "error": None,
            "at": now,
        }
        new = held.evolve(
            Event(now, "fenced", held.token, "worker-03:77:feedbeef0", note),
            updated_at=now,
            error=note,
            needs_operator=True,
            evidence=(*held.evidence, evidence),
        )
        _outbox.put_entries(backend, _outbox.of_transition(held, new))
        backend.replace(held, new)
    cap = SpendCap(1_000_000, "EUR", per="kickoff", name="kickoff-eur")
    for k in range(shape.spend_windows):
        plan = Plan(
            tool="pay_invoice",
            fingerprint=f"fp-spend-{k}",
            amount=Money(12_500, "EUR"),
            caps=[("pay_invoice", cap)],
            where=Where(kickoff=f"kickoff-{k:04d}", crew="billing", task="pay"),
        )
        ledger.run(f"pay_invoice:spend-{k:04d}", _paid, fingerprint=plan.fingerprint, stage=plan)
    ledger.close()
    return {"approval_requests": len(asked), "seconds": time.perf_counter() - began}


def _paid() -> dict[str, Any]:
    return {"id": "ch_3PxYz2LkdIwHu7ix0s1Q9aBc", "status": "succeeded"}


def _unknown() -> None:
    raise OutcomeUnknown("the provider timed out after accepting the request")


# -- the cache -------------------------------------------------------------------------------


def code_digest(kind: str) -> str:
    """A digest of the code that decides a `kind` ledger's format: the store's package, the
    record and its results, the gates and the outbox (and this loader's version)."""
    package = ROOT / "crewai_idempotent"
    paths = [
        *sorted((package / "backends" / kind).rglob("*.py")),
        package / "ledger" / "_record.py",
        package / "ledger" / "_results.py",
        package / "notifications" / "_outbox.py",
        *sorted((package / "gates").glob("*.py")),
    ]
    digest = hashlib.sha256(f"loader {LOADER}\n".encode())
    for path in paths:
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


class Cache:
    """The folder of cached ledgers, their facts (`meta/`), working copies and results."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # the postgres user must reach its cluster inside
        for name in ("meta", "work", "results"):
            self.folder(name)

    def folder(self, name: str, mode: int = 0o700) -> Path:
        path = self.root / name
        path.mkdir(exist_ok=True)
        path.chmod(mode)
        return path

    def meta_path(self, kind: str, digest: str, shape: Shape) -> Path:
        return self.root / "meta" / f"{kind}-{digest}-{shape.label}.json"

    def meta(self, kind: str, digest: str, shape: Shape) -> dict[str, Any] | None:
        path = self.meta_path(kind, digest, shape)
        return json.loads(path.read_text()) if path.exists() else None

    def keep_meta(self, kind: str, digest: str, shape: Shape, facts: dict[str, Any]) -> None:
        self.meta_path(kind, digest, shape).write_text(json.dumps(facts, indent=2))

    def entries(self) -> list[tuple[str, int]]:
        """Every cached folder and its size in bytes."""
        found = []
        for path in sorted(self.root.iterdir()):
            if path.is_dir():
                size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
                found.append((path.name, size))
        return found


def _facts(shape: Shape, rows: int, timings: dict[str, float], disk: int) -> dict[str, Any]:
    total = sum(timings.values())
    return {
        "shape": asdict(shape),
        "rows": rows,
        "seconds": timings,
        "total_s": total,
        "receipts_per_s": shape.receipts / max(timings.get("receipts", total), 1e-9),
        "bytes": disk,
        "bytes_per_record": disk / max(rows, 1),
        "built": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


class Ledgers:
    """Cached ledgers of one store: `ensure` builds one if missing, `copy` lends a working
    copy's URL, `counters` reads what the server has done (for the idle page)."""

    kind = ""

    def __init__(self, cache: Cache, rebuild: bool = False) -> None:
        self.cache = cache
        self.rebuild = rebuild
        self.digest = code_digest(self.kind)
        self.built: set[Shape] = set()  # rebuilt in this run already: `rebuild` is done

    def fresh(self, shape: Shape, facts: dict[str, Any] | None, present: bool) -> bool:
        """True when the cached ledger of `shape` can be used as it is."""
        return facts is not None and present and (not self.rebuild or shape in self.built)

    def ensure(self, shape: Shape) -> dict[str, Any]:
        raise NotImplementedError

    def copy(self, shape: Shape) -> contextlib.AbstractContextManager[str]:
        raise NotImplementedError

    def counters(self, url: str) -> dict[str, float]:
        """The server's own counts of what was read (none for an embedded store)."""
        return {}

    def version(self) -> str:
        raise NotImplementedError

    def close(self) -> None:
        pass


# -- SQLite ----------------------------------------------------------------------------------

_SQLITE_COLUMNS = ("key", "status", "token", "revision", "updated_at", "doc")


class SQLiteLedgers(Ledgers):
    kind = "sqlite"

    def path(self, shape: Shape) -> Path:
        return self.cache.folder(f"sqlite-{self.digest}") / f"ledger-{shape.label}.db"

    def ensure(self, shape: Shape) -> dict[str, Any]:
        facts = self.cache.meta(self.kind, self.digest, shape)
        path = self.path(shape)
        if self.fresh(shape, facts, path.exists()):
            return facts  # type: ignore[return-value]
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        say(f"SQLite: building {path.name} ({shape.receipts:,} receipts)")
        facts = load_sqlite(path, shape)
        self.cache.keep_meta(self.kind, self.digest, shape, facts)
        self.built.add(shape)
        say(
            f"SQLite: {path.name} built in {facts['total_s']:.1f} s "
            f"({facts['receipts_per_s']:,.0f} receipts/s, {facts['bytes'] / 1e6:,.0f} MB)"
        )
        return facts

    @contextlib.contextmanager
    def copy(self, shape: Shape) -> Iterator[str]:
        self.ensure(shape)
        work = self.cache.folder("work") / f"sqlite-{shape.label}-{uuid.uuid4().hex[:6]}.db"
        began = time.perf_counter()
        shutil.copyfile(self.path(shape), work)
        work.chmod(0o600)
        say(f"SQLite: working copy of {shape.label} in {time.perf_counter() - began:.1f} s")
        try:
            yield sqlite_url(work)
        finally:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{work}{suffix}").unlink(missing_ok=True)

    def version(self) -> str:
        return f"SQLite {sqlite3.sqlite_version}"


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path.resolve()}"


def load_sqlite(path: Path, shape: Shape) -> dict[str, Any]:
    """Fill a new ledger file at `path` (see the module's docstring)."""
    timings: dict[str, float] = {}
    began = time.perf_counter()
    backend = backend_from_url(sqlite_url(path) + "?synchronous=NORMAL")
    backend.get("bench:schema")  # the table, and whatever this version makes with it
    now = backend.now()
    backend.close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous = OFF")
    conn.execute("PRAGMA cache_size = -262144")  # 256 MiB: the indexes' pages stay cached
    _check_columns(
        [(row[1], row[3], row[4]) for row in conn.execute("PRAGMA table_info(idempotency_records)")]
    )
    insert = (
        f"INSERT INTO idempotency_records ({', '.join(_SQLITE_COLUMNS)}) "
        f"VALUES ({', '.join('?' * len(_SQLITE_COLUMNS))})"
    )
    rows = 0
    batch: list[tuple[Any, ...]] = []
    finals = (final for _claim, final in receipts(shape, now))
    stale = iter(stale_claims(shape, now))
    conn.execute("BEGIN")
    for record in _merged(finals, stale):
        batch.append(_row(record))
        if len(batch) == 10_000:
            conn.executemany(insert, batch)
            rows += len(batch)
            batch.clear()
            if rows % ROWS_PER_TRANSACTION == 0:
                conn.execute("COMMIT")
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                conn.execute("BEGIN")
    conn.executemany(insert, batch)
    rows += len(batch)
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    timings["receipts"] = time.perf_counter() - began
    documents = add_documents(sqlite_url(path) + "?synchronous=NORMAL", shape)
    timings["documents"] = documents["seconds"]
    began = time.perf_counter()
    conn = sqlite3.connect(path, isolation_level=None)
    total = conn.execute("SELECT count(*) FROM idempotency_records").fetchone()[0]
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    timings["checkpoint"] = time.perf_counter() - began
    return _facts(shape, total, timings, path.stat().st_size)


def _check_columns(columns: list[tuple[str, int, Any]]) -> None:
    """The table must take a row of the six columns every version writes (a later
    version's extra columns need a default, or old writers could not insert)."""
    names = {name for name, _notnull, _default in columns}
    missing = set(_SQLITE_COLUMNS) - names
    unfilled = [
        name
        for name, notnull, default in columns
        if name not in _SQLITE_COLUMNS and notnull and default is None
    ]
    if missing or unfilled:
        raise SystemExit(
            f"the ledger table's columns changed (missing {sorted(missing)}, required without a "
            f"default {unfilled}): teach bench/scale_ledgers.py to fill them"
        )


def _row(record: Record) -> tuple[Any, ...]:
    return (
        record.key,
        record.status.value,
        record.token,
        record.revision,
        record.updated_at,
        record.to_json(),
    )


def _merged(first: Iterator[Record], second: Iterator[Record]) -> Iterator[Record]:
    """Two key-ordered streams as one, in key order."""
    return heapq.merge(first, second, key=lambda record: record.key)


# -- PostgreSQL ------------------------------------------------------------------------------

PG_SETTINGS = {
    "shared_buffers": "'256MB'",
    "max_wal_size": "'8GB'",
    "checkpoint_timeout": "'15min'",
    "shared_preload_libraries": "'pg_stat_statements'",
    "pg_stat_statements.track": "'top'",
    "track_counts": "on",
}


class PostgresLedgers(Ledgers):
    """One PostgreSQL cluster under the cache (fsync on, as in production), one database
    per ledger (`ledger_<label>`), started on loopback for the run and stopped after."""

    kind = "postgres"

    def __init__(self, cache: Cache, rebuild: bool = False) -> None:
        super().__init__(cache, rebuild)
        from tests.support.servers import PostgresServer, postgres_bindir

        bindir = postgres_bindir()
        if bindir is None:
            raise SystemExit("PostgreSQL's initdb and pg_ctl were not found")
        self.server = PostgresServer(bindir, fsync=True, max_connections=300, settings=PG_SETTINGS)
        shutil.rmtree(self.server.root, ignore_errors=True)
        root = self.cache.root / f"postgres-{self.digest}"
        root.mkdir(exist_ok=True)
        entry = pwd.getpwnam("postgres")
        os.chown(root, entry.pw_uid, entry.pw_gid)
        root.chmod(0o700)
        self.server.root, self.server.data = root, root / "data"
        self.server.log = root / "server.log"
        self.server.stop()  # one an interrupted run left running
        self.server.start()
        self.server.sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")

    @staticmethod
    def database(shape: Shape) -> str:
        return "ledger_" + shape.label.replace("-", "_").replace(".", "_")

    def url(self, database: str) -> str:
        return self.server.dsn(database)

    def ensure(self, shape: Shape) -> dict[str, Any]:
        facts = self.cache.meta(self.kind, self.digest, shape)
        name = self.database(shape)
        exists = bool(self.server.sql(f"SELECT 1 FROM pg_database WHERE datname = '{name}'"))
        if self.fresh(shape, facts, exists):
            return facts  # type: ignore[return-value]
        self.server.sql(f"DROP DATABASE IF EXISTS {name}")
        self.server.sql(f"CREATE DATABASE {name}")
        say(f"PostgreSQL: building {name} ({shape.receipts:,} receipts)")
        facts = load_postgres(self.url(name), shape)
        self.cache.keep_meta(self.kind, self.digest, shape, facts)
        self.built.add(shape)
        say(
            f"PostgreSQL: {name} built in {facts['total_s']:.1f} s "
            f"({facts['receipts_per_s']:,.0f} receipts/s, {facts['bytes'] / 1e6:,.0f} MB)"
        )
        return facts

    @contextlib.contextmanager
    def copy(self, shape: Shape) -> Iterator[str]:
        self.ensure(shape)
        work = f"work_{uuid.uuid4().hex[:8]}"
        began = time.perf_counter()
        self.server.sql(f"CREATE DATABASE {work} TEMPLATE {self.database(shape)}")
        say(f"PostgreSQL: working copy of {shape.label} in {time.perf_counter() - began:.1f} s")
        try:
            yield self.url(work)
        finally:
            self.server.sql(f"DROP DATABASE IF EXISTS {work} WITH (FORCE)")

    def counters(self, url: str) -> dict[str, float]:
        """Statements run and rows they returned (pg_stat_statements, this database, the
        counters' own queries left out), and rows the ledger's table gave scans and index
        lookups (pg_stat_user_tables)."""
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_force_next_flush()")
            calls, returned = conn.execute(
                "SELECT coalesce(sum(calls), 0), coalesce(sum(rows), 0) FROM pg_stat_statements "
                "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                "AND query NOT ILIKE '%pg_stat%'"
            ).fetchone()  # type: ignore[misc]
            read = conn.execute(
                "SELECT coalesce(sum(coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)), 0), "
                "coalesce(sum(coalesce(seq_scan, 0) + coalesce(idx_scan, 0)), 0) "
                "FROM pg_stat_user_tables WHERE relname NOT LIKE 'pg_%'"
            ).fetchone()  # type: ignore[misc]
        return {
            "statements": float(calls),
            "rows returned": float(returned),
            "table rows read": float(read[0]),
            "table scans": float(read[1]),
        }

    def version(self) -> str:
        return "PostgreSQL " + str(self.server.sql("SHOW server_version")[0][0]).split()[0]

    def close(self) -> None:
        self.server.stop()


def load_postgres(url: str, shape: Shape) -> dict[str, Any]:
    """Fill the empty database at `url` (see the module's docstring)."""
    import psycopg

    timings: dict[str, float] = {}
    began = time.perf_counter()
    backend = backend_from_url(url)
    backend.get("bench:schema")
    now = backend.now()
    backend.close()
    table = "crewai_idempotency_records"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        with conn.transaction():
            conn.execute(f"TRUNCATE {table}")  # empty: lets COPY write the rows frozen
            copy_sql = f"COPY {table} ({', '.join(_SQLITE_COLUMNS)}) FROM STDIN WITH (FREEZE)"
            with conn.cursor().copy(copy_sql) as copy:
                finals = (final for _claim, final in receipts(shape, now))
                chunk: list[str] = []
                for record in _merged(finals, iter(stale_claims(shape, now))):
                    chunk.append(_copy_line(record))
                    if len(chunk) == 5000:
                        copy.write("".join(chunk))
                        chunk.clear()
                copy.write("".join(chunk))
        timings["receipts"] = time.perf_counter() - began
        began = time.perf_counter()
        conn.execute(f"VACUUM (ANALYZE) {table}")
        timings["vacuum"] = time.perf_counter() - began
    documents = add_documents(url, shape)
    timings["documents"] = documents["seconds"]
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]  # type: ignore[index]
        size = conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]  # type: ignore[index]
    return _facts(shape, rows, timings, size)


def _copy_line(record: Record) -> str:
    doc = record.to_json().replace("\\", "\\\\")  # COPY's text format: backslash escapes
    return (
        f"{record.key}\t{record.status.value}\t{record.token}\t{record.revision}\t"
        f"{record.updated_at!r}\t{doc}\n"
    )


# -- Redis -----------------------------------------------------------------------------------


class RedisLedgers(Ledgers):
    """A saved RDB file per ledger; each working copy is a redis-server started from it
    on loopback with appendonly (everysec), as a ledger server would run."""

    kind = "redis"

    def __init__(self, cache: Cache, rebuild: bool = False) -> None:
        super().__init__(cache, rebuild)
        from tests.support.servers import redis_binary

        binary = redis_binary()
        if binary is None:
            raise SystemExit("redis-server was not found")
        self.binary = binary
        self._version = ""

    def rdb(self, shape: Shape) -> Path:
        return self.cache.folder(f"redis-{self.digest}") / f"ledger-{shape.label}.rdb"

    def _server(self, rdb: Path | None, appendonly: bool) -> Any:
        import redis

        from tests.support.servers import RedisServer

        server = RedisServer(
            self.binary, appendonly=False, save="", extra=("--dbfilename", "ledger.rdb")
        )
        if rdb is not None:
            shutil.copyfile(rdb, server.root / "ledger.rdb")
        server.start()
        client = redis.Redis(port=server.port)
        while client.info("persistence").get("loading"):
            time.sleep(0.1)
        self._version = str(client.info("server")["redis_version"])
        if appendonly:
            client.config_set("appendfsync", "everysec")
            client.config_set("appendonly", "yes")  # rewrites the AOF from the data set
            while True:
                info = client.info("persistence")
                if (
                    info.get("aof_enabled")
                    and not info.get("aof_rewrite_in_progress")
                    and not (info.get("aof_rewrite_scheduled"))
                ):
                    break
                time.sleep(0.1)
        client.close()
        return server

    def ensure(self, shape: Shape) -> dict[str, Any]:
        import redis

        facts = self.cache.meta(self.kind, self.digest, shape)
        rdb = self.rdb(shape)
        if self.fresh(shape, facts, rdb.exists()):
            return facts  # type: ignore[return-value]
        say(f"Redis: building {rdb.name} ({shape.receipts:,} receipts)")
        server = self._server(None, appendonly=False)
        try:
            facts = load_redis(server.url(), shape)
            began = time.perf_counter()
            client = redis.Redis(port=server.port)
            # BGSAVE and wait: a blocking SAVE of 1M records outlasted the client's read
            # timeout (redis-py's default), and the build was lost with it.
            saved = client.lastsave()
            client.bgsave()
            while client.lastsave() == saved or client.info("persistence").get(
                "rdb_bgsave_in_progress"
            ):
                time.sleep(0.2)
            client.close()
            facts["seconds"]["save"] = time.perf_counter() - began
            facts["total_s"] = sum(facts["seconds"].values())
            shutil.copyfile(server.root / "ledger.rdb", rdb)
            facts["bytes"] = rdb.stat().st_size
            facts["bytes_per_record"] = facts["bytes"] / max(facts["rows"], 1)
        finally:
            server.cleanup()
        self.cache.keep_meta(self.kind, self.digest, shape, facts)
        self.built.add(shape)
        say(
            f"Redis: {rdb.name} built in {facts['total_s']:.1f} s "
            f"({facts['receipts_per_s']:,.0f} receipts/s, RDB {facts['bytes'] / 1e6:,.0f} MB)"
        )
        return facts

    @contextlib.contextmanager
    def copy(self, shape: Shape) -> Iterator[str]:
        self.ensure(shape)
        began = time.perf_counter()
        server = self._server(self.rdb(shape), appendonly=True)
        say(f"Redis: server from {shape.label} in {time.perf_counter() - began:.1f} s")
        try:
            yield server.url()
        finally:
            server.cleanup()

    def counters(self, url: str) -> dict[str, float]:
        """Commands the server ran (INFO commandstats; INFO's, CONFIG's and CLIENT's own
        left out) and keys they looked up (hits + misses)."""
        import redis

        client = redis.Redis.from_url(url.split("?", 1)[0])
        stats = client.info("commandstats")
        keys = client.info("stats")
        client.close()
        calls = sum(
            v["calls"]
            for k, v in stats.items()
            if k not in ("cmdstat_info", "cmdstat_config", "cmdstat_client")
        )
        return {
            "commands": float(calls),
            "keys read": float(keys["keyspace_hits"] + keys["keyspace_misses"]),
        }

    def version(self) -> str:
        if not self._version:
            out = subprocess.run([str(self.binary), "--version"], capture_output=True, text=True)
            self._version = out.stdout.split("v=")[1].split()[0]
        return f"Redis {self._version}"


REDIS_THREADS = 8
REDIS_PIPELINE = 2000  # script calls sent per round trip while loading


def load_redis(url: str, shape: Shape, pipelined: bool = True) -> dict[str, Any]:
    """Fill the empty Redis at `url` through the store's own claim and commit: each
    receipt is `insert`ed as its claim and `replace`d by its commit. `pipelined`: the
    scripts those calls send are queued on a pipeline (`_Pipelined`) and sent in
    batches, and a sample is read back through the store; if the store turns out to need
    the scripts' replies, the rest goes call by call from 8 threads."""
    timings: dict[str, float] = {}
    began = time.perf_counter()
    with warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")  # no persistence while loading: the RDB is saved after
        backend = backend_from_url(url)
        now = backend.now()
        if not pipelined or _pipelined_fill(backend, url, receipts(shape, now)) is None:
            if pipelined:
                say(
                    "Redis: the pipelined load did not read back as written: loading again, "
                    "call by call"
                )
                _flush(url)
                backend.close()
                backend = backend_from_url(url)
            _threaded_fill(backend, receipts(shape, now))
        for record in stale_claims(shape, now):
            backend.insert(record)
        timings["receipts"] = time.perf_counter() - began
        documents = add_documents(url, shape)
        timings["documents"] = documents["seconds"]
        backend.close()
    import redis

    client = redis.Redis.from_url(url.split("?", 1)[0])
    keys = int(client.dbsize())
    client.close()
    return _facts(shape, keys, timings, 0)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The store's warnings about a server without persistence, said once per backend."""
    import logging

    logger = logging.getLogger("crewai_idempotent")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class _Pipelined:
    """While `queue` is set in this thread, every script the store sends (EVALSHA) is put
    on `queue` instead, answered at once with `reply`; everything else goes to the server."""

    local = threading.local()
    installed = False

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        import redis

        original = redis.Redis.execute_command

        def execute_command(self: Any, *args: Any, **options: Any) -> Any:
            queue = getattr(cls.local, "queue", None)
            if queue is not None and args and str(args[0]).upper() in ("EVALSHA", "EVAL"):
                queue.execute_command(*args, **options)
                return cls.local.reply
            return original(self, *args, **options)

        redis.Redis.execute_command = execute_command  # type: ignore[method-assign]
        cls.installed = True


def _pipelined_fill(backend: Any, url: str, work: Iterator[tuple[Record, Record]]) -> int | None:
    import redis

    first = next(work, None)
    if first is None:
        return 0
    claim, final = first
    # The first pair for real: the scripts are loaded and the path is the store's.
    if backend.insert(claim) is not None or not backend.replace(claim, final):
        raise RuntimeError(f"{claim.key} was already there")
    _Pipelined.install()
    client = redis.Redis.from_url(url.split("?", 1)[0])
    pipe = client.pipeline(transaction=False)
    local = _Pipelined.local
    sample: list[Record] = [final]
    done = 1
    try:
        local.queue = pipe
        for claim, final in work:
            local.reply = None  # the claim script's "stored"
            backend.insert(claim)
            local.reply = 1  # the commit script's "replaced"
            backend.replace(claim, final)
            done += 1
            if done % 997 == 0:
                sample.append(final)
            if len(pipe.command_stack) >= REDIS_PIPELINE:
                _send(pipe)
        _send(pipe)
    except Exception:  # noqa: BLE001 - a store that needs the scripts' real replies
        return None
    finally:
        local.queue = None
        client.close()
    for record in sample[:: max(1, len(sample) // 50)]:
        stored = backend.get(record.key)
        if stored is None or stored.to_json() != record.to_json():
            return None
    return done


def _flush(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url.split("?", 1)[0])
    client.flushdb()
    client.close()


def _send(pipe: Any) -> None:
    for reply in pipe.execute(raise_on_error=False):
        if reply not in (None, 1):
            raise RuntimeError(f"a script sent in the load's pipeline answered {reply!r}")


def _threaded_fill(backend: Any, work: Iterator[tuple[Record, Record]]) -> None:
    lock = threading.Lock()
    failures: list[BaseException] = []

    def fill() -> None:
        try:
            while True:
                with lock:
                    pair = next(work, None)
                if pair is None:
                    return
                claim, final = pair
                if backend.insert(claim) is not None or not backend.replace(claim, final):
                    raise RuntimeError(f"{claim.key} was already there")
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            failures.append(exc)

    threads = [threading.Thread(target=fill) for _ in range(REDIS_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


STORES: dict[str, Callable[[Cache, bool], Ledgers]] = {
    "sqlite": SQLiteLedgers,
    "postgres": PostgresLedgers,
    "redis": RedisLedgers,
}
