"""The SQLite ledger's listings: index tables that an older ledger gets in place, that the
previous release's writes keep right, that no document can make fail or lie, and a
change mark that moves with every writer.

The meaning of a select is `Select.apply` over the records a scan reads (the primary key,
which every release keeps); the cost is the store's `scan_stats()`; what SQLite was asked
is seen through `tests.support.sqlite.Connections`. Never the wall clock.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import Ledger, Order, Record, Select, SQLiteCacheBackend, Status
from crewai_idempotent.ledger._backend import DOCUMENTS
from crewai_idempotent.ledger._results import encode
from tests.backends.test_select import _random_select
from tests.support.sqlite import Connections

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000.0
APPROVALS = DOCUMENTS + "approval/"
PREVIOUS_RELEASE = "61b49de"

# What the previous release (61b49de) makes and writes, spelled out here so that a change
# of today's statements cannot change what "a ledger of the previous release" means.
OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency_records (
    key        TEXT PRIMARY KEY,
    status     TEXT NOT NULL,
    token      INTEGER NOT NULL,
    revision   INTEGER NOT NULL,
    updated_at REAL NOT NULL,
    doc        TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_records_status ON idempotency_records (status);
PRAGMA user_version = 1;
"""
OLD_INSERT = (
    "INSERT INTO idempotency_records (key, status, token, revision, updated_at, doc) "
    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO NOTHING"
)
OLD_REPLACE = (
    "UPDATE idempotency_records SET status = ?, token = ?, revision = ?, updated_at = ?, doc = ? "
    "WHERE key = ? AND token = ? AND revision = ?"
)
OLD_DELETE = "DELETE FROM idempotency_records WHERE key = ? AND token = ? AND revision = ?"


class OldWriter:
    """A connection writing as the previous release does: its statements, its JSON."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("PRAGMA busy_timeout = 5000")

    def insert(self, record: Record) -> bool:
        params = (record.key, record.status.value, record.token, record.revision,
                  record.updated_at, record.to_json())  # fmt: skip
        return self.conn.execute(OLD_INSERT, params).rowcount == 1

    def replace(self, current: Record, new: Record) -> bool:
        params = (new.status.value, new.token, new.revision, new.updated_at, new.to_json(),
                  current.key, current.token, current.revision)  # fmt: skip
        return self.conn.execute(OLD_REPLACE, params).rowcount == 1

    def delete(self, current: Record) -> bool:
        params = (current.key, current.token, current.revision)
        return self.conn.execute(OLD_DELETE, params).rowcount == 1

    def close(self) -> None:
        self.conn.close()


def old_ledger(path: Path, records: list[Record]) -> None:
    """A ledger file as the previous release leaves it: its schema, its rows."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.executescript(OLD_SCHEMA)
    conn.close()
    os.chmod(path, 0o600)
    writer = OldWriter(path)
    writer.conn.execute("BEGIN")
    for record in records:
        assert writer.insert(record)
    writer.conn.execute("COMMIT")
    writer.close()


def record(
    key: str,
    status: Status = Status.COMMITTED,
    *,
    at: float = T0,
    expires_at: float | None = None,
    needs_operator: bool = False,
    result: Any = None,
) -> Record:
    result = {"t": "json", "v": {"key": key}} if result is None else result
    return Record(key, status, "fp", 1, 1, None, 1, at, at, expires_at=expires_at,
                  result=result, needs_operator=needs_operator)  # fmt: skip


def document(key: str, doc: dict[str, Any], *, at: float = T0) -> Record:
    return Record(key, Status.COMMITTED, "crewai-idempotent-document", 1, 1, None, 1, at, at,
                  result=encode(doc))  # fmt: skip


def raw_document(key: str, doc: dict[str, Any]) -> Record:
    """A document stored as JSON whatever it holds (`encode` would type a NaN): the
    record's JSON then holds NaN or Infinity as the constants pydantic writes."""
    return Record(key, Status.COMMITTED, "crewai-idempotent-document", 1, 1, None, 1, T0, T0,
                  result={"t": "json", "v": doc})  # fmt: skip


