"""Test support: the seams that show what a reader asks a store for and what it holds.

`Spy` wraps a store and keeps every `select` it is asked (the `Select` itself, and the rows
the reader took from it) and every `scan` / `scan_prefix`, so a test says which select each
command issues, that it issues no scan of the ledger, and that it takes what it shows.

`JsonStore` is a store that answers `select` the way an indexed store does: from an index
of (status, update time, key) kept beside the records, which it keeps as JSON text and
decodes one at a time as the reader takes them. A reader that streams then holds a few
`Record` objects whatever the store holds, which is what `gc` counts.

`opened_as(monkeypatch, make)`: the CLI opens its `--ledger` through `make(url)` instead,
so a command runs as typed against a store a test watches.
"""

from __future__ import annotations

import bisect
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from crewai_idempotent import CacheBackend, Order, Record, Select, Status
from crewai_idempotent.cli import _where


def records_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, Record))


class Spy(CacheBackend):
    """`inner`, with every select and scan it is asked kept in `asked`: ("select", the
    Select), ("scan", status) or ("scan_prefix", prefix). `taken[i]` counts the rows the
    reader took from the i-th select."""

    def __init__(self, inner: CacheBackend) -> None:
        self.inner = inner
        self.host_clock = inner.host_clock
        self.read_first = inner.read_first
        self.asked: list[tuple[str, Any]] = []
        self.taken: list[int] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # url, scan_stats, indexes_ready, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def selects(self) -> list[Select]:
        return [what for kind, what in self.asked if kind == "select"]

    @property
    def scans(self) -> list[tuple[str, Any]]:
        return [(kind, what) for kind, what in self.asked if kind != "select"]

    def forget(self) -> None:
        with self._lock:
            self.asked.clear()
            self.taken.clear()

    def now(self) -> float:
        return self.inner.now()

    def now_blocks(self) -> bool:
        return self.inner.now_blocks()

    def insert(self, record: Record) -> Record | None:
        return self.inner.insert(record)

    def replace(self, current: Record, new: Record) -> bool:
        return self.inner.replace(current, new)

    def get(self, key: str) -> Record | None:
        return self.inner.get(key)

    def delete(self, current: Record) -> bool:
        return self.inner.delete(current)

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        with self._lock:
            self.asked.append(("scan", status))
        return self.inner.scan(status)

    def scan_prefix(self, prefix: str) -> Iterator[Record]:
        with self._lock:
            self.asked.append(("scan_prefix", prefix))
        return self.inner.scan_prefix(prefix)

    def select(self, query: Select) -> Iterator[Record]:
        with self._lock:
            self.asked.append(("select", query))
            self.taken.append(0)
            slot = len(self.taken) - 1
        for record in self.inner.select(query):
            self.taken[slot] += 1
            yield record

    def changes(self) -> object | None:
        return self.inner.changes()

    def close(self) -> None:
        self.inner.close()


#: Rows `JsonStore` reads per batch of a select.
BATCH = 50


class JsonStore(CacheBackend):
    """Records kept as JSON text, with an index of (updated_at, key) kept sorted and each
    key's status beside it: `select` walks the index in the query's order a batch at a
    time and decodes a record only to test and yield it, as an indexed store reads rows."""

    def __init__(self) -> None:
        self._docs: dict[str, str] = {}
        self._status: dict[str, tuple[Status, float]] = {}
        self._by_time: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self.url = "memory://json"

    def _index(self, record: Record | None, key: str) -> None:
        held = self._status.pop(key, None)
        if held is not None:
            self._by_time.remove((held[1], key))
            del self._docs[key]
        if record is not None:
            self._docs[key] = record.to_json()
            self._status[key] = (record.status, record.updated_at)
            bisect.insort(self._by_time, (record.updated_at, key))

    def insert(self, record: Record) -> Record | None:
        with self._lock:
            if record.key in self._docs:
                return Record.from_json(self._docs[record.key])
            self._index(record, record.key)
            return None

    def replace(self, current: Record, new: Record) -> bool:
        with self._lock:
            held = self.get(current.key)
            if held is None or (held.token, held.revision) != (current.token, current.revision):
                return False
            self._index(new, new.key)
            return True

    def get(self, key: str) -> Record | None:
        text = self._docs.get(key)
        return None if text is None else Record.from_json(text)

    def delete(self, current: Record) -> bool:
        with self._lock:
            held = self.get(current.key)
            if held is None or held.revision != current.revision:
                return False
            self._index(None, current.key)
            return True

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        for key in sorted(self._docs):
            record = self.get(key)
            if record is not None and (status is None or record.status is status):
                yield record

    def select(self, query: Select) -> Iterator[Record]:
        """Batches of `BATCH` rows, each read from the index after the position the last
        one ended at, as the stores page: a record written meanwhile moves in the order
        and may be met again (or not at all) as the stores' streams promise."""
        after = query.after
        sent = 0
        while True:
            with self._lock:
                batch = self._batch(query, after)
            if not batch:
                return
            for position, text in batch:
                after = position
                record = Record.from_json(text)
                if not query.matches(record):
                    continue
                yield record
                sent += 1
                if query.limit is not None and sent >= query.limit:
                    return

    def _batch(self, query: Select, after: Any) -> list[tuple[Any, str]]:
        if query.order is Order.KEY:
            keys = sorted(self._status)
            start = 0 if after is None else bisect.bisect_right(keys, after)
            found = ((key, key) for key in keys[start:])
        elif query.order is Order.OLDEST:
            start = 0 if after is None else bisect.bisect_right(self._by_time, tuple(after))
            found = ((entry, entry[1]) for entry in self._by_time[start:])
        else:
            end = (
                len(self._by_time)
                if after is None
                else bisect.bisect_left(self._by_time, tuple(after))
            )
            found = ((entry, entry[1]) for entry in reversed(self._by_time[:end]))
        batch = []
        for position, key in found:
            if query.status is None or self._status[key][0] is query.status:
                batch.append((position, self._docs[key]))
                if len(batch) == BATCH:
                    break
        return batch


def opened_as(monkeypatch: pytest.MonkeyPatch, make: Callable[[str], CacheBackend]) -> None:
    """The CLI opens every `--ledger URL` as `make(url)`."""
    monkeypatch.setattr(_where, "backend_from_url", make)
