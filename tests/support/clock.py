"""A clock the test moves, so that a lease lapses, a renewal falls due or a wait times out
at once.

`ManualClock` is the real clock plus an offset the test advances (time keeps flowing, so
nothing that waits on real events hangs). Give it to a ledger as `clock=` (its waits and
pauses advance the offset instead of sleeping, and its lease keeper's schedule runs on it)
and wrap the store in `ClockedBackend`, whose clocks (what leases and TTLs are judged by:
`now()` and, for an embedded store, the host's clock) are the store's own plus the same
offset. `FakeHostClock` is a host clock whose readings a test sets; `FrozenClock` one on which no
time passes at all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from crewai_idempotent import CacheBackend, Record, Status
from crewai_idempotent.ledger._hostclock import HostClock
from crewai_idempotent.ledger._record import Peek


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

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Until `event` is set or `seconds` pass on this clock; an `advance` past the
        deadline ends the wait within a few milliseconds."""
        deadline = self.monotonic() + seconds
        while True:
            left = deadline - self.monotonic()
            if left <= 0:
                return event.is_set()
            if event.wait(min(left, 0.005)):
                return True


class FrozenClock:
    """A clock on which no time passes but what the ledger's own pauses add: a ledger given
    it never finds a lease renewal due (an owner frozen mid-body, as far as its lease
    goes), and its lease keeper waits for news instead of for a deadline."""

    def __init__(self) -> None:
        self._now = time.monotonic()
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        return self._now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self._now += max(seconds, 0.0)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        event.wait()  # no deadline on this clock ever passes by itself
        return True


class FakeHostClock(HostClock):
    """A host clock reading `read()` for both clocks, on the boot and host name given."""

    __slots__ = ("_read",)

    def __init__(self, read: Callable[[], float], boot: str = "test-boot", name: str = "") -> None:
        super().__init__(
            boot, name or _real_name(), running_id=time.CLOCK_MONOTONIC,
            elapsed_id=time.CLOCK_BOOTTIME,
        )  # fmt: skip
        self._read = read

    def running(self) -> float:
        return self._read()

    def elapsed(self) -> float:
        return self._read()


def _real_name() -> str:
    import socket

    return socket.gethostname()


def moved(host: HostClock | None, clock: ManualClock) -> HostClock | None:
    """`host`'s clocks moved by `clock`'s offset (same boot, same name)."""
    if host is None:
        return None
    return _MovedHostClock(host, clock)


class _MovedHostClock(HostClock):
    __slots__ = ("_base", "_clock")

    def __init__(self, base: HostClock, clock: ManualClock) -> None:
        super().__init__(
            base.boot, base.name, running_id=time.CLOCK_MONOTONIC, elapsed_id=time.CLOCK_BOOTTIME
        )
        self._base, self._clock = base, clock

    def running(self) -> float:
        return self._base.running() + self._clock.offset

    def elapsed(self) -> float:
        return self._base.elapsed() + self._clock.offset


class ClockedBackend(CacheBackend):
    """`backend`, with its clocks moved by `clock`: `now()` and, unless `host=False` (a
    wall-clock step, which no host clock sees), its host clock."""

    def __init__(self, backend: CacheBackend, clock: ManualClock, *, host: bool = True) -> None:
        self.backend, self.clock = backend, clock
        self.read_first = backend.read_first
        self.host_clock = moved(backend.host_clock, clock) if host else backend.host_clock

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
