"""What the PostgreSQL ledger's listing indexes and change mark cost, and upgrading to them.

    python bench/postgres_upgrade.py claims --workers 8 32 --seconds 5 --rounds 3
    python bench/postgres_upgrade.py upgrade --count 1000000
    python bench/postgres_upgrade.py functions

`claims`: claims/s of N processes, one autocommit psycopg connection each, running the
ledger's own two statements (the claim, then the commit) on distinct keys, on a table as
the previous release makes it (its DDL: the table, the status index, the documents'
index) and on one as this version makes it (the indexes of `_upgrade`, the trigger that
moves the change mark), alternating, in one run; then the same through `Ledger` (the
package, one pool of one connection per process) on the new table.

`upgrade`: a table the previous release made, bulk-loaded with COPY (`count` COMMITTED
receipts written as `Record.to_json` writes them, expiring over the next 30 days, 1,000
pending approval requests and a few records that need an operator), then opened by this
version; a thread claims and commits through the backend all along, and the time of each
claim+commit is kept: quiet, then while `build_indexes()` builds everything with CREATE
INDEX CONCURRENTLY (each index's time from its log line). Then the listings' selects,
with the plan PostgreSQL chose and their time.

`functions`: the microseconds the index functions and the trigger add to one write.

Starts its own throwaway server (tests/support/servers.py; fsync off unless --fsync), or
takes --url.
"""

from __future__ import annotations

import argparse
import io
import logging
import multiprocessing
import os
import statistics
import sys
import threading
import time
import uuid
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import psycopg  # noqa: E402

from crewai_idempotent import (  # noqa: E402
    Ledger,
    Order,
    Record,
    Select,
    Status,
    backend_from_url,
)
from crewai_idempotent.backends.postgres import PostgresCacheBackend  # noqa: E402
from crewai_idempotent.backends.postgres._schema import _MIGRATIONS, Statements  # noqa: E402
from crewai_idempotent.backends.postgres._upgrade import NEEDS_OPERATOR  # noqa: E402
from crewai_idempotent.ledger._results import encode  # noqa: E402

RECEIPT = "ch_3PxYz2LkdIwHu7ix0s1Q9aBc"
APPROVALS = "crewai-idempotent/approval/"


def old_table(dsn: str, table: str) -> None:
    """The table exactly as the previous release (61b49de) makes it: its version-1 DDL,
    which this version keeps as its migration, and its version row."""
    sql = Statements(table, None)
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(sql.create_versions)
        for statement in _MIGRATIONS[1]:
            conn.execute(
                statement.format(table=sql.table, index=sql.index, docs_index=sql.docs_index)
            )
        conn.execute(sql.set_version, (table, 1))


def _docs() -> tuple[str, str]:
    now = time.time()
    claim = Record("k", Status.PENDING, "fp" * 32, 1, 1, None, 1, now, now,
                   lease_expires_at=now + 60)  # fmt: skip
    commit = claim.evolve(None, status=Status.COMMITTED, revision=2, result=encode(RECEIPT),
                          expires_at=now + 86400)  # fmt: skip
    return claim.to_json(), commit.to_json()


# -- claims/s --------------------------------------------------------------------------


def _raw_worker(dsn: str, table: str, docs: tuple[str, str], seconds: float,
                start: Any, results: Any) -> None:  # fmt: skip
    sql = Statements(table, None)
    conn = psycopg.connect(dsn, autocommit=True)
    tag = uuid.uuid4().hex[:8]
    claim_doc, commit_doc = docs

    def cycle(key: str) -> None:
        now = time.time()
        conn.execute(sql.claim, {"key": key, "status": "PENDING", "token": 1, "revision": 1,
                                 "updated_at": now, "doc": claim_doc}).fetchall()  # fmt: skip
        conn.execute(sql.replace, {"status": "COMMITTED", "token": 1, "revision": 2,
                                   "updated_at": now, "doc": commit_doc, "key": key,
                                   "current_token": 1, "current_revision": 1})  # fmt: skip

    cycle(f"warm:{tag}")
    start.wait()
    done, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        cycle(f"w:{tag}:{done}")
        done += 1
    conn.close()
    results.put(done)


def _ours_worker(url: str, _table: str, _docs: tuple[str, str], seconds: float,
                 start: Any, results: Any) -> None:  # fmt: skip
    ledger = Ledger(backend_from_url(url))
    tag = uuid.uuid4().hex[:8]
    ledger.run(f"warm:{tag}", lambda: RECEIPT)
    start.wait()
    done, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        ledger.run(f"o:{tag}:{done}", lambda: RECEIPT)
        done += 1
    ledger.close()
    results.put(done)


