"""`delete_many`, what a purge deletes with, on every store: each record is deleted only if
it is still as read, as `delete` does one at a time, and the answer says which were."""

from __future__ import annotations

from dataclasses import replace

import pytest

from crewai_idempotent import CacheBackend, Ledger, Select, Status
from tests.backends.test_select import T0, _put, store  # noqa: F401 - the store fixture


def test_only_the_records_still_as_read_are_deleted(store: CacheBackend) -> None:  # noqa: F811
    read = [_put(store, f"r{i}", at=T0 + i, expires_at=T0 + 10) for i in range(6)]
    moved = replace(read[1], revision=read[1].revision + 1, updated_at=T0 + 50)
    assert store.replace(read[1], moved)
    assert store.delete(read[2])
    assert store.delete_many([]) == []
    assert store.delete_many(read) == [True, False, False, True, True, True]
    assert [r.key for r in store.scan()] == ["r1"]
    assert [r.key for r in store.select(Select(expired_by=T0 + 100))] == ["r1"]
    assert store.get("r1") == moved


@pytest.mark.parametrize("count", [0, 1, 250])
def test_a_purge_deletes_every_expired_receipt_in_batches_and_nothing_else(
    store: CacheBackend,  # noqa: F811
    count: int,
) -> None:
    now = store.now()
    for i in range(count):
        _put(store, f"old{i:04}", at=now - 100, expires_at=now - 10)
    _put(store, "fresh", at=now, expires_at=now + 3600)
    _put(store, "held", Status.UNCERTAIN, at=now - 100, expires_at=now - 10)
    assert Ledger(store).purge() == count
    assert sorted(r.key for r in store.scan()) == ["fresh", "held"]
