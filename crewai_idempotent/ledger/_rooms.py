"""Where the callers of one key in one process meet, and the async path's thread pools.

Callers of one key in one process meet in a `_Room`: one of them asks the store at a
time (the claim, a poll, a takeover) and publishes what it learnt; the others park until
that news, or until this process commits the key. A thousand waiters cost one poller.
`_Lanes` are the pools the async driver runs backend calls on: one for claims and reads,
one for commits, so that an owner's commit never queues behind the claims of its waiters.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from typing import Any

from .._errors import LedgerUnavailable
from . import _fork
from ._fork import LockedAcrossFork
from ._policy import Clock
from ._record import Record

_UNKNOWN: Any = object()  # a room whose members have not asked the store yet
# Waiters woken per turn of the event loop: a thousand waiters woken by one commit
# resume a batch at a time, so other work on the loop is never held up for long.
_WAKE_BATCH = 32

# Threads per lane of the async path. Claims and reads share one lane; commits, failures
# and releases get their own, so a crowd of claimants never delays an owner's commit.
# Both are small: a store serialises writes to one key anyway, and server pools are
# sized for a handful of connections per process.
IO_THREADS = 4
SETTLE_THREADS = 2


class _Room:
    """The callers of one key in one process (threads and tasks alike), and what they
    last learnt about it. Guarded by the `_Rooms` lock."""

    __slots__ = (
        "delay", "error", "event", "futures", "generation", "held", "held_at", "key",
        "latest", "members", "poller", "unanswered",
    )  # fmt: skip

    def __init__(self, key: str) -> None:
        self.key = key
        self.latest: Any = _UNKNOWN  # the newest record known here (None: absent)
        self.error: LedgerUnavailable | None = None  # the last answer was this failure
        self.generation = 0  # grows with every piece of news
        self.held = False  # a member is asking the store or writing
        self.held_at = 0
        self.members = 0
        self.poller: object | None = None  # the member that polls the store for the others
        self.delay = 0.002  # the poller's pause; doubles up to 0.2 s
        self.event: threading.Event | None = None  # parked threads
        self.futures: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
        # The UNCERTAIN record a member wrote when the reconciler did not answer it in
        # time: the members who waited meanwhile take that as their answer too.
        self.unanswered: Record | None = None


class _Rooms(LockedAcrossFork):
    """One room per key with callers waiting in this process; none when nobody waits."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._lock = threading.Lock()
        self._rooms: dict[str, _Room] = {}
        self._clock = clock
        _fork.register(self)

    def __len__(self) -> int:
        return len(self._rooms)

    def enter(self, key: str, *, hold: bool = False) -> tuple[_Room, bool]:
        """The key's room, and whether this member holds it: with `hold`, the member
        that opens a new room holds it at once."""
        with self._lock:
            room = self._rooms.get(key)
            holding = False
            if room is None:
                room = self._rooms[key] = _Room(key)
                if hold:
                    room.held, room.held_at, holding = True, room.generation, True
            room.members += 1
            return room, holding

    def leave(self, room: _Room, member: object) -> None:
        with self._lock:
            room.members -= 1
            if room.members <= 0:
                if self._rooms.get(room.key) is room:
                    del self._rooms[room.key]
            elif room.poller is member:
                room.poller = None
                self._wake(room)  # the others need a new poller

    def news(self, room: _Room) -> tuple[int, Any]:
        with self._lock:
            return room.generation, room.latest

    def hold(self, room: _Room, seen: int) -> bool:
        """Become the member that talks to the store, unless one is or news came in."""
        with self._lock:
            if room.held or room.generation != seen:
                return False
            room.held, room.held_at = True, room.generation
            return True

    def release(self, room: _Room, *, wake: bool = True) -> None:
        with self._lock:
            room.held = False
            if wake and room.generation == room.held_at:
                self._wake(room)  # nothing learnt: a parked member takes over

    def publish(self, key: str, record: Record | None, *, read: bool = False) -> None:
        """News of `key`: a record this process wrote (or read, or None: absent)."""
        if key not in self._rooms:
            # Nobody waits on the key. One who enters after this look has a new room
            # and asks the store, which already holds what this news would say.
            return
        with self._lock:
            room = self._rooms.get(key)
            if room is None:
                return
            known = room.latest
            if read and isinstance(known, Record) and record is not None:
                # A read that started before a write of ours must not hide it, and one
                # that saw nothing new is no news.
                if (known.token, known.revision) >= (record.token, record.revision):
                    return
            elif read and known is None and record is None:
                return
            room.latest, room.error = record, None
            self._wake(room)

    def publish_error(self, key: str, error: LedgerUnavailable) -> None:
        with self._lock:
            room = self._rooms.get(key)
            if room is not None:
                room.error = error
                self._wake(room)

    def park(self, room: _Room, seen: int, seconds: float) -> None:
        if seconds <= 0:
            return
        clock = self._clock
        with self._lock:
            if room.generation != seen:
                return
            event = room.event
            if event is None and clock is None:
                event = room.event = threading.Event()
        if clock is not None:
            clock.sleep(seconds)  # a clock the caller moves: no news came meanwhile
        else:
            assert event is not None
            event.wait(seconds)

    async def apark(self, room: _Room, seen: int, seconds: float) -> None:
        if seconds <= 0:
            return
        if self._clock is not None:
            self.park(room, seen, seconds)
            return
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if room.generation != seen:
                return
            room.futures.setdefault(loop, []).append(future)
        timer = loop.call_later(seconds, _resolve, future)
        try:
            await future  # cancelling this task cancels only its own future
        finally:
            timer.cancel()

    def _wake(self, room: _Room) -> None:
        room.generation += 1
        if room.event is not None:
            room.event.set()
            room.event = None
        if room.futures:
            running = asyncio._get_running_loop()
            for loop, futures in room.futures.items():
                if loop is running:
                    _resolve_batches(futures)
                else:
                    with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits
                        loop.call_soon_threadsafe(_resolve_batches, futures)
            room.futures = {}

    def _forget_in_child(self) -> None:
        # The waiters are the parent's threads and tasks; none of them exist here.
        self._rooms = {}


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _resolve_batches(futures: list[asyncio.Future[None]], start: int = 0) -> None:
    end = start + _WAKE_BATCH
    for future in futures[start:end]:
        _resolve(future)
    if end < len(futures):
        asyncio.get_running_loop().call_soon(_resolve_batches, futures, end)


