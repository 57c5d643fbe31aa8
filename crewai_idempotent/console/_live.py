"""Live updates: one reader of the ledger for every open page, and the event stream.

While at least one page listens (`/events`, server-sent events), `Watcher.run` reads the
ledger every `refresh_s` on a worker thread and digests what the pages show (each
record's key, status and revision; the console's own documents left out). When the
digest moves, every stream sends `changed`, and the page's script fetches the page again
and swaps the regions that changed (`static/console.js`). Nobody listening: no reads.

Each read scans the ledger once, as `crewai-idempotent ls` does: for a ledger of
millions of records give the console a longer `--refresh`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Callable

from ..ledger._backend import CacheBackend
from ._views import is_console_doc

log = logging.getLogger("crewai_idempotent.console")
HEARTBEAT_S = 15.0


class Watcher:
    def __init__(self, backend: CacheBackend, refresh_s: float) -> None:
        self.backend = backend
        self.refresh_s = refresh_s
        self.version = ""
        self.listeners = 0
        # Set (and replaced) when the digest moves. An event, not a Condition: a stream
        # cancelled while waiting for a condition's lock (a page navigating away) could
        # release a lock it no longer held, after which the lock stayed taken and no page
        # heard of a change again. Waiting on an event holds nothing.
        self._moved: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None

    def _digest(self) -> str:
        digest = hashlib.sha256()
        for record in self.backend.scan():
            if is_console_doc(record.key):
                continue
            line = f"{record.key}\x00{record.status.value}\x00{record.revision}\n"
            digest.update(line.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()[:24]

    async def read(self) -> str:
        """Read the ledger now; tell the streams if it moved."""
        version = await asyncio.to_thread(self._digest)
        if version != self.version:
            self.version = version
            moved, self._moved = self._next(), asyncio.Event()
            moved.set()
        return version

    def _next(self) -> asyncio.Event:
        """The event set at the next move of the digest."""
        if self._moved is None:
            self._moved = asyncio.Event()
        return self._moved

    async def run(self) -> None:
        """The lifespan task: read while anyone listens."""
        self._wake = asyncio.Event()
        while True:
            if self.listeners:
                try:
                    await self.read()
                except Exception:
                    log.warning("live updates could not read the ledger", exc_info=True)
                await asyncio.sleep(self.refresh_s)
            else:
                self._wake.clear()
                await self._wake.wait()

    async def stream(self, still_allowed: Callable[[], bool]) -> AsyncIterator[bytes]:
        """Server-sent events for one page: `changed` when the ledger moves, a comment now
        and then (which also finds a closed connection). Ends when `still_allowed` (run on
        a thread: it reads the session) says no."""
        self.listeners += 1
        if self._wake is not None:
            self._wake.set()
        try:
            seen = await self.read()
            yield b"retry: 3000\n: connected\n\n"
            while True:
                moved = self._next()
                if self.version == seen:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(moved.wait(), HEARTBEAT_S)
                if not await asyncio.to_thread(still_allowed):
                    return
                if self.version != seen:
                    seen = self.version
                    yield f"event: changed\ndata: {seen}\n\n".encode("ascii")
                else:
                    yield b": still here\n\n"
        finally:
            self.listeners -= 1
