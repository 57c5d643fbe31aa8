"""The dispatchers a process runs for its own settings: `notify=` on a crew or in
`configure()`, or `CREWAI_IDEMPOTENCY_NOTIFY`.

One per ledger, on a daemon thread, delivering to every channel any setting of this
process names for that ledger (a setting that adds a channel restarts it with the
union). A forked child starts its own at once (the parent's thread did not cross the
fork). An entry this process writes wakes its dispatcher, which looks a moment later,
once the transition that carries the entry's mark has been written.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable

from ..ledger._backend import CacheBackend
from ._dispatch import Dispatcher
from ._kinds import Channel

_lock = threading.Lock()
_running: weakref.WeakKeyDictionary[CacheBackend, Dispatcher] = weakref.WeakKeyDictionary()


def ensure(backend: CacheBackend, channels: Iterable[Channel]) -> Dispatcher:
    """The running dispatcher of `backend`'s outbox in this process, delivering to
    `channels` too."""
    wanted = list(channels)
    with _lock:
        current = _running.get(backend)
        if current is not None:
            names = {c.name for c in current.channels}
            missing = [c for c in wanted if c.name not in names]
            if not missing:
                current.start()  # a no-op while its thread runs
                return current
            current.stop(timeout=5.0)
            wanted = [*current.channels, *missing]
        dispatcher = Dispatcher(backend, wanted)
        _running[backend] = dispatcher
        dispatcher.start()
        return dispatcher


def wake(backend: CacheBackend) -> None:
    """An entry was written to `backend` here: its dispatcher, if any, looks soon."""
    dispatcher = _running.get(backend)
    if dispatcher is not None:
        dispatcher.wake(soon=True)


def stop_all() -> None:
    """Stop every dispatcher this process runs (tests; interpreter exit needs nothing:
    their threads are daemons, and an entry not yet delivered stays in the outbox)."""
    with _lock:
        running = list(_running.values())
        _running.clear()
    for dispatcher in running:
        dispatcher.close()


def _restart_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    for dispatcher in list(_running.values()):
        dispatcher.forked()
        dispatcher.start()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_restart_in_child)
