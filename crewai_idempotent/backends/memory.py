"""A ledger in a dict. For tests only: it is not durable and not shared between processes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Self
from urllib.parse import urlsplit

from .._errors import LedgerConfigurationError
from ..ledger._backend import CacheBackend
from ..ledger._hostclock import this_host
from ..ledger._record import Peek, Record, Status
from ._options import local_options


class InMemoryCacheBackend(CacheBackend):
    """Not durable: every record is lost when the process ends. Use it in tests only.
    Raises nothing."""

    read_first = True

    def __init__(self) -> None:
        self._records: dict[str, Record] = {}
        self._lock = threading.Lock()
        self._writes = 0  # every write that changed the dict: what `changes()` returns
        self.host_clock = this_host()  # one process: the host's clock, as SQLite

    @classmethod
    def from_url(cls, url: str) -> Self:
        """`memory://`, which takes no name, path or option: any other `url` is a
        `LedgerConfigurationError`."""
        local_options(url, {}, "memory")
        parts = urlsplit(url)
        if parts.netloc or parts.path.strip("/"):
            raise LedgerConfigurationError(f"{url!r}: memory:// takes no name or path")
        return cls()

    def insert(self, record: Record) -> Record | None:
        with self._lock:
            held = self._records.get(record.key)
            if held is None:
                self._records[record.key] = record
                self._writes += 1
            return held

    def replace(self, current: Record, new: Record) -> bool:
        with self._lock:
            held = self._records.get(current.key)
            if held is None or (held.token, held.revision) != (current.token, current.revision):
                return False
            self._records[current.key] = new
            self._writes += 1
            return True

    def get(self, key: str) -> Record | None:
        return self._records.get(key)

    def peek(self, key: str) -> Peek | None:
        record = self._records.get(key)
        return None if record is None else Peek.of(record)

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        with self._lock:
            found = [r for r in self._records.values() if status is None or r.status is status]
        # A snapshot of references (the records are in memory already), in key order.
        return iter(sorted(found, key=lambda r: r.key))

    def scan_prefix(self, prefix: str) -> Iterator[Record]:
        with self._lock:
            found = [r for key, r in self._records.items() if key.startswith(prefix)]
        return iter(sorted(found, key=lambda r: r.key))

    def delete(self, current: Record) -> bool:
        with self._lock:
            held = self._records.get(current.key)
            if held is None or held.revision != current.revision:
                return False
            del self._records[current.key]
            self._writes += 1
            return True

    def changes(self) -> int:
        """How many writes this store has taken: it moves with every write (one process
        holds the dict, so every writer is in it) and with nothing else. Raises nothing."""
        return self._writes

    def __repr__(self) -> str:
        return "InMemoryCacheBackend()"

    @property
    def url(self) -> str:
        """memory:// (this process's own, which no other process can open)."""
        return "memory://"
