"""Keeping a SQLite ledger whole across fork().

SQLite keeps, per process, a table of the files it has open and of the POSIX locks it
believes it holds on them. A forked child inherits that table but not the locks (fcntl
locks belong to a process), so a connection the child opens, even a fresh one, trusts
locks nobody holds: the parent's last close then checkpoints and deletes the WAL while
the child still writes to it, and the two processes split the ledger. The SQLite
documentation says an open database must not cross fork(). So, around every fork, each
backend lets its running operations finish, blocks new ones and closes every connection
it has, which leaves SQLite's table empty for the file; the parent reopens on its next
operation and the child opens its own. A backend that could not do that (an operation
outlived the wait, or the fork bypassed os.register_at_fork) refuses every operation on
that file in the child, with a LedgerUnavailable that says what to do.

`Gate` is the fence the backends close around a fork. What a child inherited in an
unknown state is kept here, for the process: the connections it must never close, and
the files it must refuse.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path


class Gate:
    """Operations run concurrently; fork() waits for the running ones and blocks new ones."""

    __slots__ = ("_active", "_closed", "_cond", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._active = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        """No new operation is let in (close() or a fork has begun)."""
        return self._closed

    def enter(self) -> None:
        with self._lock:  # the plain lock: this runs on every operation
            if not self._closed:
                self._active += 1
                return
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._active += 1

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._closed and not self._active:
                self._cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Block new operations; True once none runs, False if some still ran at `timeout`."""
        with self._cond:
            self._closed = True
            return self._cond.wait_for(lambda: not self._active, timeout)

    def open(self) -> None:
        with self._cond:
            self._closed = False
            self._cond.notify_all()


# Connections a forked child inherited while they were in use: the child must never close
# them (sqlite3_close would act on locks and a WAL index the child does not own), not even
# when the interpreter exits, so each gets a reference that is never released.
_kept: list[sqlite3.Connection] = []
# Files whose SQLite bookkeeping this process inherited in an unknown state, by
# (st_dev, st_ino): why each is refused.
_tainted: dict[tuple[int, int], str] = {}


def taint(identity: tuple[int, int], why: str, connections: list[sqlite3.Connection]) -> None:
    """In a child: keep `connections` unclosed forever, and refuse the file from now on."""
    import ctypes  # only here: it costs every process that opens a ledger 2 ms to import

    for conn in connections:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(conn))
        _kept.append(conn)
    _tainted[identity] = why


def tainted(identity: tuple[int, int]) -> str | None:
    """Why this process must not open the file, or None."""
    return _tainted.get(identity)


def refusal_message(path: Path, why: str) -> str:
    return (
        f"the SQLite ledger {path} cannot be used in this process (pid {os.getpid()}): "
        f"it was inherited through fork() with SQLite connections open, and {why}. SQLite "
        "locks do not survive fork(), so using the file here could split the ledger. "
        "Open the ledger in the child after the fork (in the worker's start-up hook), or "
        "start workers with the 'spawn' or 'forkserver' method"
    )
