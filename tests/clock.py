"""A clock the test moves, so that a lease lapses or a wait times out at once.

`ManualClock` is the real clock plus an offset the test advances (time keeps flowing, so
nothing that waits on real events hangs). Give it to a ledger as `clock=` (its waits and
pauses advance the offset instead of sleeping) and wrap the store in `ClockedBackend`, whose
`now()` (what leases and TTLs are judged by) is the store's own clock plus the same offset.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from crewai_idempotent import CacheBackend, Record, Status
from crewai_idempotent._record import Peek


class ManualClock:
    def __init__(self) -> None:
        self.offset = 0.0
        self._lock = threading.Lock()

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.offset += seconds

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def sleep(self, seconds: float) -> None:
        self.advance(max(seconds, 0.0))


class ClockedBackend(CacheBackend):
    """`backend`, with its clock moved by `clock`."""

    def __init__(self, backend: CacheBackend, clock: ManualClock) -> None:
        self.backend, self.clock = backend, clock
        self.read_first = backend.read_first

    def __repr__(self) -> str:
        return f"ClockedBackend({self.backend!r})"

    def now(self) -> float:
        return self.backend.now() + self.clock.offset

    def now_blocks(self) -> bool:
        return self.backend.now_blocks()

    def insert(self, record: Record) -> Record | None:
        return self.backend.insert(record)

    def replace(self, current: Record, new: Record) -> bool:
        return self.backend.replace(current, new)

    def get(self, key: str) -> Record | None:
        return self.backend.get(key)

    def peek(self, key: str) -> Peek | None:
        return self.backend.peek(key)

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        return self.backend.scan(status)

    def delete(self, current: Record) -> bool:
        return self.backend.delete(current)

    def close(self) -> None:
        self.backend.close()
