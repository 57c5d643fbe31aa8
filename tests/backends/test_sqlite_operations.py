"""Every operation of the SQLite store checks, before it runs, that the ledger file is
still the one opened and this is the process its connections belong to.

The three every call takes (peek, insert, replace) spell the gate, the checks and their
statement out in one frame each for speed, apart from the others; so each operation is
tested here on its own, in both connection slots (CLAIMS puts claims and takeovers on a
connection of their own). A check missing from one of them would let that operation
write into a deleted file, or into the one another file replaced, and succeed: the
tests below would then fail on the missing refusal.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import Ledger, LedgerUnavailable, SQLiteCacheBackend, Status
from crewai_idempotent.ledger._record import Record

Operation = Callable[[SQLiteCacheBackend, Record], Any]

OPERATIONS: dict[str, Operation] = {
    "peek": lambda b, r: b.peek(r.key),
    "get": lambda b, r: b.get(r.key),
    "insert": lambda b, r: b.insert(dataclasses.replace(r, key="fresh")),
    "replace": lambda b, r: b.replace(r, dataclasses.replace(r, revision=r.revision + 1)),
    "takeover": lambda b, r: b.replace(
        r,
        dataclasses.replace(r, status=Status.PENDING, token=r.token + 1, revision=r.revision + 1),
    ),
    "scan": lambda b, r: list(b.scan()),
    "delete": lambda b, r: b.delete(r),
}


def _open_with_a_record(path: Path, mode: str) -> tuple[SQLiteCacheBackend, Record]:
    backend = SQLiteCacheBackend(path, synchronous=mode)
    Ledger(backend).run("paid", lambda: "ch_original")
    record = backend.get("paid")
    assert record is not None and record.status is Status.COMMITTED
    # Every slot this thread uses has its connection open before the file goes.
    for operation in ("peek", "insert", "takeover"):
        OPERATIONS[operation](backend, record)
    backend.delete(backend.get("fresh") or record)
    record = backend.get("paid")
    assert record is not None
    return backend, record


@pytest.mark.parametrize("mode", ["FULL", "CLAIMS"])
@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_every_operation_refuses_a_deleted_ledger(
    tmp_path: Path, mode: str, operation: str
) -> None:
    path = tmp_path / "ledger.db"
    backend, record = _open_with_a_record(path, mode)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    with pytest.raises(LedgerUnavailable, match="was deleted"):
        OPERATIONS[operation](backend, record)
    assert not path.exists()  # not recreated, not even empty
    backend.close()


@pytest.mark.parametrize("mode", ["FULL", "CLAIMS"])
@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_every_operation_refuses_a_replaced_ledger(
    tmp_path: Path, mode: str, operation: str
) -> None:
    path = tmp_path / "ledger.db"
    backend, record = _open_with_a_record(path, mode)
    SQLiteCacheBackend(tmp_path / "empty.db").close()
    os.replace(tmp_path / "empty.db", path)
    with pytest.raises(LedgerUnavailable, match="was replaced"):
        OPERATIONS[operation](backend, record)
    backend.close()
    replacement = SQLiteCacheBackend(path)
    assert list(replacement.scan()) == []  # nothing reached the file now at the path
    replacement.close()