def mixed(count: int, rng: random.Random) -> list[Record]:
    """Records of every status, some flagged, some expiring, and approval documents."""
    out = []
    for i in range(count):
        at = T0 + rng.choice([0, 1, 2, 3]) * 60 + rng.random()
        if rng.random() < 0.15:
            doc = {"kind": "approval", "id": f"r{i}", "key": f"pay:{rng.randrange(5)}",
                   "state": rng.choice(["PENDING", "APPROVED", "DENIED", "USED"]),
                   "summary": {"state": "USED", "key": "pay:0"}}  # fmt: skip
            out.append(document(f"{APPROVALS}{i:05d}", doc, at=at))
            continue
        status = rng.choice(list(Status))
        expires = rng.choice([None, T0 + 100, T0 + 1000]) if status is Status.COMMITTED else None
        out.append(record(f"{rng.choice(['pay:', 'mail:', 'pay:eu:'])}{i:05d}", status, at=at,
                          expires_at=expires, needs_operator=rng.random() < 0.1))  # fmt: skip
    return out


SELECTS = [
    Select(status=Status.UNCERTAIN),
    Select(status=Status.PENDING, order=Order.NEWEST, limit=5),
    Select(needs_operator=True),
    Select(needs_operator=True, order=Order.NEWEST),
    Select(expired_by=T0 + 500),
    Select(expired_by=T0 + 5000, order=Order.OLDEST),
    Select(prefix="mail:", order=Order.NEWEST),
    Select(prefix=APPROVALS, state="PENDING"),
    Select(prefix=APPROVALS, state="USED", order=Order.NEWEST),
    Select(prefix=APPROVALS, subject="pay:1"),
    Select(prefix=APPROVALS, state="APPROVED", subject="pay:2", order=Order.OLDEST),
    Select(prefix=APPROVALS, order=Order.NEWEST),
    Select(updated_from=T0 + 120, order=Order.NEWEST),
    Select(updated_before=T0 + 60),
    Select(order=Order.OLDEST, limit=7),
    Select(order=Order.NEWEST),
]


def keys(records: Any) -> list[str]:
    return [r.key for r in records]


def assert_answers(backend: SQLiteCacheBackend, queries: list[Select]) -> None:
    """Every select yields what `Select.apply` yields over what a scan reads."""
    everything = list(backend.scan())
    for query in queries:
        assert keys(backend.select(query)) == keys(query.apply(everything)), query


def rows_read(backend: SQLiteCacheBackend, query: Select) -> tuple[int, int]:
    before = backend.scan_stats().rows
    found = len(list(backend.select(query)))
    return found, backend.scan_stats().rows - before


# -- upgrade in place -------------------------------------------------------------------


def test_a_ledger_of_the_previous_release_gets_the_indexes_in_place(tmp_path: Path) -> None:
    """Opened by this release: the index tables are made at once and filled by
    `build_indexes` in chunks; until then every select is right (read from the primary
    key), afterwards it reads what it finds; the schema number the previous release
    checks stays 1, and its writes meanwhile are in the tables."""
    path = tmp_path / "ledger.db"
    rng = random.Random(7)
    bulk = [record(f"bulk:{i:05d}", at=T0 - 1000 + i * 0.01) for i in range(3000)]
    old_ledger(path, mixed(400, rng) + bulk)
    backend = SQLiteCacheBackend(path, synchronous="NORMAL", background_indexing=False)
    try:
        assert not backend.indexes_ready()
        assert_answers(backend, SELECTS)  # from the primary key, filtered
        found, read = rows_read(backend, Select(needs_operator=True))
        assert read >= 3000  # the slow path, before the tables are filled
        # The previous release keeps writing while the tables are filled.
        old = OldWriter(path)
        later = record("late:1", Status.UNCERTAIN, at=T0 + 9000, needs_operator=True)
        assert old.insert(later)
        assert backend.build_indexes(timeout_s=0) is False  # no time given: not done
        assert backend.build_indexes()
        assert backend.indexes_ready()
        moved = later.evolve(None, status=Status.COMMITTED, needs_operator=False,
                             expires_at=T0 + 1, updated_at=T0 + 9001)  # fmt: skip
        assert old.replace(later, moved)
        assert old.insert(document(APPROVALS + "zz", {"key": "pay:9", "state": "PENDING"}))
        old.close()
        assert_answers(backend, SELECTS)
        found, read = rows_read(backend, Select(needs_operator=True))
        assert found and read <= found + 2
        found, read = rows_read(backend, Select(prefix=APPROVALS, state="PENDING"))
        assert found and read <= found + 2
        raw = sqlite3.connect(path)
        assert raw.execute("PRAGMA user_version").fetchone()[0] == 1
        raw.close()
    finally:
        backend.close()


