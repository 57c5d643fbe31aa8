"""Group commit: the synced writes of concurrent threads share one fsync.

In a synced mode every SQLite write transaction ends with an fsync of the WAL, and SQLite
runs one writer at a time: N threads of one backend writing at once pay N fsyncs in a
row. Here, a thread whose synced write finds another one being committed queues it; when
that commit returns, the first queued thread becomes the leader, takes every write queued
by then, and runs them in one write transaction (BEGIN IMMEDIATE, each statement, COMMIT)
on its own connection. Each member gets its own statement's answer, and only after the
COMMIT (the fsync) returned: a claim's body can still start only once the claim is
durable. A thread that finds nobody committing runs its statement alone, as one
autocommit statement, exactly as without grouping.

No background thread: the leader is always a caller, so fork() finds nothing here that a
child must stop (a child gets a fresh `Group`; the backend's fork gate already waits for
every member before it lets a fork through). Threads of one process only: processes have
their own backend objects, and SQLite has no way to share a transaction between them.
"""

from __future__ import annotations

import contextlib
import copy
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

from ..._errors import LedgerUnavailable

# What SQLite or the file system raise for a write; anything else is a bug or an interrupt.
_WRITE_ERRORS = (sqlite3.Error, OSError)

Write = Callable[..., Any]  # write(connection, *args): one item's statements, its answer

# A batch whose members have waited this much longer than a write's own wait for the lock
# could take (the commit before it was stuck on the lock) gets only the time they have left.
_SLACK_S = 0.25


class _Member:
    """One thread's write waiting for (or taken into) a batch."""

    __slots__ = ("args", "deadline", "done", "error", "lead", "result", "wake", "write")

    def __init__(self, write: Write, args: tuple[Any, ...], deadline: float) -> None:
        self.write = write
        self.args = args
        self.deadline = deadline  # when its caller's busy timeout, counted from arrival, ends
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False  # answered: result or error is final
        self.lead = False  # chosen to commit the next batch
        self.wake = threading.Lock()  # held until the member is answered or chosen to lead
        self.wake.acquire()

    def answer(self) -> Any:
        if self.error is not None:
            raise self.error
        if not self.done:  # never reported done without a COMMIT that returned
            raise _unknown()
        return self.result


class Group:
    """The synced writes of one backend's threads, committed a batch at a time."""

    __slots__ = ("_busy", "_lock", "_queue", "_timeout_s")

    def __init__(self, busy_timeout_s: float) -> None:
        # A write waits for SQLite's lock up to this long; a queued one, counted from when it
        # arrived, no longer (the fork gate and close() wait that plus a second).
        self._timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        self._busy = False  # a write (alone or a batch) is being committed
        self._queue: list[_Member] = []  # waiting for the next batch, in arrival order

    def state(self) -> tuple[bool, int]:
        """Whether a write (alone or a batch) is being committed, and how many wait for
        the next batch."""
        with self._lock:
            return self._busy, len(self._queue)

    def run(self, conn: sqlite3.Connection, write: Write, *args: Any) -> Any:
        """`write(conn, *args)`, committed and synced when this returns: alone if no other
        synced write is being committed, else in the next batch. Raises what the write
        raised (a SQLite or OS error), a copy of a failure the whole batch shared (BEGIN or
        COMMIT), or a LedgerUnavailable if the leader was interrupted."""
        with self._lock:
            if not self._busy:
                self._busy = True
                member = None
            else:
                member = _Member(write, args, time.monotonic() + self._timeout_s)
                self._queue.append(member)
        if member is None:
            try:
                if conn.in_transaction:
                    _clean(conn)
                return write(conn, *args)
            finally:
                self._hand_off()
        batch: list[_Member] | None = None
        try:
            member.wake.acquire()
            if member.lead:
                with self._lock:
                    batch, self._queue = self._queue, []
                _commit(conn, batch, self._timeout_s)
            return member.answer()
        except BaseException:
            if batch is None:  # interrupted (a signal) before it took a batch, if any
                self._abandon(member)
            raise
        finally:
            if batch is not None:
                self._hand_off()
                for other in batch:
                    if other is not member:
                        other.wake.release()

    def _hand_off(self) -> None:
        """After a commit: the first queued member leads the next batch, or none is busy."""
        with self._lock:
            if self._queue:
                leader = self._queue[0]
                leader.lead = True
                leader.wake.release()
            else:
                self._busy = False

    def _abandon(self, member: _Member) -> None:
        """A member interrupted while it waited (a signal): forget its write if no leader
        took it yet, and pass the lead on if it had been chosen."""
        with self._lock:
            if member in self._queue:
                self._queue.remove(member)
                if member.lead:
                    member.lead = False
                    if self._queue:
                        self._queue[0].lead = True
                        self._queue[0].wake.release()
                    else:
                        self._busy = False


