"""The client-side deadline of a PostgreSQL call, kept whatever the server does.

`statement_timeout` is enforced by the server, so it cannot fire when the server is frozen
(SIGSTOP, a hung host) or the network drops packets: the kernel at the far end may still
acknowledge TCP, so keepalives and TCP_USER_TIMEOUT do not help either. So every call has
a `Budget`; `watchdog` shuts down the socket of a connection whose statements run past
their deadline (the blocked read then returns, and the connection is discarded); and a
new connection is attempted in a thread of its own (`Connecting`), which the caller stops
waiting for when its time is up (libpq's connect_timeout counts whole seconds per host
address).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import psycopg

from ...ledger import _fork

# How long past a statement's deadline the client waits before it cuts the connection:
# long enough for the server's own statement_timeout (same length) to answer cleanly.
GRACE_S = 0.25


class Budget:
    """The time one operation may take: until `connect_by` to get a connection (pooled,
    or new), and until `done_by` in all, statements and a resend included."""

    __slots__ = ("connect_by", "done_by")

    def __init__(self, timeout_s: float, statement_timeout_s: float) -> None:
        self.connect_by = time.monotonic() + timeout_s
        self.done_by = self.connect_by + statement_timeout_s


class _Guard:
    __slots__ = ("conn", "deadline", "fired")

    def __init__(self, conn: psycopg.Connection[Any], deadline: float) -> None:
        self.conn = conn
        self.deadline = deadline
        self.fired = False


class _Watchdog:
    """Cuts the connections whose deadline passed while a statement was in flight.

    `arm` before using a connection, `disarm` after: True means the socket was shut down
    (the blocked call then fails, or its answer arrived just in time) and the connection
    must be discarded. Shutting down a duplicate of the socket's descriptor ends the
    connection for every descriptor sharing it, so the read that blocked returns at once;
    the connection itself is closed by the thread that used it, never here. One thread
    serves every backend in the process; it sleeps until the earliest deadline, and only
    when nothing is armed does an `arm` need to wake it.
    """

    def __init__(self) -> None:
        self._reset()
        _fork.register(self)

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._armed: set[_Guard] = set()
        self._wake_at: float | None = None  # None: asleep until an arm wakes it
        self._thread: threading.Thread | None = None

    def arm(self, conn: psycopg.Connection[Any], deadline: float) -> _Guard:
        guard = _Guard(conn, deadline)
        with self._cond:
            self._armed.add(guard)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="crewai-idempotent-pg-watchdog", daemon=True
                )
                self._thread.start()
            elif self._wake_at is None or deadline < self._wake_at:
                self._cond.notify()
        return guard

    def disarm(self, guard: _Guard) -> bool:
        with self._cond:
            self._armed.discard(guard)
            return guard.fired

    def _watch(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for guard in [g for g in self._armed if g.deadline <= now]:
                    self._armed.discard(guard)
                    guard.fired = True
                    _shut_down(guard.conn)
                self._wake_at = min((g.deadline for g in self._armed), default=None)
                self._cond.wait(None if self._wake_at is None else self._wake_at - now)

    # A child has no watchdog thread, and must never cut a connection it inherited: the
    # socket is the parent's too.
    def before_fork(self) -> None:
        pass

    def after_fork_in_parent(self) -> None:
        pass

    def after_fork_in_child(self) -> None:
        self._reset()


def _shut_down(conn: psycopg.Connection[Any]) -> None:
    try:
        fd = conn.pgconn.socket
        with socket.socket(fileno=os.dup(fd)) as dup:
            dup.shutdown(socket.SHUT_RDWR)
    except (OSError, psycopg.Error):
        pass  # already closed: whatever was blocked on it has returned


#: One watchdog thread serves every PostgreSQL backend in the process.
watchdog = _Watchdog()


class Connecting:
    """A connection attempt in a thread of its own, so that waiting for it can stop at
    any moment. An attempt nobody waits for any more closes its connection, if it gets
    one, and releases `slot` when it ends; otherwise the caller owns both."""

    def __init__(
        self, conninfo: str, kwargs: dict[str, Any], slot: threading.BoundedSemaphore
    ) -> None:
        self._conninfo, self._kwargs, self._slot = conninfo, kwargs, slot
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._abandoned = False
        self._conn: psycopg.Connection[Any] | None = None
        self._error: psycopg.Error | None = None
        threading.Thread(
            target=self._connect, name="crewai-idempotent-connect", daemon=True
        ).start()

    def _connect(self) -> None:
        try:
            conn: psycopg.Connection[Any] | None = psycopg.connect(self._conninfo, **self._kwargs)
        except psycopg.Error as exc:
            conn, self._error = None, exc
        with self._lock:
            self._conn = conn
            self._done.set()
            if not self._abandoned:
                return
        if conn is not None:
            conn.close()
        self._slot.release()

    def result(self, wait_s: float) -> psycopg.Connection[Any]:
        """The connection; psycopg.Error if the attempt failed; TimeoutError if it did not
        end within `wait_s` (the attempt is abandoned)."""
        self._done.wait(wait_s)
        with self._lock:
            if not self._done.is_set():
                self._abandoned = True
                raise TimeoutError
        if self._conn is None:
            self._slot.release()
            assert self._error is not None
            raise self._error
        return self._conn
