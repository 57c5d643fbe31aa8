"""A server's clock, read now and then, for stores shared by hosts whose clocks differ."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .._errors import LedgerUnavailable

log = logging.getLogger("crewai_idempotent")


class ServerClock:
    """The server's time, as one reading plus the local monotonic time elapsed since.

    The monotonic clock never jumps, so a host's wall clock being set (or wrong) does not
    move it; it drifts at most a few parts per million between refreshes. `read` asks the
    server for its epoch time (one round trip) and may return None when a reading taken
    meanwhile (say, while opening a connection) made another one unnecessary.
    """

    def __init__(self, server: str, read: Callable[[], float | None], refresh_s: float) -> None:
        self.server = server
        self.refresh_s = refresh_s
        self._read = read
        self._reading: tuple[float, float] | None = None  # (server epoch s, monotonic then)
        self._next = 0.0
        self._measuring = threading.Lock()

    def now(self) -> float:
        reading = self._reading
        if reading is None or self.due():
            self._refresh(required=reading is None)
            reading = self._reading
            assert reading is not None
        server, at = reading
        return server + (time.monotonic() - at)

    def record(self, server_epoch: float, sent: float, received: float) -> None:
        # The server read its clock somewhere inside the round trip: assume the middle.
        self._reading = (server_epoch, (sent + received) / 2)
        self._next = received + self.refresh_s

    @property
    def reading(self) -> tuple[float, float] | None:
        """The last reading: (server epoch seconds, local monotonic seconds at that time)."""
        return self._reading

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def blocks(self) -> bool:
        """True when `now()` would ask the server (no reading yet, or a refresh is due)."""
        return self.reading is None or self.due()

    def after_fork(self) -> None:
        self._measuring = threading.Lock()  # a lock held by a thread the child doesn't have

    def _refresh(self, required: bool) -> None:
        # One thread measures; the others keep using the previous reading meanwhile.
        if not self._measuring.acquire(blocking=required):
            return
        try:
            if not required and not self.due():
                return
            sent = time.monotonic()
            try:
                epoch = self._read()
            except LedgerUnavailable:
                if required:
                    raise
                self._next = time.monotonic() + min(self.refresh_s, 5.0)
                log.warning(
                    "could not refresh the %s clock; using the last reading",
                    self.server,
                    exc_info=True,
                )
                return
            if epoch is not None:
                self.record(epoch, sent, time.monotonic())
        finally:
            self._measuring.release()
