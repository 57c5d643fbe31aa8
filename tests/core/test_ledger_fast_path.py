"""The replay fast path: a committed key is replayed from a read, without the write lock,
and the full record is built only when someone asks for it."""

from __future__ import annotations

import asyncio
import fcntl
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import (
    FileLockCacheBackend,
    IdempotencyKeyConflict,
    InMemoryCacheBackend,
    Ledger,
    LedgerUnavailable,
    SQLiteCacheBackend,
)
from crewai_idempotent.ledger._record import Peek


def test_sqlite_replay_does_not_wait_for_the_write_lock(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger(SQLiteCacheBackend(path, busy_timeout_s=0.3))
    assert ledger.run("charge", lambda: "ch_1") == "ch_1"
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        ran: list[str] = []
        assert ledger.run("charge", lambda: ran.append("x") or "ch_2") == "ch_1"
        assert ran == []
        # A fresh key needs the write lock: it fails closed, the body does not run.
        with pytest.raises(LedgerUnavailable, match="locked"):
            ledger.run("fresh", lambda: ran.append("y") or "ch_3")
        assert ran == []
    finally:
        writer.execute("ROLLBACK")
        writer.close()
        ledger.close()


def test_file_lock_replay_does_not_wait_for_the_key_lock(tmp_path: Path) -> None:
    backend = FileLockCacheBackend(tmp_path / "ledger", lock_timeout_s=0.3)
    ledger = Ledger(backend)
    assert ledger.run("charge", lambda: "ch_1") == "ch_1"
    lock_path = backend._names("charge")[1]
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a writer of this key is busy
        ran: list[str] = []
        assert ledger.run("charge", lambda: ran.append("x") or "ch_2") == "ch_1"
        assert ran == []
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["memory", "sqlite", "filelock"])
def test_replayed_record_is_built_on_demand_and_equals_the_stored_one(
    kind: str, tmp_path: Path
) -> None:
    backend = {
        "memory": lambda: InMemoryCacheBackend(),
        "sqlite": lambda: SQLiteCacheBackend(tmp_path / "l.db"),
        "filelock": lambda: FileLockCacheBackend(tmp_path / "l"),
    }[kind]()
    ledger = Ledger(backend)
    first = ledger.execute("k", lambda: {"id": 7}, fingerprint="fp")
    again = ledger.execute("k", lambda: {"id": 8}, fingerprint="fp")
    assert (again.value, again.replayed) == ({"id": 7}, True)
    assert type(again._record) is Peek  # nothing but the result decoded so far
    assert again.record == ledger.get("k") == first.record
    assert [e.kind for e in again.record.history] == ["claim", "commit"]
    with pytest.raises(IdempotencyKeyConflict):  # the slow path still judges the rest
        ledger.execute("k", lambda: {"id": 9}, fingerprint="other")


def test_listeners_see_the_full_record_of_a_fast_replay(tmp_path: Path) -> None:
    seen: list[tuple[str, int]] = []
    ledger = Ledger(
        SQLiteCacheBackend(tmp_path / "l.db"),
        listener=lambda kind, record: seen.append((kind, len(record.history))),
    )
    ledger.run("k", lambda: 1)
    ledger.run("k", lambda: 2)
    assert seen == [("claim", 1), ("commit", 2), ("replay", 2)]


def test_a_corrupt_row_fails_closed_on_the_fast_path(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    ledger = Ledger(SQLiteCacheBackend(path))
    ledger.run("k", lambda: 1)
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute('UPDATE idempotency_records SET doc = \'{"status": "COMMITTED"}\'')
    raw.close()
    ran: list[int] = []
    with pytest.raises(LedgerUnavailable, match="corrupt"):
        ledger.run("k", lambda: ran.append(1) or 2)
    assert ran == []
    ledger.close()


class _CountingStore(InMemoryCacheBackend):
    """Counts the reads a call makes; `broken` makes every peek raise what a driver or a
    store library might (not one of the ledger's own errors)."""

    def __init__(self) -> None:
        super().__init__()
        self.peeks = self.gets = 0
        self.broken = False

    def peek(self, key: str) -> Peek | None:
        self.peeks += 1
        if self.broken:
            raise OSError("disk went away")
        return super().peek(key)

    def get(self, key: str) -> Any:
        self.gets += 1
        return super().get(key)


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_failing_peek_fails_closed_and_the_body_does_not_run(driver: str) -> None:
    store = _CountingStore()
    ledger = Ledger(store)
    store.broken = True
    ran: list[int] = []

    async def body() -> int:
        ran.append(1)
        return 1

    with pytest.raises(LedgerUnavailable, match="disk went away") as caught:
        if driver == "sync":
            ledger.run("k", lambda: ran.append(1) or 1)
        else:
            asyncio.run(ledger.arun("k", body))
    assert isinstance(caught.value.__cause__, OSError)
    assert ran == []
    assert store.get("k") is None  # nothing claimed


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_one_read_decides_a_fresh_key_a_replay_and_a_takeover(driver: str) -> None:
    store = _CountingStore()
    ledger = Ledger(store)
    ran: list[str] = []

    def call(value: str, fail: bool = False) -> Any:
        def sync_body() -> str:
            ran.append(value)
            if fail:
                raise RuntimeError("declined")
            return value

        async def async_body() -> str:
            return sync_body()

        if driver == "sync":
            return ledger.execute("k", sync_body, fingerprint="fp")
        return asyncio.run(ledger.aexecute("k", async_body, fingerprint="fp"))

    with pytest.raises(RuntimeError):
        call("first", fail=True)  # fresh: peeked absent, claimed, recorded FAILED
    taken = call("second")  # FAILED: the peeked record is taken over, no second read
    replay = call("third")  # COMMITTED: replayed from the peek
    assert ran == ["first", "second"]
    assert (taken.value, taken.replayed) == ("second", False)
    assert (replay.value, replay.replayed) == ("second", True)
    assert [e.kind for e in replay.record.history] == ["claim", "fail", "takeover", "commit"]
    assert (store.peeks, store.gets) == (3, 0)
