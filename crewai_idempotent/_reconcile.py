"""What a reconciler answers when asked whether an operation happened, and asking it.

A reconciler is the tool's own lookup at the provider. Whatever it does (raises, returns
something else, is async where only sync can wait) becomes `Unknown`: the record then
stays UNCERTAIN, never a guess.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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


Verdict = Found | Absent | Unknown


def ask(reconcile: Callable[[str, Any], Any], key: str, args: Any) -> Verdict:
    """Call a reconciler from the sync path and normalise what it says."""
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


async def aask(
    reconcile: Callable[[str, Any], Any],
    key: str,
    args: Any,
    lane: Callable[[], concurrent.futures.Executor],
) -> Verdict:
    """Await an async reconciler on the loop; run a sync one on the lane."""
    try:
        if inspect.iscoroutinefunction(reconcile):
            answer = await reconcile(key, args)
        else:
            submitted = lane().submit(reconcile, key, args)
            answer = await asyncio.wrap_future(submitted)
            if inspect.isawaitable(answer):
                answer = await answer
    except Exception as exc:  # noqa: BLE001
        return Unknown(f"reconciler raised {type(exc).__name__}: {exc}")
    return _verdict(answer)


def _verdict(answer: Any) -> Verdict:
    if answer is Absent:
        return Absent()
    if answer is Unknown:
        return Unknown()
    if isinstance(answer, Found | Absent | Unknown):
        return answer
    return Unknown(f"reconciler returned {answer!r}, not Found(result), Absent or Unknown")