def _commit(conn: sqlite3.Connection, batch: list[_Member], timeout_s: float) -> None:
    """Answer every member of `batch`, committing their writes on `conn`."""
    try:
        left = min(member.deadline for member in batch) - time.monotonic()
        if left >= timeout_s - _SLACK_S:
            _answer(conn, batch)
            return
        # Out of time: still one try without waiting, since the lock may be free by now.
        conn.execute(f"PRAGMA busy_timeout = {max(0, int(left * 1000))}")
        try:
            _answer(conn, batch)
        finally:
            with contextlib.suppress(*_WRITE_ERRORS):
                conn.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
    finally:
        if not all(member.done for member in batch):
            # The leader was interrupted (a signal, MemoryError) or failed outside a write:
            # the writes' fate is unknown, and no member may act as if its write were durable.
            _rollback(conn)
            for member in batch:
                if not member.done:
                    member.result, member.error, member.done = None, _unknown(), True


def _answer(conn: sqlite3.Connection, batch: list[_Member]) -> None:
    if len(batch) == 1:  # nobody joined: the plain autocommit statement
        _alone(conn, batch)
        return
    try:
        conn.execute("BEGIN IMMEDIATE")
    except _WRITE_ERRORS as exc:
        _shared(batch, exc)  # the write lock or the file: every member would meet it
        return
    try:
        for member in batch:
            member.result = member.write(conn, *member.args)
    except _WRITE_ERRORS:
        # One statement failed: none of the others may fail for it. Undo the batch and
        # give each write its own transaction, its own answer.
        _rollback(conn)
        _alone(conn, batch)
        return
    try:
        conn.execute("COMMIT")
    except _WRITE_ERRORS as exc:
        # Not synced, maybe not written: no member may count its write as done.
        _rollback(conn)
        _shared(batch, exc)
        return
    for member in batch:
        member.done = True


def _unknown() -> LedgerUnavailable:
    return LedgerUnavailable(
        "the thread committing this write together with others' failed before its COMMIT "
        "returned; the write may or may not be in the ledger"
    )


def _alone(conn: sqlite3.Connection, batch: list[_Member]) -> None:
    for member in batch:
        try:
            _clean(conn)
            member.result = member.write(conn, *member.args)
        except _WRITE_ERRORS as exc:
            member.result, member.error = None, exc
        member.done = True


def _shared(batch: list[_Member], exc: BaseException) -> None:
    # A copy each: one exception object raised in several threads would tangle its
    # traceback and chained causes across them.
    for member in batch:
        member.result, member.error, member.done = None, copy.copy(exc), True


def _rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        with contextlib.suppress(*_WRITE_ERRORS):
            conn.execute("ROLLBACK")


def _clean(conn: sqlite3.Connection) -> None:
    """Make sure a write about to run alone commits on its own: inside a transaction left
    open (a batch whose ROLLBACK failed) it would be reported done and never committed."""
    if conn.in_transaction:
        _rollback(conn)
        if conn.in_transaction:
            raise sqlite3.OperationalError(
                "a transaction left open on this connection would not roll back"
            )