def test_the_backfill_goes_in_short_transactions_while_claims_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The records already in an upgraded ledger join the index tables a chunk per write
    transaction (never the whole table in one, as CREATE INDEX would), and claims made
    meanwhile, through this store and the previous release, are in the tables after."""
    path = tmp_path / "ledger.db"
    old_ledger(path, [record(f"k:{i:05d}", at=T0 + i) for i in range(6000)])
    seen = Connections(monkeypatch)
    backend = SQLiteCacheBackend(path, synchronous="NORMAL", background_indexing=False)
    ledger = Ledger(backend)
    stop = threading.Event()
    claimed: list[str] = []

    def claim() -> None:
        n = 0
        while not stop.is_set():
            ledger.run(f"during:{n}", lambda: "ok")
            claimed.append(f"during:{n}")
            n += 1

    worker = threading.Thread(target=claim)
    worker.start()
    try:
        assert backend.build_indexes()
    finally:
        stop.set()
        worker.join()
    chunks = [
        s for s in seen.statements if s.startswith("INSERT OR IGNORE INTO idempotency_settled")
    ]
    assert len(chunks) >= 2, "the backfill ran as one transaction"
    newest = list(backend.select(Select(order=Order.NEWEST, limit=len(claimed) + 1)))
    assert set(claimed) <= set(keys(newest))
    assert_answers(
        backend, [Select(order=Order.OLDEST), Select(status=Status.COMMITTED, order=Order.NEWEST)]
    )
    backend.close()


def test_each_chunk_of_the_backfill_reads_its_own_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every statement the backfill runs over the records searches one range of the
    primary key or of the status index, bounded on both sides by its chunk: a chunk costs
    its records, not the rest of the ledger after it."""
    path = tmp_path / "ledger.db"
    old_ledger(path, mixed(1500, random.Random(4)))
    seen = Connections(monkeypatch)
    backend = SQLiteCacheBackend(path, synchronous="NORMAL", background_indexing=False)
    assert backend.build_indexes()
    backend.close()
    fills = {s for s in seen.statements if s.startswith("INSERT OR IGNORE INTO idempotency_")}
    raw = sqlite3.connect(path)
    try:
        for statement in fills:
            plans = [row[3] for row in raw.execute(f"EXPLAIN QUERY PLAN {statement}")]
            searches = [p for p in plans if " idempotency_records " in f"{p} " or " r " in f"{p} "]
            assert searches, plans
            for plan in searches:
                assert plan.startswith("SEARCH") and "key>? AND key<?" in plan, (statement, plan)
        assert len(fills) >= 4
    finally:
        raw.close()


def test_a_background_build_completes_and_many_processes_open_at_once(tmp_path: Path) -> None:
    """Four processes open an old ledger together and claim keys: whichever builds, the
    tables end complete and every claim is in them."""
    path = tmp_path / "ledger.db"
    old_ledger(path, mixed(2000, random.Random(3)))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_open_and_claim, args=(str(path), n)) for n in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    backend = SQLiteCacheBackend(path, background_indexing=False)
    try:
        assert backend.build_indexes(timeout_s=60)
        claims = list(backend.select(Select(prefix="proc", order=Order.NEWEST)))
        assert len(claims) == 4 * 50
        assert_answers(backend, SELECTS)
    finally:
        backend.close()


