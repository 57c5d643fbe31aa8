"""Filling the Redis ledger's `x:` indexes with the records this release's scripts have not
written: those written before it, and those its previous release writes beside it.

A record is indexed when its hash carries the `x` stamp of its version (`_layout`). The
backfill walks every status index with ZSCAN, a step at a time: each step is one script
that looks at about `WALK` (250) members on the server and returns only the unstamped ones,
whose records are then read and healed (`_select.heal`, a compare-and-set on their
version). A step holds the server for about a millisecond, so claims never wait longer.
Its progress is kept in the ledger (`x:fill`), so any process continues it, and a lock of
a few seconds (`x:fill:lock`) keeps two processes from doing the same step.

A record the previous release moves from a status index not yet walked to one already
walked would be missed, so the walk is followed by a window: every record updated since
the walk began (less `MARGIN`, for writers' clocks and writes in flight) is looked at
again. A window that finds an unstamped record means a worker of the previous release is
still writing: another window follows, over what was written since this one began, and
`x:ready` is set only after a window that finds none. From then on, selects trust the
`x:` sets alone, and what a worker of the previous release writes afterwards is found by
them only once a read meets it (healed) or the backfill runs again (docs/backends.md).
"""

from __future__ import annotations

import uuid
from typing import Any, Protocol

from .._scan import BATCH
from ._scripts import WALK
from ._select import Scores, Store, fetch, heal, text, time_page

#: Seconds before the walk's start that the window looks back: a write lands after the
#: time its record shows by at most the writer's clock error and its own timeout.
MARGIN = 60.0
_LOCK_MS = 30_000


class Progress(Store, Protocol):
    """What the backfill needs of the store beyond a select's."""

    def now(self) -> float: ...


def ready(store: Store) -> bool:
    """True when the `x:` indexes hold every record, as far as the backfill can tell."""
    layout = store.layout
    if store._call("reading the indexes' state", lambda _: store.client.exists(layout.ready)):
        return True
    keys = [layout.ready, layout.fill, layout.documents, *layout.indexes]
    return bool(store._call("reading the indexes' state",
                            lambda _: store.lua.fresh(keys=keys, args=[])))  # fmt: skip


def restart(store: Store) -> None:
    """Forget that the indexes are complete, and begin a new backfill."""
    layout = store.layout
    store._call("restarting the backfill",
                lambda _: store.client.delete(layout.ready, layout.fill))  # fmt: skip


def step(store: Progress) -> tuple[bool, int]:
    """One step of the backfill: (whether the indexes are now complete, how many members
    it looked at; -1 when another process holds the step). Raises `LedgerUnavailable`."""
    layout, client = store.layout, store.client
    lock, mine = layout.fill + ":lock", uuid.uuid4().hex
    got = store._call("locking the backfill",
                      lambda _: client.set(lock, mine, nx=True, px=_LOCK_MS))  # fmt: skip
    if not got:
        return False, -1
    try:
        state = {text(k): text(v) for k, v in store._call(
            "reading the backfill", lambda _: client.hgetall(layout.fill)).items()}  # fmt: skip
        if store._call("reading the indexes' state", lambda _: client.exists(layout.ready)):
            return True, 0
        if not state:
            state = {"phase": "walk", "index": "0", "cursor": "0", "started": repr(store.now())}
        looked, state = _advance(store, state)
        if state.get("phase") == "done":

            def finish(_resent: bool) -> None:
                pipe = client.pipeline(transaction=True)
                pipe.set(layout.ready, state["started"])
                pipe.delete(layout.fill)
                pipe.execute()

            store._call("marking the indexes complete", finish)
            return True, looked
        store._call("saving the backfill", lambda _: client.hset(layout.fill, mapping=state))
        return False, looked
    finally:
        release = "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end"
        store._call("unlocking the backfill", lambda _: client.eval(release, 1, lock, mine))


def _advance(store: Progress, state: dict[str, str]) -> tuple[int, dict[str, str]]:
    layout = store.layout
    index = int(state["index"])
    name = layout.indexes[index]
    if state["phase"] == "walk":
        cursor = state["cursor"]
        found = store._call("backfilling the indexes", lambda _: store.lua.walk_set(
            keys=[name], args=[cursor, WALK, layout.records]))  # fmt: skip
        _heal(store, [text(k) for k in found[1:]])
        state = {**state, "cursor": text(found[0])}
        looked = WALK
        if state["cursor"] == "0":
            state["index"] = str(index + 1)
            if index + 1 == len(layout.indexes):
                state = _window(store, state)
        return looked, state
    since = float(state["since"])
    after = (float(state["score"]), state["member"]) if state.get("member") else None
    page = time_page(store, name, False, Scores(since), after, BATCH)
    stale = _stale(store, [member for _score, member in page])
    _heal(store, stale)
    state = {**state, "seen": str(int(state["seen"]) + len(stale))}
    if len(page) == BATCH:
        state["score"], state["member"] = repr(page[-1][0]), page[-1][1]
        return len(page), state
    state["score"], state["member"] = "", ""
    state["index"] = str(index + 1)
    if index + 1 < len(layout.indexes):
        return len(page), state
    if state["seen"] == "0":
        return len(page), {**state, "phase": "done"}
    return len(page), _window(store, state)


def _window(store: Progress, state: dict[str, str]) -> dict[str, str]:
    """The next window: over what was written since the phase before it began."""
    return {
        "phase": "window", "index": "0", "since": repr(float(state["started"]) - MARGIN),
        "started": repr(store.now()), "score": "", "member": "", "seen": "0",
        "cursor": "0", "windows": str(int(state.get("windows", "0")) + 1),
    }  # fmt: skip


def windows(store: Store) -> int:
    """How many windows the backfill under way has begun: a second one and each after it
    began because the one before found records the previous release wrote meanwhile."""
    fill = store.layout.fill
    count = store._call("reading the backfill", lambda _: store.client.hget(fill, "windows"))
    return 0 if count is None else int(text(count))


def _stale(store: Store, keys: list[str]) -> list[str]:
    if not keys:
        return []
    found: Any = store._call("backfilling the indexes", lambda _: store.lua.stale(
        keys=[], args=[store.layout.records, *keys]))  # fmt: skip
    return [text(k) for k in found]


def _heal(store: Store, keys: list[str]) -> None:
    if keys:
        heal(store, fetch(store, keys), ())
