"""Scans cost what they find: the people's side reads only the documents it lists, and
every scan streams in bounded batches, also while the ledger changes under it.

Observed through each store's `scan_stats()` (the records its scans read, and the
statements or round trips they took), the objects a scan holds (`gc`), and the pool a
PostgreSQL backend is given; never the wall clock.
"""

from __future__ import annotations

import gc
import random
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import (
    ApprovalRequired,
    CacheBackend,
    FileLockCacheBackend,
    Ledger,
    Record,
    SQLiteCacheBackend,
    Status,
    backend_from_url,
)
from crewai_idempotent.backends._scan import BATCH
from crewai_idempotent.gates._approvals import Approvals
from crewai_idempotent.gates._plan import Plan
from crewai_idempotent.gates._spend import Money, SpendCap, SpendLedger, Where
from crewai_idempotent.ledger._backend import DOCUMENTS
from tests.support.servers import PostgresServer, RedisServer

RECORDS = 2000
STORES = ["sqlite", "postgres", "redis", "filelock"]


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A store of each kind, set up to be filled quickly (no sync per write: what is
    counted here is what a scan reads, not what survives a crash)."""
    kind = request.param
    backend: Any
    if kind == "sqlite":
        backend = SQLiteCacheBackend(tmp_path / "ledger.db", synchronous="NORMAL")
    elif kind == "filelock":
        backend = FileLockCacheBackend(tmp_path / "ledger", fsync=False)
    elif kind == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        backend = backend_from_url(server.fresh_url(check_durability=False))
    else:
        redis_server: RedisServer = request.getfixturevalue("redis_server")
        backend = backend_from_url(redis_server.fresh_url(check_persistence=False))
    yield backend
    backend.close()


def _record(backend: CacheBackend, key: str, status: Status = Status.COMMITTED) -> Record:
    now = backend.now()
    record = Record(key, status, "fp", 1, 1, None, 1, now, now, result={"k": key})
    assert backend.insert(record) is None
    return record


def _fill(backend: CacheBackend, count: int, status: Status = Status.COMMITTED) -> list[Record]:
    return [_record(backend, f"order:{i:05d}", status) for i in range(count)]


def _approval_plan(cents: int) -> Plan:
    return Plan(
        tool="pay_invoice", fingerprint=f"fp-{cents}", approval=True,
        approval_reason="amount_cents > 50000", summary={"amount_cents": cents},
        where=Where(kickoff="k1", crew="c1", task="t1"),
    )  # fmt: skip


def _spend_plan(key: str, cap: SpendCap) -> Plan:
    return Plan(
        tool="pay", fingerprint=f"fp-{key}", amount=Money(100, "EUR"), caps=[("pay", cap)],
        where=Where(kickoff="k1", crew="c1", task="t1"),
    )  # fmt: skip


def _rows_read(backend: Any, action: Any) -> tuple[Any, int]:
    before = backend.scan_stats().rows
    result = action()
    return result, backend.scan_stats().rows - before


def test_listing_approvals_and_caps_reads_their_documents_not_the_ledger(store: Any) -> None:
    _fill(store, RECORDS)
    ledger = Ledger(store)
    for cents in (60_000, 70_000, 80_000):
        with pytest.raises(ApprovalRequired):
            plan = _approval_plan(cents)
            ledger.run(f"pay:{cents}", lambda: "paid", fingerprint=plan.fingerprint, stage=plan)
    caps = [SpendCap(10_000, "EUR", per="total"), SpendCap(5_000, "EUR", per="kickoff")]
    for i in range(3):
        plan = _spend_plan(f"spend:{i}", caps[i % 2])
        ledger.run(f"spend:{i}", lambda: "paid", fingerprint=plan.fingerprint, stage=plan)
    documents = sum(1 for _ in store.scan_prefix(DOCUMENTS))

    pending, read = _rows_read(store, lambda: Approvals(store).list("pending"))
    assert [r.summary["amount_cents"] for r in pending] == [60_000, 70_000, 80_000]
    budgets, read_caps = _rows_read(store, lambda: SpendLedger(store).budgets())
    assert len(budgets) == 2
    # The caps are read by three selects (the windows holding money, the total and crew
    # windows, those written within a day), so a window may be read by two of them.
    if isinstance(store, FileLockCacheBackend):
        # Its index of documents is a folder of markers named by digest: a listing reads
        # every document (of every kind), still none of the ledger's other records.
        assert read == documents and read_caps <= 3 * documents
    else:
        assert read == 3  # exactly the documents of the kind listed
        assert read_caps <= 3 * len(budgets)
    assert documents < 50 < RECORDS


def test_a_scan_of_a_rare_status_reads_only_that_status(store: Any) -> None:
    """What the sweeper repeats: the UNCERTAIN records, three among thousands."""
    _fill(store, RECORDS)
    for i in range(3):
        _record(store, f"timed-out:{i}", Status.UNCERTAIN)
    found, read = _rows_read(store, lambda: [r.key for r in store.scan(Status.UNCERTAIN)])
    assert sorted(found) == [f"timed-out:{i}" for i in range(3)]
    # The file lock has no index of statuses (docs/backends.md): it reads every record.
    assert read == (RECORDS + 3 if isinstance(store, FileLockCacheBackend) else 3)


def test_a_scan_reads_in_batches_and_yields_every_record(store: Any) -> None:
    _fill(store, RECORDS)
    before = store.scan_stats()
    keys = [r.key for r in store.scan()]
    after = store.scan_stats()
    assert sorted(keys) == [f"order:{i:05d}" for i in range(RECORDS)]
    assert after.rows - before.rows == RECORDS
    if not isinstance(store, FileLockCacheBackend):  # its batches are its shard folders
        assert after.batches - before.batches >= RECORDS // BATCH
    if not _redis(store):  # key order: SCAN's order is the server's hash table's
        assert keys == sorted(keys) or isinstance(store, FileLockCacheBackend)


def _redis(backend: Any) -> bool:
    return type(backend).__name__ == "RedisCacheBackend"


@pytest.mark.parametrize("status", [None, Status.COMMITTED])
def test_a_scan_yields_each_record_once_while_another_thread_rewrites_and_deletes(
    store: Any, status: Status | None
) -> None:
    """Every record is rewritten during the scan (its update time moves past every other
    record's) and one in ten is deleted: each record that stays is yielded once (Redis:
    at least once), a deleted one at most once, and each in a version it had."""
    records = {r.key: r for r in _fill(store, RECORDS)}
    doomed = set(random.Random(7).sample(sorted(records), RECORDS // 10))
    stop = threading.Event()
    progress = threading.Semaphore(0)
    errors: list[BaseException] = []

    def rewrite() -> None:
        order = sorted(records)
        random.Random(3).shuffle(order)
        try:
            while not stop.is_set():
                for key in order:
                    if stop.is_set():
                        return
                    current = records[key]
                    if key in doomed:
                        if current is not None and store.delete(current):
                            records[key] = None  # type: ignore[assignment]
                    else:
                        new = current.evolve(None, result={"k": key, "r": current.revision + 1},
                                             updated_at=store.now())  # fmt: skip
                        assert store.replace(current, new)
                        records[key] = new
                    progress.release()
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    writer = threading.Thread(target=rewrite)
    writer.start()
    seen: Counter[str] = Counter()
    try:
        for i, record in enumerate(store.scan(status)):
            seen[record.key] += 1
            assert record.result["k"] == record.key
            if i % 50 == 0:  # let the writer move records across the batches still unread
                for _ in range(40):
                    assert progress.acquire(timeout=30)
    finally:
        stop.set()
        writer.join()
    assert not errors, errors
    staying = set(records) - doomed
    assert set(seen) <= set(records)
    assert staying <= set(seen)  # none lost
    assert all(seen[key] <= 1 for key in doomed) or _redis(store)
    if not _redis(store):
        assert all(count == 1 for count in seen.values()), seen.most_common(3)


def _records_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, Record))


@pytest.mark.parametrize("count", [BATCH * 3, BATCH * 6])
def test_consuming_a_scan_holds_a_batch_of_records_whatever_the_ledger_holds(
    store: Any, count: int
) -> None:
    _fill(store, count)
    baseline = _records_alive()
    held = 0
    consumed = 0
    for i, record in enumerate(store.scan()):
        consumed += 1
        del record
        if i % (BATCH // 2) == BATCH // 4:
            held = max(held, _records_alive() - baseline)
    assert consumed == count
    assert held <= BATCH  # never the ledger: `count` is three and six batches


def test_a_scan_stopped_early_gives_its_connection_back(
    postgres_server: PostgresServer,
) -> None:
    from psycopg_pool import ConnectionPool

    from crewai_idempotent.backends.postgres import PostgresCacheBackend

    pool: ConnectionPool[Any] = ConnectionPool(
        postgres_server.url().split("?")[0], min_size=1, max_size=1,
        kwargs={"autocommit": True}, open=True,
    )  # fmt: skip
    table = postgres_server.fresh_url().split("table=")[1].split("&")[0]
    backend = PostgresCacheBackend(pool, table=table, check_durability=False)
    try:
        _fill(backend, BATCH + 10)
        pool.wait()
        scan = backend.scan()
        next(scan)  # a batch read, its rows in hand: the connection is back in the pool
        assert pool.get_stats()["pool_available"] == pool.get_stats()["pool_size"] == 1
        assert backend.get("order:00000") is not None  # max_size=1: it would wait otherwise
        scan.close()  # the caller stops: nothing to give back, nothing leaked
        assert pool.get_stats()["pool_available"] == 1
        again = backend.scan_prefix("order:")
        assert next(again).key == "order:00000"
        del again
        assert pool.get_stats()["pool_available"] == 1
    finally:
        backend.close()
        pool.close()


def test_sqlite_scans_are_ranges_of_an_index_never_a_sort(tmp_path: Path) -> None:
    """Each batch is one SEARCH of the primary key or of the status index, whose entries
    end with the key: no temporary B-tree, so a batch reads its rows and no more."""
    import sqlite3

    from crewai_idempotent.backends.sqlite import _store

    backend = SQLiteCacheBackend(tmp_path / "ledger.db")
    backend.get("k")  # the schema is made
    backend.close()
    conn = sqlite3.connect(tmp_path / "ledger.db")
    try:
        for statement in _store._SCANS.values():
            plan = " ".join(
                row[3]
                for row in conn.execute(
                    f"EXPLAIN QUERY PLAN {statement}", ["x"] * statement.count("?")
                )
            )
            assert plan.startswith("SEARCH idempotency_records USING"), plan
            assert "TEMP B-TREE" not in plan, plan
    finally:
        conn.close()


def test_approvals_written_before_the_documents_index_are_still_listed(store: Any) -> None:
    """A ledger from before its store indexed the documents (Redis's `<prefix>docs`, the
    file lock's `documents/` markers, PostgreSQL's partial index): a listing, now read
    through that index, finds the requests written then."""
    import shutil

    ledger = Ledger(store)
    for cents in (60_000, 70_000):
        with pytest.raises(ApprovalRequired):
            plan = _approval_plan(cents)
            ledger.run(f"pay:{cents}", lambda: "paid", fingerprint=plan.fingerprint, stage=plan)
    if isinstance(store, FileLockCacheBackend):
        shutil.rmtree(store.directory / "documents")
        later: Any = FileLockCacheBackend(store.directory, fsync=False)
    elif _redis(store):
        store.client.delete(f"{store.prefix}docs", f"{store.prefix}docs:complete")
        later = backend_from_url(store.url + "&check_persistence=false")
    elif isinstance(store, SQLiteCacheBackend):
        later = SQLiteCacheBackend(store.path)  # its index is the primary key: nothing to lose
    else:

        def drop(conn: Any, _resent: bool) -> None:
            (name,) = conn.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename = %s AND indexname LIKE %s",
                (store.table, "%\\_docs"),
            ).fetchone()
            conn.execute(f'DROP INDEX "{name}"')

        store._call("dropping the documents' index", drop, retry=False)
        later = backend_from_url(store.url + "&check_durability=false")
    try:
        listed = [r.summary["amount_cents"] for r in Approvals(later).list()]
        assert listed == [60_000, 70_000]
    finally:
        later.close()