def _open_and_claim(path: str, n: int) -> None:
    backend = SQLiteCacheBackend(path, synchronous="NORMAL")
    ledger = Ledger(backend)
    for i in range(50):
        ledger.run(f"proc{n}:{i}", lambda: "ok")
    backend.build_indexes(timeout_s=60)
    backend.close()


def test_the_previous_release_itself_writes_beside_this_one(tmp_path: Path) -> None:
    """The previous release's code (checked out from git), claiming, committing, flagging
    and deleting on a ledger this release has indexed: its writes are in the tables."""
    tree = tmp_path / "previous"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", PREVIOUS_RELEASE, "crewai_idempotent"],
        capture_output=True,
    )
    if archive.returncode != 0:
        pytest.skip(f"the previous release {PREVIOUS_RELEASE} is not in this checkout")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, synchronous="NORMAL")
    backend.insert(record("ours:1", Status.UNCERTAIN, needs_operator=True))
    assert backend.indexes_ready()
    script = textwrap.dedent(f"""
        import crewai_idempotent, sys
        assert crewai_idempotent.__file__.startswith({str(tree)!r}), crewai_idempotent.__file__
        from crewai_idempotent import Ledger, SQLiteCacheBackend, Status
        backend = SQLiteCacheBackend({str(path)!r}, synchronous="NORMAL")
        ledger = Ledger(backend)
        for i in range(20):
            ledger.run(f"old:{{i}}", lambda: {{"charge": i, "nan": float("nan")}}, ttl=60)
        held = backend.get("ours:1")
        assert backend.replace(held, held.evolve(None, status=Status.COMMITTED,
                               needs_operator=False, updated_at=held.updated_at + 1))
        assert backend.delete(backend.get("old:0"))
        backend.close()
    """)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tree, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    try:
        assert keys(backend.select(Select(needs_operator=True))) == []
        assert len(keys(backend.select(Select(prefix="old:", order=Order.NEWEST)))) == 19
        assert len(keys(backend.select(Select(expired_by=backend.now() + 3600)))) == 19
        assert_answers(backend, SELECTS)
    finally:
        backend.close()


# -- documents no write can fail on, and no content can hide -------------------------------


def test_nan_and_infinity_anywhere_never_fail_a_write_and_are_selected(tmp_path: Path) -> None:
    """SQLite 3.40's JSON functions reject NaN and Infinity; nothing the index tables do
    reads JSON with them, so such records are written, changed, listed and deleted."""
    backend = SQLiteCacheBackend(tmp_path / "ledger.db", synchronous="NORMAL")
    nan, inf = float("nan"), float("inf")
    try:
        written = [
            record("nan:1", result={"t": "json", "v": {"x": nan, "y": [inf, -inf]}},
                   expires_at=T0 + 5, needs_operator=True),
            record("nan:2", expires_at=inf),
            record("nan:3", expires_at=nan),
            record("nan:4", expires_at=1e300),
            raw_document(APPROVALS + "n1", {"key": "pay:1", "state": "PENDING",
                                            "summary": {"amount": nan}}),
            raw_document(APPROVALS + "n2", {"summary": {"amount": inf}, "key": "pay:1",
                                            "state": "PENDING"}),
        ]  # fmt: skip
        for r in written:
            assert backend.insert(r) is None
        assert keys(backend.select(Select(expired_by=T0 + 5))) == ["nan:1"]
        assert keys(backend.select(Select(expired_by=math.inf))) == ["nan:1", "nan:2", "nan:4"]
        assert keys(backend.select(Select(needs_operator=True))) == ["nan:1"]
        pending = Select(prefix=APPROVALS, state="PENDING", subject="pay:1")
        assert keys(backend.select(pending)) == [APPROVALS + "n1", APPROVALS + "n2"]
        first = written[0]
        changed = first.evolve(None, result={"t": "json", "v": [nan]}, needs_operator=False)
        assert backend.replace(first, changed)
        assert keys(backend.select(Select(needs_operator=True))) == []
        for r in [changed, *written[1:]]:
            assert backend.delete(r)
        assert list(backend.select(Select(expired_by=math.inf))) == []
        assert (
            "NaN" in first.to_json() and "Infinity" in written[4].to_json() + written[5].to_json()
        )
    finally:
        backend.close()