def _rate(target: Any, args: tuple[Any, ...], workers: int, seconds: float) -> float:
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(workers), context.Queue()
    procs = [
        context.Process(target=target, args=(*args, seconds, start, results))
        for _ in range(workers)
    ]
    for proc in procs:
        proc.start()
    total = sum(results.get(timeout=seconds + 180) for _ in procs)
    for proc in procs:
        proc.join()
    return total / seconds


def claims(dsn: str, workers: list[int], seconds: float, rounds: int) -> None:
    before, after = f"before_{uuid.uuid4().hex[:8]}", f"after_{uuid.uuid4().hex[:8]}"
    old_table(dsn, before)
    backend = PostgresCacheBackend(dsn, table=after, check_durability=False)
    backend.get("-")  # this version's table: every index and the trigger
    assert backend.indexes_ready()
    backend.close()
    docs = _docs()
    url = f"{dsn}?table={after}&check_durability=false&max_size=1"
    print(f"{'workers':>7} {'round':>5} {'before/s':>9} {'after/s':>9} {'ratio':>6} "
          f"{'ledger/s':>9} {'ledger/raw':>10}")  # fmt: skip
    for n in workers:
        ratios, ledger_ratios = [], []
        for r in range(rounds):
            old = _rate(_raw_worker, (dsn, before, docs), n, seconds)
            new = _rate(_raw_worker, (dsn, after, docs), n, seconds)
            ours = _rate(_ours_worker, (url, after, docs), n, seconds)
            ratios.append(new / old)
            ledger_ratios.append(ours / new)
            print(f"{n:>7} {r:>5} {old:>9.0f} {new:>9.0f} {new / old:>6.2f} {ours:>9.0f} "
                  f"{ours / new:>10.2f}", flush=True)  # fmt: skip
        print(f"{n:>7}   med {'':>9} {'':>9} {statistics.median(ratios):>6.2f} {'':>9} "
              f"{statistics.median(ledger_ratios):>10.2f}")  # fmt: skip


def _pgbench_script(table: str, docs: tuple[str, str]) -> str:
    """The ledger's claim and commit statements for pgbench, on a key of their own."""
    sql = Statements(table, None)
    # pgbench reads `:name` as a variable wherever it is: the colons go as escapes.
    claim_doc, commit_doc = (
        d.replace("\\", "\\\\").replace("'", "\\'").replace(":", "\\x3a") for d in docs
    )
    key = "('pb:' || CAST(:client_id AS text) || ':' || CAST(:k AS text))"
    values = {
        "key": key, "status": "'PENDING'", "token": "1", "revision": "1",
        "updated_at": "extract(epoch from clock_timestamp())", "doc": f"E'{claim_doc}'",
    }  # fmt: skip
    claim = sql.claim % values
    replace = sql.replace % {
        "status": "'COMMITTED'", "token": "1", "revision": "2",
        "updated_at": "extract(epoch from clock_timestamp())", "doc": f"E'{commit_doc}'",
        "key": key, "current_token": "1", "current_revision": "1",
    }  # fmt: skip
    return f"\\set k random(1, 1000000000000)\n{claim};\n{replace};\n"


