"""What runs beside the console for as long as it does: the outbox's dispatcher and the
sweeper, each a `background` job of `create_app`.

Both are made before the console listens (a channel URL or an `--import` that cannot work
is an error then, not at the first delivery) and run on threads of their own, as they do
in `notify --watch` and `reconcile --watch`: a channel that hangs or a reconciler that
blocks holds up its own thread, never the event loop that serves the pages. The lifespan
starts them and, at shutdown, cancels the job, which stops its worker after the pass in
progress.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..ledger._policy import check_seconds

if TYPE_CHECKING:
    from ..notifications import Channel, Dispatcher, Entry
    from ..reconciliation import Sweeper
    from ._console import Background, Console

log = logging.getLogger("crewai_idempotent.console")


async def _until_cancelled() -> None:
    await asyncio.Event().wait()


def dispatching(dispatcher: Dispatcher) -> Background:
    """A job delivering the outbox with `dispatcher` while the console runs. Each try it
    makes also prompts the open pages' live update, so a delivery shows without waiting
    for the next refresh. Raises nothing; at shutdown the job closes `dispatcher` (its
    channels too)."""

    async def job(console: Console) -> None:
        loop = asyncio.get_running_loop()
        heard = dispatcher.listener

        def listener(event: str, entry: Entry) -> None:
            if heard is not None:
                heard(event, entry)
            if console.watcher.listeners:
                asyncio.run_coroutine_threadsafe(console.watcher.read(), loop)

        dispatcher.listener = listener
        dispatcher.start()
        console.dispatchers.append(dispatcher)
        log.info("delivering notifications: %r", dispatcher)
        try:
            await _until_cancelled()
        finally:
            console.dispatchers.remove(dispatcher)
            await asyncio.to_thread(dispatcher.close)
            dispatcher.listener = heard

    return job


def sweeping(sweeper: Sweeper, interval_s: float = 30.0) -> Background:
    """A job settling UNCERTAIN records and stale claims with `sweeper` every
    `interval_s` while the console runs (`Sweeper.start`, stopped at shutdown). Raises
    `TypeError` for an `interval_s` that is not a number and `ValueError` for a negative
    one, here: inside the job it would surface only when the console starts."""
    check_seconds("interval_s", interval_s)

    async def job(console: Console) -> None:
        watching = sweeper.start(interval_s)
        log.info("sweeping %s every %g s", sweeper.url, interval_s)
        try:
            await _until_cancelled()
        finally:
            # A reconciler is waited for at most timeout_s: the pass in progress ends by then.
            await asyncio.to_thread(watching.stop, sweeper.timeout_s + 5.0)

    return job


def link_console(channels: Iterable[Channel], origin: str | None) -> list[str]:
    """Slack channels given no `console=` link their messages to this console, when its
    public origin is known (a listening address is not one a Slack reader could open).
    The names of the channels that now link to it."""
    from ..notifications._slack import SlackChannel

    linked = []
    for channel in channels:
        if origin is not None and isinstance(channel, SlackChannel) and channel.console is None:
            channel.console = origin
            linked.append(channel.name)
    return linked