class _Lanes(LockedAcrossFork):
    """The async path's thread pools, created on first use and again after fork().

    `io` carries claims and reads; `settle` carries commits, failures and releases, so
    an owner's commit never waits behind the claims of a crowd of waiters.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._io: concurrent.futures.ThreadPoolExecutor | None = None
        self._settle: concurrent.futures.ThreadPoolExecutor | None = None
        _fork.register(self)

    def io(self) -> concurrent.futures.ThreadPoolExecutor:
        return self._io or self._make("io", IO_THREADS)

    def settle(self) -> concurrent.futures.ThreadPoolExecutor:
        return self._settle or self._make("settle", SETTLE_THREADS)

    def _make(self, lane: str, threads: int) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            pool: concurrent.futures.ThreadPoolExecutor | None = getattr(self, f"_{lane}")
            if pool is None:
                pool = concurrent.futures.ThreadPoolExecutor(
                    threads, thread_name_prefix=f"crewai-idempotent-{lane}"
                )
                setattr(self, f"_{lane}", pool)
            return pool

    def close(self) -> None:
        with self._lock:
            pools, self._io, self._settle = (self._io, self._settle), None, None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=False)

    def _forget_in_child(self) -> None:
        # The pools' threads stayed in the parent; dropped, never shut down from here.
        self._io = self._settle = None