def pgbench(dsn: str, workers: list[int], seconds: float, rounds: int) -> None:
    """The same two statements from pgbench (C: the client costs next to nothing, so
    what differs is the server's work), before/after alternating, `rounds` times."""
    import shutil
    import subprocess
    import tempfile

    from tests.support.servers import postgres_bindir

    binary = shutil.which("pgbench") or str((postgres_bindir() or ".") / "pgbench")  # type: ignore[operator]
    before, after = f"before_{uuid.uuid4().hex[:8]}", f"after_{uuid.uuid4().hex[:8]}"
    old_table(dsn, before)
    backend = PostgresCacheBackend(dsn, table=after, check_durability=False)
    backend.get("-")
    assert backend.indexes_ready()
    backend.close()
    docs = _docs()
    folder = tempfile.mkdtemp()
    scripts = {}
    for table in (before, after):
        scripts[table] = os.path.join(folder, f"{table}.sql")
        with open(scripts[table], "w") as f:
            f.write(_pgbench_script(table, docs))
    print(f"pgbench, -M prepared, {seconds:g} s each: claim+commit cycles per second")
    print(f"{'clients':>7} {'round':>5} {'before/s':>9} {'after/s':>9} {'ratio':>6}")
    for n in workers:
        ratios = []
        for r in range(rounds):
            rates = {}
            for table in (before, after) if r % 2 == 0 else (after, before):
                done = subprocess.run(
                    [binary, "-n", "-M", "prepared", "-c", str(n), "-j", "2", "-T",
                     str(int(seconds)), "-f", scripts[table], dsn],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                line = next(x for x in done.stdout.splitlines() if x.startswith("tps"))
                rates[table] = float(line.split()[2])
            ratios.append(rates[after] / rates[before])
            print(
                f"{n:>7} {r:>5} {rates[before]:>9.0f} {rates[after]:>9.0f} {ratios[-1]:>6.2f}",
                flush=True,
            )
        print(f"{n:>7}   med {'':>9} {'':>9} {statistics.median(ratios):>6.2f}")


# -- upgrading a big table ---------------------------------------------------------------


def bulk_load(dsn: str, table: str, count: int) -> float:
    """COPY `count` committed receipts, 1,000 pending approvals and 20 flagged records."""
    started = time.perf_counter()
    now = time.time()
    buffer = io.StringIO()
    copy = (f'COPY "{table}" (key, status, token, revision, updated_at, doc) FROM STDIN '
            "WITH (FORMAT text)")  # fmt: skip

    def row(record: Record) -> str:
        doc = record.to_json().replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
        return (f"{record.key}\t{record.status.value}\t{record.token}\t{record.revision}\t"
                f"{record.updated_at!r}\t{doc}\n")  # fmt: skip

    with psycopg.connect(dsn, autocommit=True) as conn:
        for start in range(0, count, 50_000):
            buffer.seek(0)
            buffer.truncate()
            for i in range(start, min(start + 50_000, count)):
                at = now - 30 * 86400 * (1 - i / count)
                record = Record(f"pay:{i:09d}", Status.COMMITTED, "f" * 64, 1, 2, None, 1, at, at,
                                expires_at=at + 30 * 86400 + 3600,
                                result=encode({"charge": f"ch_{i}", "amount": 100}))  # fmt: skip
                buffer.write(row(record))
            with conn.cursor() as cur, cur.copy(copy) as writer:
                writer.write(buffer.getvalue())
        buffer.seek(0)
        buffer.truncate()
        for i in range(1000):
            at = now - i
            doc = {"kind": "approval", "id": f"ap_{i}", "key": f"pay:{i}", "tool": "pay",
                   "state": "PENDING", "summary": {"amount": i, "state": "x"}}  # fmt: skip
            buffer.write(row(Record(f"{APPROVALS}ap_{i:06d}", Status.COMMITTED,
                                    "crewai-idempotent-document", 1, 1, None, 0, at, at,
                                    result=encode(doc))))  # fmt: skip
        for i in range(20):
            buffer.write(row(Record(f"unc:{i}", Status.UNCERTAIN, "fp", 1, 3, None, 1, now, now,
                                    needs_operator=True)))  # fmt: skip
        with conn.cursor() as cur, cur.copy(copy) as writer:
            writer.write(buffer.getvalue())
        conn.execute(f'VACUUM ANALYZE "{table}"')
    return time.perf_counter() - started


class Claimer(threading.Thread):
    """Claim+commit through the backend in a loop; each cycle's time, tagged by phase."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.ledger = Ledger(backend_from_url(url))
        self.phase = "quiet"
        self.times: dict[str, list[float]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            started = time.perf_counter()
            self.ledger.run(f"live:{i}", lambda: RECEIPT)
            self.times.setdefault(self.phase, []).append(time.perf_counter() - started)
            i += 1
            time.sleep(0.005)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.perf_counter(), record.getMessage()))


def _ms(values: list[float]) -> str:
    ordered = sorted(values)
    p = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000  # noqa: E731
    return (f"n={len(ordered)} p50={p(0.5):.1f} ms p99={p(0.99):.1f} ms "
            f"max={ordered[-1] * 1000:.1f} ms")  # fmt: skip


SELECTS = {
    "needs operator": Select(needs_operator=True),
    "uncertain": Select(status=Status.UNCERTAIN),
    "pending approvals, newest": Select(
        prefix=APPROVALS, state="PENDING", order=Order.NEWEST, limit=50
    ),
    "approvals of a call": Select(prefix=APPROVALS, subject="pay:7"),
    "expired (none)": Select(expired_by=time.time(), limit=500),
    "newest 50 of everything": Select(order=Order.NEWEST, limit=50),
    "oldest 50 after a point": Select(
        order=Order.OLDEST, limit=50, after=(time.time() - 86400, "pay:")
    ),
    "last hour, newest": Select(updated_from=time.time() - 3600, order=Order.NEWEST, limit=50),
    "committed last hour (key order)": Select(
        status=Status.COMMITTED, updated_from=time.time() - 3600
    ),
    "prefix mail: (none)": Select(prefix="mail:"),
}


def run_selects(url: str) -> None:
    backend = backend_from_url(url)
    from crewai_idempotent.backends.postgres._select import Plan

    found = backend._upgrade_state(refresh=True)
    for name, query in SELECTS.items():
        plan = Plan(backend._sql, backend._objects, found, query)
        text, params = plan.statement(query.after, min(500, query.limit or 500))
        best = []
        for _ in range(3):
            before = backend.scan_stats().rows
            started = time.perf_counter()
            found_n = sum(1 for _ in backend.select(query))
            best.append(time.perf_counter() - started)
        rows = backend.scan_stats().rows - before
        with psycopg.connect(backend._conninfo, autocommit=True) as conn:
            lines = [r[0] for r in conn.execute("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) "
                                                + text, params, prepare=False)]  # fmt: skip
        used = sorted({w for line in lines for w in line.replace('"', " ").split()
                       if w.endswith(("_status", "_docs", "_flagged", "_expiry", "_state",
                                      "_subject", "_docs_time", "_pkey"))})  # fmt: skip
        scans = [line.strip() for line in lines if "Seq Scan" in line]
        print(f"  {name:34} {min(best) * 1000:8.1f} ms  found {found_n:5}  rows read {rows:5}  "
              f"indexes {','.join(used) or '-'}{'  SEQ SCAN' if scans else ''}")  # fmt: skip
    backend.close()


def upgrade(dsn: str, count: int, quiet_s: float) -> None:
    table = f"big_{uuid.uuid4().hex[:8]}"
    old_table(dsn, table)
    print(f"bulk load: {count} rows by COPY in {bulk_load(dsn, table, count):.1f} s")
    with psycopg.connect(dsn, autocommit=True) as conn:
        size = conn.execute(f"SELECT pg_size_pretty(pg_total_relation_size('\"{table}\"'))")
        print(f"table with its old indexes: {size.fetchone()[0]}")  # type: ignore[index]
    url = f"{dsn}?table={table}&check_durability=false"
    # Every backend but the builder leaves the build to it: what is measured is one build.
    quiet_url = url + "&build_in_background=false"
    claimer = Claimer(quiet_url)
    claimer.start()
    time.sleep(quiet_s)
    print("selects before the indexes (the same statements, without them):")
    run_selects(quiet_url)
    lines = Lines()
    logging.getLogger("crewai_idempotent").addHandler(lines)
    logging.getLogger("crewai_idempotent").setLevel(logging.INFO)
    claimer.phase = "building"
    builder = PostgresCacheBackend.from_url(url)
    started = time.perf_counter()
    assert builder.build_indexes()
    total = time.perf_counter() - started
    claimer.phase = "after"
    time.sleep(quiet_s)
    claimer.stop.set()
    claimer.join()
    builder.close()
    marks = [(t, m) for t, m in lines.lines if "building the index" in m or "analyzing" in m]
    print(f"build_indexes(): {total:.1f} s in all")
    for (t, m), (t2, _m2) in zip(marks, [*marks[1:], (started + total, "")], strict=False):
        what = m.split()[3] if "building" in m else "ANALYZE"
        print(f"  {what:40} {t2 - t:6.1f} s")
    for phase in ("quiet", "building", "after"):
        print(f"claim+commit, {phase:9}: {_ms(claimer.times.get(phase, [0.0]))}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name, size in conn.execute(
            "SELECT c.relname, pg_size_pretty(pg_relation_size(c.oid)) FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = %s::regclass "
            "ORDER BY c.relname", (f'"{table}"',)):  # fmt: skip
            print(f"  index {name:45} {size}")
    print("selects with the indexes:")
    run_selects(quiet_url)
    claimer.ledger.close()


# -- what a write pays -----------------------------------------------------------------

_PER_CALL = (
    "EXPLAIN (ANALYZE, FORMAT JSON) SELECT count({expr}) FROM "
    "(SELECT %s::text || (g %% 2)::text AS doc FROM generate_series(1, %s) AS g) AS s"
)


def _server_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cycle_cpu(dsn: str, table: str, docs: tuple[str, str], n: int) -> float:
    """Server CPU microseconds per claim+commit cycle (the server process's own
    utime+stime from /proc: what the statements cost it, whatever else the machine runs)."""
    sql = Statements(table, None)
    claim_doc, commit_doc = docs
    with psycopg.connect(dsn, autocommit=True) as conn:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        tag = uuid.uuid4().hex[:8]

        def cycle(key: str) -> None:
            now = time.time()
            claim = {"key": key, "status": "PENDING", "token": 1, "revision": 1,
                     "updated_at": now, "doc": claim_doc}  # fmt: skip
            conn.execute(sql.claim, claim).fetchall()
            conn.execute(sql.replace, {"status": "COMMITTED", "token": 1, "revision": 2,
                                       "updated_at": now, "doc": commit_doc, "key": key,
                                       "current_token": 1, "current_revision": 1})  # fmt: skip

        for i in range(50):
            cycle(f"warm:{tag}:{i}")
        before = _server_cpu(pid)
        for i in range(n):
            cycle(f"c:{tag}:{i}")
        return (_server_cpu(pid) - before) / n * 1e6


def functions(dsn: str, n: int) -> None:
    table = f"fn_{uuid.uuid4().hex[:8]}"
    backend = PostgresCacheBackend(dsn, table=table, check_durability=False)
    backend.get("-")
    objects = backend._objects
    backend.close()
    docs = _docs()
    document = {"kind": "approval", "id": "ap_1", "key": "pay:1", "tool": "pay",
                "state": "PENDING", "summary": {"to": "x" * 500, "amount": 5}}  # fmt: skip
    approval = Record(APPROVALS + "ap_1", Status.COMMITTED, "crewai-idempotent-document", 1, 1,
                      None, 0, 1.0, 1.0, result=encode(document)).to_json()  # fmt: skip
    print(f"documents: claim {len(docs[0])} B, commit {len(docs[1])} B, "
          f"approval {len(approval)} B")  # fmt: skip
    with psycopg.connect(dsn, autocommit=True) as conn:

        def best(expr: str, doc: str) -> float:
            times = []
            for _ in range(3):
                plan = conn.execute(_PER_CALL.format(expr=expr), (doc, n), prepare=False)
                times.append(plan.fetchone()[0][0]["Execution Time"])  # type: ignore[index]
            return min(times)

        for label, expr, doc in (
            ("needs_operator predicate, commit", "NULLIF(" + NEEDS_OPERATOR + ", true)", docs[1]),
            ("expiry function, commit", objects.expires, docs[1]),
            ("document state, approval", objects.state, approval),
            ("document subject, approval", objects.subject, approval),
        ):
            cost = (best(expr, doc) - best("doc", doc)) * 1000 / n
            print(f"  {label:36} {cost:6.2f} us per call")
    before = f"before_{uuid.uuid4().hex[:8]}"
    old_table(dsn, before)
    forever = (docs[0], docs[1].replace(f',"expires_at":{_ttl(docs[1])},', ',"expires_at":null,'))
    rounds: dict[str, list[float]] = {"before": [], "after": [], "after, no ttl": []}
    for _ in range(5):
        rounds["before"].append(_cycle_cpu(dsn, before, docs, 3000))
        rounds["after"].append(_cycle_cpu(dsn, table, docs, 3000))
        rounds["after, no ttl"].append(_cycle_cpu(dsn, table, forever, 3000))
    print(
        "server CPU per claim+commit cycle (one connection, best of 5 x 3,000): "
        + ", ".join(f"{name} {min(values):.0f} us" for name, values in rounds.items())
    )


def _ttl(doc: str) -> str:
    return doc.split(',"expires_at":', 1)[1].split(",", 1)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["claims", "pgbench", "upgrade", "functions"])
    parser.add_argument("--url", help="a PostgreSQL URL (default: a throwaway server)")
    parser.add_argument("--fsync", action="store_true")
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--quiet", type=float, default=10.0)
    args = parser.parse_args()
    server = None
    if args.url:
        dsn = args.url
    else:
        from tests.support.servers import start_postgres

        server = start_postgres(
            fsync=args.fsync, settings={"shared_buffers": "'256MB'", "max_wal_size": "'4GB'"}
        )
        dsn = server.dsn()
    if args.what == "claims":
        claims(dsn, args.workers, args.seconds, args.rounds)
    elif args.what == "pgbench":
        pgbench(dsn, args.workers, args.seconds, args.rounds)
    elif args.what == "upgrade":
        upgrade(dsn, args.count, args.quiet)
    else:
        functions(dsn, 20_000)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