HOSTILE: list[Any] = [
    ',"needs_operator":true,"evidence":[]',
    {"needs_operator": True, "evidence": []},
    ',"expires_at":1,"result":{"t":"json","v":{"state":"PENDING"}}',
    {"state": "PENDING", "key": "pay:1", "expires_at": 0},
    [{"state": "APPROVED"}, "]}", "{"],
    'x"state":"PENDING"',
    {'x"state': "PENDING", "a\\": '"', "key\\": "pay:1"},
    "\\",
    "é ✓ \u2028 \x00",
]


def test_model_written_content_never_hides_a_record_nor_fails_a_write(tmp_path: Path) -> None:
    """Receipts and approval summaries holding what the index tables look for (the flag's
    text, an expiry, `state` and `key` at every depth, quotes, backslashes, brackets
    before the real field): every select still yields what `Select.apply` yields."""
    backend = SQLiteCacheBackend(tmp_path / "ledger.db", synchronous="NORMAL")
    rng = random.Random(11)
    try:
        for i in range(400):
            hostile = rng.choice(HOSTILE)
            if rng.random() < 0.5:
                fields: list[tuple[str, Any]] = [
                    ("kind", "approval"), ("id", f"r{i}"),
                    ("key", rng.choice(["pay:1", "pay:2", 'pay:"3', "pay:\\4", "pay:é"])),
                    ("state", rng.choice(["PENDING", "USED", 'PEN"DING', None, 5])),
                    ("summary", hostile), ("reason", rng.choice(HOSTILE)),
                    ('x"state', rng.choice(["PENDING", "USED"])), ('my"key', "pay:2"),
                ]  # fmt: skip
                rng.shuffle(fields)  # the real fields after nested, hostile ones too
                r = document(f"{APPROVALS}{i:04d}", dict(fields), at=T0 + rng.randrange(5))
            else:
                r = record(f"pay:{i:04d}", rng.choice(list(Status)), at=T0 + rng.randrange(5),
                           expires_at=rng.choice([None, T0 + 1, T0 + 9]),
                           needs_operator=rng.random() < 0.2,
                           result={"t": "json", "v": hostile})  # fmt: skip
            assert backend.insert(r) is None
        queries = [*SELECTS]
        for state in ("PENDING", "USED", 'PEN"DING'):
            for subject in (None, "pay:1", 'pay:"3', "pay:\\4", "pay:é"):
                for order in Order:
                    queries.append(Select(prefix=APPROVALS, state=state, subject=subject,
                                          order=order))  # fmt: skip
        for subject in ("pay:1", 'pay:"3', "pay:\\4", "pay:é"):
            queries.append(Select(prefix=APPROVALS, subject=subject, order=Order.NEWEST))
        queries += [Select(expired_by=T0 + 1), Select(expired_by=T0 + 8, order=Order.NEWEST)]
        assert_answers(backend, queries)
    finally:
        backend.close()


