"""Every store answers a `Select` as `Select.apply` says, and from an index: a listing
reads what it finds, not what the ledger holds.

The meaning is checked against `Select.apply` over the records written, on every store,
for random selects and pages. The cost is checked through each store's `scan_stats()`
(the rows its reads took from the store): a few matching records among thousands that do
not match are found by reading about as many rows as they are, never the thousands. The
file lock reads its folder (docs/backends.md says how it grows), so only its answers are
held to the meaning. Never the wall clock.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import (
    CacheBackend,
    FileLockCacheBackend,
    Order,
    Record,
    Select,
    SQLiteCacheBackend,
    Status,
    backend_from_url,
)
from crewai_idempotent.ledger._backend import DOCUMENTS
from crewai_idempotent.ledger._results import encode
from tests.support.servers import PostgresServer, RedisServer

INDEXED = ["sqlite", "postgres", "redis"]
STORES = [*INDEXED, "filelock", "memory"]
T0 = 1_700_000_000.0
APPROVALS = DOCUMENTS + "approval/"


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A store of each kind, filled quickly (no sync per write: what is counted here is
    what a read takes, not what survives a crash)."""
    kind = request.param
    backend: Any
    if kind == "sqlite":
        backend = SQLiteCacheBackend(tmp_path / "ledger.db", synchronous="NORMAL")
    elif kind == "filelock":
        backend = FileLockCacheBackend(tmp_path / "ledger", fsync=False)
    elif kind == "memory":
        backend = backend_from_url("memory://")
    elif kind == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        backend = backend_from_url(server.fresh_url(check_durability=False))
    else:
        redis_server: RedisServer = request.getfixturevalue("redis_server")
        backend = backend_from_url(redis_server.fresh_url(check_persistence=False))
    backend.kind = kind
    yield backend
    backend.close()


def _put(
    backend: CacheBackend,
    key: str,
    status: Status = Status.COMMITTED,
    *,
    at: float = T0,
    expires_at: float | None = None,
    needs_operator: bool = False,
    document: dict[str, Any] | None = None,
) -> Record:
    result = encode(document) if document is not None else {"t": "json", "v": {"key": key}}
    fingerprint = "crewai-idempotent-document" if document is not None else "fp"
    record = Record(
        key, status, fingerprint, 1, 1, None, 1, at, at, expires_at=expires_at, result=result,
        needs_operator=needs_operator,
    )  # fmt: skip
    assert backend.insert(record) is None
    return record


def _rows(backend: Any) -> int:
    stats = getattr(backend, "scan_stats", None)
    return stats().rows if stats is not None else 0


def _keys(records: Any) -> list[str]:
    return [r.key for r in records]


def _random_ledger(backend: CacheBackend, rng: random.Random, count: int) -> list[Record]:
    written = []
    for i in range(count):
        kind = rng.random()
        at = T0 + rng.choice([0, 1, 2, 3]) * 60 + rng.random()  # ties of minutes, not floats
        if kind < 0.15:
            state = rng.choice(["PENDING", "APPROVED", "DENIED", "USED"])
            subject = f"pay:{rng.randrange(5)}"
            document = {"id": f"r{i}", "state": state, "key": subject, "summary": {"state": "X"}}
            written.append(_put(backend, f"{APPROVALS}{i:04d}", at=at, document=document))
            continue
        status = rng.choice(list(Status))
        prefix = rng.choice(["pay:", "mail:", "pay:eu:", "ship:"])
        expires = rng.choice([None, T0 + 100, T0 + 1000]) if status is Status.COMMITTED else None
        flagged = rng.random() < 0.1
        written.append(
            _put(
                backend,
                f"{prefix}{i:04d}",
                status,
                at=at,
                expires_at=expires,
                needs_operator=flagged,
            )
        )
    return written


def _random_select(rng: random.Random) -> Select:
    fields: dict[str, Any] = {"order": rng.choice(list(Order))}
    if rng.random() < 0.3:
        fields["prefix"] = APPROVALS
        if rng.random() < 0.6:
            fields["state"] = rng.choice(["PENDING", "APPROVED", "DENIED", "USED"])
        if rng.random() < 0.4:
            fields["subject"] = f"pay:{rng.randrange(5)}"
    else:
        if rng.random() < 0.4:
            fields["status"] = rng.choice(list(Status))
        if rng.random() < 0.3:
            fields["prefix"] = rng.choice(["pay:", "pay:eu:", "mail:", "nothing:"])
        if rng.random() < 0.2:
            fields["needs_operator"] = True
        if rng.random() < 0.2:
            fields["expired_by"] = rng.choice([T0 + 50, T0 + 500, T0 + 5000])
    if rng.random() < 0.3:
        fields["updated_from"] = T0 + rng.choice([0, 60, 120])
    if rng.random() < 0.3:
        fields["updated_before"] = T0 + rng.choice([60, 180, 240])
    if rng.random() < 0.5:
        fields["limit"] = rng.choice([1, 3, 7, 50])
    return Select(**fields)


def test_every_store_answers_a_select_as_apply_says_with_pages_that_add_up(store: Any) -> None:
    rng = random.Random(30)
    written = _random_ledger(store, rng, 300)
    for _ in range(120):
        query = _random_select(rng)
        expected = _keys(query.apply(written))
        assert _keys(store.select(query)) == expected, query
        # Page by page with the cursor: the pages add up to the unpaged answer.
        whole = Select(**{**_fields(query), "limit": None})
        everything = _keys(whole.apply(written))
        page_query = Select(**{**_fields(query), "limit": 4, "after": None})
        seen: list[str] = []
        while True:
            page = list(store.select(page_query))
            seen += _keys(page)
            if len(page) < 4:
                break
            page_query = page_query.page_after(page[-1])
        assert seen == everything, query


