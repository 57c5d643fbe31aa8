"""What a reconciler answers when asked whether an operation happened, and asking it.

A reconciler is the tool's own lookup at the provider. Whatever it does (raises, returns
something else, is async where only sync can wait, does not answer within
`reconcile_timeout_s`) becomes `Unknown`: the record then stays UNCERTAIN, never a guess.

With a timeout, a sync reconciler runs on a thread of its own and the caller waits for it
that long; if it has not answered, it is left to finish there and whatever it says later
is ignored (a thread cannot be stopped, and a provider call in flight should not be cut
off mid-way). An async one is cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("crewai_idempotent")

# How a sync caller waits for a reconciler's thread: (event, seconds) -> set in time.
Wait = Callable[[threading.Event, float], bool]


@dataclass(frozen=True, slots=True)
class Found:
    """The operation happened; `result` is its receipt and will be replayed."""

    result: Any


@dataclass(frozen=True, slots=True)
class Absent:
    """The operation did not happen; the next attempt may run it."""


@dataclass(frozen=True, slots=True)
class Unknown:
    """The outside system cannot tell; the record stays UNCERTAIN."""

    reason: str = "reconciler could not tell"


@dataclass(frozen=True, slots=True)
class Unanswered(Unknown):
    """The reconciler did not answer within `reconcile_timeout_s`: Unknown, and the other
    callers of the key waiting in this process for that answer are given it too."""


Verdict = Found | Absent | Unknown


def ask(
    reconcile: Callable[[str, Any], Any],
    key: str,
    args: Any,
    timeout: float | None = None,
    wait: Wait | None = None,
) -> Verdict:
    """Call a reconciler from the sync path and normalise what it says: in this thread
    without a timeout, else on a thread of its own, waited for `timeout` seconds (through
    `wait`, the ledger's clock; `Event.wait` by default)."""
    if timeout is None:
        return _sync_answer(reconcile, key, args)
    future: concurrent.futures.Future[Verdict] = concurrent.futures.Future()
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    _start(future, lambda: _sync_answer(reconcile, key, args))
    if not (wait or _wait_for_event)(done, timeout) and future.cancel():
        return _unanswered(key, timeout)
    return future.result()


async def aask(
    reconcile: Callable[[str, Any], Any], key: str, args: Any, timeout: float | None = None
) -> Verdict:
    """Await an async reconciler on the loop (cancelled after `timeout` seconds); run a
    sync one on a thread of its own, waited for on the loop."""
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            if inspect.iscoroutinefunction(reconcile):
                answer = await reconcile(key, args)
            else:
                future: concurrent.futures.Future[Any] = concurrent.futures.Future()
                _start(future, lambda: reconcile(key, args))
                answer = await asyncio.wrap_future(future)
                if inspect.isawaitable(answer):
                    answer = await answer
    except TimeoutError as exc:
        if scope.expired():
            assert timeout is not None
            return _unanswered(key, timeout)
        return Unknown(f"reconciler raised {type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001
        return Unknown(f"reconciler raised {type(exc).__name__}: {exc}")
    return _verdict(answer)


def _sync_answer(reconcile: Callable[[str, Any], Any], key: str, args: Any) -> Verdict:
    try:
        answer = reconcile(key, args)
        if inspect.isawaitable(answer):
            close = getattr(answer, "close", None)
            if close:
                close()
            return Unknown("an async reconciler cannot be used from the sync run()")
    except Exception as exc:  # noqa: BLE001
        return Unknown(f"reconciler raised {type(exc).__name__}: {exc}")
    return _verdict(answer)


def _start(future: concurrent.futures.Future[Any], work: Callable[[], Any]) -> None:
    """Run `work` on a daemon thread of its own (in a copy of the caller's context) and
    put its outcome in `future`, unless the caller has given up on it (cancelled)."""
    context = contextvars.copy_context()

    def run() -> None:
        try:
            outcome = context.run(work)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller, if any
            if future.set_running_or_notify_cancel():
                future.set_exception(exc)
            return
        if future.set_running_or_notify_cancel():
            future.set_result(outcome)
        else:
            log.info("a reconciler answered after its caller stopped waiting; ignored")

    threading.Thread(target=run, name="crewai-idempotent-reconcile", daemon=True).start()


def _unanswered(key: str, timeout: float) -> Unanswered:
    log.warning(
        "the reconciler of %r did not answer within reconcile_timeout_s=%s; the outcome "
        "stays unknown and a later answer is ignored",
        key,
        timeout,
    )
    return Unanswered(
        f"the reconciler did not answer within reconcile_timeout_s={timeout:g} s "
        "(a later answer is ignored)"
    )


def _wait_for_event(event: threading.Event, seconds: float) -> bool:
    return event.wait(seconds)


def _verdict(answer: Any) -> Verdict:
    if answer is Absent:
        return Absent()
    if answer is Unknown:
        return Unknown()
    if isinstance(answer, Found | Absent | Unknown):
        return answer
    return Unknown(f"reconciler returned {answer!r}, not Found(result), Absent or Unknown")