def test_random_writes_by_both_releases_keep_every_select_right(tmp_path: Path) -> None:
    """Claims, commits, flags raised and cleared, documents changing state, deletes, by
    this store and the previous release's statements in turn, while selects page
    through: the answers stay `Select.apply`'s."""
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, synchronous="NORMAL")
    backend.get("-")  # the file made
    old = OldWriter(path)
    rng = random.Random(5)
    live: dict[str, Record] = {}
    try:
        for step in range(1500):
            writer: Any = backend if rng.random() < 0.5 else old
            key = rng.choice([f"pay:{rng.randrange(60)}", f"{APPROVALS}{rng.randrange(20)}"])
            held = live.get(key)
            at = T0 + step
            if held is None:
                if key.startswith(APPROVALS):
                    new = document(key, {"key": f"pay:{rng.randrange(4)}", "state": "PENDING"},
                                   at=at)  # fmt: skip
                else:
                    new = record(key, Status.PENDING, at=at)
                assert writer.insert(new) in (None, True)
                live[key] = new
            elif rng.random() < 0.15:
                assert writer.delete(held)
                del live[key]
            else:
                if key.startswith(APPROVALS):
                    state = rng.choice(["PENDING", "APPROVED", "USED"])
                    new = held.evolve(None, result=encode({"key": "pay:1", "state": state}),
                                      updated_at=at)  # fmt: skip
                else:
                    status = rng.choice(list(Status))
                    new = held.evolve(None, status=status, updated_at=at,
                                      needs_operator=rng.random() < 0.2,
                                      expires_at=T0 + rng.randrange(3000)
                                      if status is Status.COMMITTED else None)  # fmt: skip
                assert writer.replace(held, new)
                live[key] = new
            if step % 100 == 99:
                assert_answers(backend, [*SELECTS, _random_select(rng), _random_select(rng)])
    finally:
        old.close()
        backend.close()


def test_pages_read_while_others_write_yield_each_steady_record_once(tmp_path: Path) -> None:
    """Threads claim and commit new keys (their records land among the pages' entries)
    while a reader pages through every order: each record that stays as it was is
    yielded exactly once, in order, whatever was written meanwhile."""
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, synchronous="NORMAL")
    steady = [record(f"steady:{i:04d}", at=T0 + i) for i in range(600)]
    for r in steady:
        backend.insert(r)
    stop = threading.Event()

    def write(n: int) -> None:
        other = SQLiteCacheBackend(path, synchronous="NORMAL")
        ledger = Ledger(other)
        for i in range(400):  # bounded: an oldest-first reader must reach the end
            if stop.is_set():
                break
            ledger.run(f"new:{n}:{i}", lambda: "ok")
        other.close()

    writers = [threading.Thread(target=write, args=(n,)) for n in range(2)]
    for w in writers:
        w.start()
    try:
        for order in Order:
            query = Select(status=Status.COMMITTED, order=order, limit=37)
            seen: list[Record] = []
            while True:
                page = list(backend.select(query))
                seen += page
                if len(page) < 37:
                    break
                query = query.page_after(page[-1])
            mine = [r.key for r in seen if r.key.startswith("steady:")]
            assert sorted(mine) == [r.key for r in steady], order
            positions = [query.position(r) for r in seen]
            ordered = sorted(positions, reverse=order is Order.NEWEST)
            assert positions == ordered and len(set(positions)) == len(positions), order
    finally:
        stop.set()
        for w in writers:
            w.join()
        backend.close()


# -- what SQLite is asked ---------------------------------------------------------------