def _fields(query: Select) -> dict[str, Any]:
    return {name: getattr(query, name) for name in Select.__dataclass_fields__}


def test_a_select_sees_writes_made_after_the_store_was_filled(store: Any) -> None:
    """The indexes follow every write: a status change, the flag set, a document's state
    moving, a record deleted."""
    record = _put(store, "pay:1", Status.PENDING)
    doc = _put(store, APPROVALS + "r1", at=T0, document={"state": "PENDING", "key": "pay:1"})
    flagged = record.evolve(None, status=Status.UNCERTAIN, needs_operator=True, updated_at=T0 + 5)
    assert store.replace(record, flagged)
    assert _keys(store.select(Select(needs_operator=True))) == ["pay:1"]
    assert _keys(store.select(Select(status=Status.PENDING))) == []
    assert _keys(store.select(Select(status=Status.UNCERTAIN, order=Order.NEWEST))) == ["pay:1"]
    settled = flagged.evolve(None, status=Status.COMMITTED, expires_at=T0 + 10, updated_at=T0 + 6)
    assert store.replace(flagged, settled)
    assert _keys(store.select(Select(expired_by=T0 + 10))) == ["pay:1"]
    assert _keys(store.select(Select(expired_by=T0 + 9))) == []
    approved = doc.evolve(None, result=encode({"state": "APPROVED", "key": "pay:1"}))
    assert store.replace(doc, approved)
    pending = Select(prefix=APPROVALS, state="PENDING")
    assert _keys(store.select(pending)) == []
    assert _keys(store.select(Select(prefix=APPROVALS, state="APPROVED", subject="pay:1"))) == [
        APPROVALS + "r1"
    ]
    assert store.delete(settled)
    assert _keys(store.select(Select(needs_operator=True))) == []


@pytest.mark.parametrize(
    "query",
    [
        Select(status=Status.UNCERTAIN),
        Select(status=Status.UNCERTAIN, order=Order.OLDEST),
        Select(needs_operator=True),
        Select(expired_by=T0 + 10, limit=100),
        Select(prefix="mail:"),
        Select(prefix=APPROVALS, state="PENDING", order=Order.NEWEST),
        Select(prefix=APPROVALS, subject="pay:7"),
        Select(updated_from=T0 + 3600, order=Order.NEWEST),
        Select(order=Order.NEWEST, limit=10),
        Select(order=Order.OLDEST, limit=10, after=(T0, "pay:00010")),
        Select(status=Status.COMMITTED, updated_before=T0 - 10),
    ],
    ids=lambda q: ",".join(f"{k}={v}" for k, v in _fields(q).items() if v not in (None, "", False)),
)
def test_a_select_reads_what_it_finds_not_what_the_ledger_holds(store: Any, query: Select) -> None:
    """3,000 records that do not match, a dozen that do: the store reads a few rows per
    record found (an index by status, flag, expiry, prefix, document state and time), not
    the 3,000."""
    if store.kind not in INDEXED:
        pytest.skip("the file lock and memory stores read their whole folder or dict")
    for i in range(3000):  # the bulk: committed long ago, no expiry, nothing flagged
        _put(store, f"pay:{i:05d}", at=T0 + (i % 50) * 0.01)
    for i in range(12):  # what the selects look for
        _put(store, f"unc:{i}", Status.UNCERTAIN, at=T0 + 1000 + i, needs_operator=i % 2 == 0)
        _put(store, f"mail:{i}", at=T0 + 5000 + i, expires_at=T0 + 5)
        _put(store, APPROVALS + f"r{i}", at=T0 + 7200 + i,
             document={"state": "PENDING" if i % 3 else "USED", "key": f"pay:{i}"})  # fmt: skip
        _put(store, f"old:{i}", at=T0 - 100 - i)
    before = _rows(store)
    found = list(store.select(query))
    read = _rows(store) - before
    assert found, "the select found nothing: it is meant to find a few"
    # A few rows per record found (an index may give a few it cannot tell apart, and an
    # order over every status may look at each status's next few), never the bulk.
    assert read <= 4 * len(found) + 20, (query, len(found), read)


def test_changes_moves_with_every_write_of_any_writer_and_only_then(store: Any) -> None:
    mark = store.changes()
    if mark is None:
        assert store.kind in ("filelock",), "an indexed store says when it changed"
        pytest.skip("this store cannot tell")
    assert store.changes() == mark  # nothing written: the same mark
    # Another writer (another backend object on the same ledger, as another process has).
    other = _reopen(store)
    try:
        record = _put(other, "pay:1", Status.PENDING)
        moved = store.changes()
        assert moved != mark
        assert store.changes() == moved
        assert other.replace(record, record.evolve(None, status=Status.COMMITTED))
        assert store.changes() != moved
        latest = store.changes()
        assert other.delete(other.get("pay:1"))
        assert store.changes() != latest
    finally:
        if other is not store:
            other.close()


def _reopen(store: Any) -> Any:
    if store.kind == "memory":
        return store
    if store.kind == "sqlite":
        return SQLiteCacheBackend(store.path, synchronous="NORMAL")
    return backend_from_url(store.url)
