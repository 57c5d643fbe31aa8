"""Live updates: one watcher of the ledger for every open page, and the event stream.

While at least one page listens (`/events`, server-sent events), `Watcher.run` asks the
store every `refresh_s`, on a worker thread, for its change mark (`CacheBackend.changes`:
a mark that moves after any write, read without reading a record). When the mark moves,
every stream sends `changed`, and the page's script fetches the page again (one page's
reads) and swaps the regions that changed (`static/console.js`). An open page on which
nothing changes costs one mark a refresh and reads no record; nobody listening: nothing.

A store that cannot tell (`changes()` is None) is watched by what is shown instead: the
latest records (a write makes its record the latest: an insert or an update anywhere is
seen) and what each open page shows (`shown`, one page's reads for each page open: a
delete, or a lease lapsing, on a page someone looks at), digested and compared at every
refresh: bounded by the pages open, not by the ledger. A write stamped by a clock behind
the others' is seen only where a page shows it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..ledger._backend import CacheBackend
from ..ledger._select import Order, Select
from ._views import is_console_doc

log = logging.getLogger("crewai_idempotent.console")
HEARTBEAT_S = 15.0
#: Records read as the latest page when the store has no change mark, and of those, the
#: latest (not the console's own) digested: a write puts its record first, and logins
#: (sessions) that push records out of the page's tail are no change.
LATEST = 50
LATEST_DIGESTED = 10
#: Distinct open pages read at each refresh without a change mark, at most: a person
#: holding streams open on many made-up page addresses costs no more than this.
PAGES_READ = 100

_UNSEEN = object()  # no mark read yet


class Watcher:
    """Tells the open pages' streams when the ledger in `backend` changed, looking every
    `refresh_s` while any page listens. `shown(url)` is what the page at `url` shows (a
    page's reads), compared when the store has no change mark. Raises nothing."""

    def __init__(
        self,
        backend: CacheBackend,
        refresh_s: float,
        shown: Callable[[str], Any] | None = None,
    ) -> None:
        self.backend = backend
        self.refresh_s = refresh_s
        self.shown = shown
        self.version = 0  # how many times the ledger was seen to move
        self.listeners = 0
        self.pages: collections.Counter[str] = collections.Counter()  # open pages by URL
        self._mark: object = _UNSEEN  # the store's change mark at the last look
        self._digests: dict[str, str] = {}  # without a mark: what was shown at the last look
        # Set (and replaced) at each move. An event, not a Condition: a stream cancelled
        # while waiting for a condition's lock (a page navigating away) could release a
        # lock it no longer held, after which the lock stayed taken and no page heard of a
        # change again. Waiting on an event holds nothing.
        self._moved: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._looking: asyncio.Task[None] | None = None

    # -- looking (on a worker thread) ---------------------------------------------------

    def _look(self, pages: tuple[str, ...]) -> tuple[object, dict[str, str]]:
        """The store's change mark; without one, a digest of the latest records and of
        what each of `pages` shows."""
        mark = self.backend.changes()
        if mark is not None:
            return mark, {}
        digests = {"": self._latest()}
        for page in pages:
            if page and self.shown is not None:
                digests[page] = _digest(repr(self.shown(page)))
        return None, digests

    def _latest(self) -> str:
        lines = []
        for record in self.backend.select(Select(order=Order.NEWEST, limit=LATEST)):
            if not is_console_doc(record.key):  # a login is not news to any page
                lines.append(f"{record.key!r} {record.status.value} {record.revision}")
        return _digest("\n".join(lines[:LATEST_DIGESTED]))

    # -- on the event loop ----------------------------------------------------------------

    async def read(self) -> None:
        """Look at the ledger now (or join the look under way) and tell the streams if it
        moved. Raises nothing: a look that fails is logged."""
        if self._looking is None or self._looking.done():
            self._looking = asyncio.ensure_future(self._read())
        # Shielded: a page that goes away while waiting leaves the look to the others.
        await asyncio.shield(self._looking)

    async def _read(self) -> None:
        try:
            pages = tuple(sorted(self.pages))[:PAGES_READ]
            mark, digests = await asyncio.to_thread(self._look, pages)
        except Exception:
            log.warning("live updates could not read the ledger", exc_info=True)
            return
        if mark is not None:
            moved = self._mark is not _UNSEEN and mark != self._mark
            self._mark = mark
        else:
            # A page seen for the first time is its own baseline.
            moved = any(self._digests.get(page, d) != d for page, d in digests.items())
            self._mark = _UNSEEN
        self._digests = digests
        if moved:
            self.version += 1
            moved_event, self._moved = self._next(), asyncio.Event()
            moved_event.set()

    def _next(self) -> asyncio.Event:
        """The event set at the next move."""
        if self._moved is None:
            self._moved = asyncio.Event()
        return self._moved

    async def run(self) -> None:
        """The lifespan task: look while anyone listens."""
        self._wake = asyncio.Event()
        try:
            while True:
                if self.listeners:
                    await self.read()
                    await asyncio.sleep(self.refresh_s)
                else:
                    self._wake.clear()
                    await self._wake.wait()
        finally:
            if self._looking is not None:
                self._looking.cancel()

    async def stream(
        self, still_allowed: Callable[[], bool], page: str = ""
    ) -> AsyncIterator[bytes]:
        """Server-sent events for one page (`page`: its path and query): `changed` when the
        ledger moves, a comment now and then (which also finds a closed connection). Ends
        when `still_allowed` (run on a thread: it reads the session) says no."""
        self.listeners += 1
        self.pages[page] += 1
        if self._wake is not None:
            self._wake.set()
        try:
            # Counted from before the first look: a move that look finds may be one the
            # page was rendered before, and a page told once too often only reads itself
            # again. Any change after the look is a move the next one sees.
            seen = self.version
            await self.read()
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
            self.pages[page] -= 1
            if self.pages[page] <= 0:
                del self.pages[page]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:24]