def test_every_listing_statement_searches_an_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plans of the statements the selects run: a SEARCH of an index or a primary
    key, never a SCAN of a table; a sort (TEMP B-TREE) only where docs/backends.md says
    SQLite sorts (the expiry table, and the key order from a time index)."""
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, synchronous="NORMAL")
    for r in mixed(300, random.Random(2)):
        backend.insert(r)
    seen = Connections(monkeypatch)
    queries = [*SELECTS, Select(status=Status.COMMITTED, updated_before=T0 + 1),
               Select(prefix=APPROVALS, subject="pay:1", order=Order.KEY),
               Select(needs_operator=True, status=Status.UNCERTAIN, prefix="pay:")]  # fmt: skip
    backend.close()
    backend = SQLiteCacheBackend(path, synchronous="NORMAL")  # statements traced from here
    try:
        params_of: dict[str, int] = {}
        for query in queries:
            list(backend.select(query))
        for statement in seen.statements:
            if statement.startswith("SELECT") and "idempotency_records" in statement:
                params_of[statement] = statement.count("?")
    finally:
        backend.close()
    raw = sqlite3.connect(path)
    try:
        sorted_by_design = 0
        for statement in params_of:
            plan = " | ".join(row[3] for row in raw.execute(f"EXPLAIN QUERY PLAN {statement}"))
            assert "SCAN idempotency" not in plan, (statement, plan)
            if "TEMP B-TREE" in plan:
                designed = ("idempotency_expiry", "ORDER BY key", "idempotency_records_status")
                assert any(word in statement for word in designed), plan
                sorted_by_design += 1
        assert params_of and sorted_by_design < len(params_of)
    finally:
        raw.close()


def test_a_read_only_look_at_an_old_ledger_still_answers(tmp_path: Path) -> None:
    """A process that cannot write the file (here: the write lock held by another for
    longer than the busy timeout) cannot make the index tables; its selects read the
    primary key and stay right."""
    path = tmp_path / "ledger.db"
    old_ledger(path, mixed(200, random.Random(9)))
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        backend = SQLiteCacheBackend(path, busy_timeout_s=0.05, background_indexing=False)
        assert not backend.indexes_ready()
        assert_answers(backend, SELECTS)
        backend.close()
    finally:
        holder.execute("ROLLBACK")
        holder.close()


# -- changes() ------------------------------------------------------------------------


def test_changes_moves_with_this_backends_own_writes_and_stays_when_idle(
    tmp_path: Path,
) -> None:
    backend = SQLiteCacheBackend(tmp_path / "ledger.db", synchronous="NORMAL")
    try:
        first = backend.changes()
        assert backend.changes() == first
        r = record("k")
        backend.insert(r)
        second = backend.changes()
        assert second != first
        list(backend.scan())
        backend.get("k")
        list(backend.select(Select(order=Order.NEWEST)))
        assert backend.changes() == second  # reads move nothing
        backend.replace(r, r.evolve(None, status=Status.FAILED))
        assert backend.changes() != second
    finally:
        backend.close()


def test_changes_sees_another_process_and_the_previous_releases_writes(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, synchronous="NORMAL")
    try:
        mark = backend.changes()
        script = (
            "import sys; from crewai_idempotent import Ledger, SQLiteCacheBackend; "
            f"Ledger(SQLiteCacheBackend({str(path)!r})).run('other', lambda: 1)"
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-c", script], env=env, check=True)
        moved = backend.changes()
        assert moved != mark
        old = OldWriter(path)
        assert old.insert(record("old"))
        old.close()
        assert backend.changes() != moved
    finally:
        backend.close()


def test_changes_after_fork_in_the_child_and_the_parent(tmp_path: Path) -> None:
    """A fresh interpreter uses the mark, forks; the child asks on a connection of its own
    and its write moves the parent's mark; threads ask at once without harm."""
    path = tmp_path / "ledger.db"
    script = textwrap.dedent(f"""
        import json, os, threading
        from crewai_idempotent import SQLiteCacheBackend, Record, Status
        backend = SQLiteCacheBackend({str(path)!r}, synchronous="NORMAL")
        def put(key):
            backend.insert(Record(key, Status.COMMITTED, "fp", 1, 1, None, 1, 1.0, 1.0))
        put("before")
        marks = []
        threads = [threading.Thread(target=lambda: marks.append(backend.changes()))
                   for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        mark = backend.changes()
        read, write = os.pipe()
        go_read, go_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.read(go_read, 1)  # the parent has read its mark
            first = backend.changes()
            same = backend.changes() == first
            put("child")
            moved = backend.changes() != first
            os.write(write, json.dumps([same, moved]).encode())
            os._exit(0)
        os.close(write)
        mark = backend.changes()  # on a connection of its own again since the fork
        os.write(go_write, b"x")
        _, status = os.waitpid(pid, 0)
        child = json.loads(os.read(read, 100))
        after = backend.changes()
        print(json.dumps({{"threads": len(set(map(tuple, marks))), "child": child,
                          "status": status, "moved": after != mark,
                          "stays": backend.changes() == after}}))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    seen = json.loads(done.stdout)
    assert seen == {"threads": 1, "child": [True, True], "status": 0, "moved": True,
                    "stays": True}  # fmt: skip
