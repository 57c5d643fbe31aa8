"""The SQLite connections a backend opens, seen where it opens them: `sqlite3.connect`.

`Connections` wraps the library's entry point for one test (monkeypatch), keeps every
connection opened after it, with the thread that opened it, and traces the statements
each runs. A test then looks at what SQLite was asked to do, or leaves a connection in a
state a fault would (a transaction left open), without reaching into the backend.
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Any

import pytest


class Connections:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened: list[tuple[threading.Thread, sqlite3.Connection, list[str]]] = []
        self._lock = threading.Lock()
        connect = sqlite3.connect

        def recording(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            conn = connect(*args, **kwargs)
            ran: list[str] = []
            conn.set_trace_callback(ran.append)
            with self._lock:
                self.opened.append((threading.current_thread(), conn, ran))
            return conn

        monkeypatch.setattr(sqlite3, "connect", recording)

    @property
    def statements(self) -> list[str]:
        """Every statement run on every connection, connection by connection."""
        with self._lock:
            return [s for _, _, ran in self.opened for s in ran]

    def runs(self) -> list[list[str]]:
        """The statements of each connection, in the order the connections were opened."""
        with self._lock:
            return [list(ran) for _, _, ran in self.opened]

    def of_this_thread(self) -> list[sqlite3.Connection]:
        me = threading.current_thread()
        return [conn for thread, conn, _ in self.opened if thread is me]

    def alive(self) -> list[sqlite3.Connection]:
        """The connections opened and not closed since."""
        alive = []
        for _, conn, _ in self.opened:
            try:
                conn.total_changes  # noqa: B018 - raises once the connection is closed
            except sqlite3.ProgrammingError:
                continue
            alive.append(conn)
        return alive

    def forget(self) -> None:
        """Statements from now on only."""
        with self._lock:
            for _, _, ran in self.opened:
                ran.clear()
