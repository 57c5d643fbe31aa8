"""What a guarded call may ask for, and the rules it must obey.

The stale policies, the durations and the one rule every duration obeys (the ledger and the
crewAI configuration both check with `check_seconds`), the clock that waits are measured
on, `_Options`: one call's settings, resolved from the ledger's defaults, and
`classify_failure`: how a body's exception is recorded, what proves nothing happened and
what does not.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

from .._errors import OutcomeUnknown
from ._record import Status

if TYPE_CHECKING:
    from ._record import Record

StalePolicy = Literal["uncertain", "reconcile", "retry"]
STALE_POLICIES: tuple[str, ...] = get_args(StalePolicy)
Reconciler = Callable[[str, Any], Any]
Listener = Callable[[str, "Record"], None]


class Clock(Protocol):
    """What the guard's waits are measured on: `wait_s` for a live claim, the pauses
    between polls and between commit retries, and the lease keeper's schedule.
    `time.monotonic`/`time.sleep`/`Event.wait` by default; a test gives a clock it moves,
    so a wait times out and a renewal falls due at once. Leases and TTLs are judged by
    the store's clocks (`CacheBackend.now`, `CacheBackend.host_clock`), not by this one.

    `wait(event, seconds)` is the lease keeper's pause: until `event` is set or `seconds`
    pass on this clock (True if the event was set). A clock without it leaves the keeper
    waiting in real time."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...

    def wait(self, event: threading.Event, seconds: float) -> bool: ...


def check_seconds(name: str, value: object, *, positive: bool = False) -> None:
    """A duration: a real number of seconds (not a bool, not NaN), 0 or more, or more than 0
    when `positive`. TypeError for what is not a number, ValueError for a number out of range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, not {value!r}")
    if math.isnan(value):
        raise ValueError(f"{name} must be a number of seconds, not {value!r}")
    if value < 0 or (positive and value == 0):
        bound = "greater than 0" if positive else "0 or more"
        raise ValueError(f"{name} must be {bound} seconds, not {value!r}")


def readable_seconds(seconds: float) -> str:
    """A duration as a person reads it in an alert: 45 s, 12 min, 3 h 05 min, 2 d 4 h."""
    s = max(int(seconds), 0) if math.isfinite(seconds) else 0
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    if s < 172800:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def check_durations(wait_s: object, lease_s: object, ttl: object) -> None:
    """The guard's three durations. `ttl=None`: receipts that never expire; a `ttl` of 0
    would make every call run again, never replay."""
    check_seconds("wait_s", wait_s)
    check_seconds("lease_s", lease_s, positive=True)
    if ttl is not None:
        check_seconds("ttl", ttl, positive=True)


def check_reconcile_timeout(value: object) -> None:
    """`reconcile_timeout_s`: more than 0 seconds, or None (no bound)."""
    if value is not None:
        check_seconds("reconcile_timeout_s", value, positive=True)


@dataclass(slots=True)  # not frozen: built on every call, and frozen fields cost a call each
class _Options:
    fingerprint: str
    args: Any
    wait_s: float
    lease_s: float
    ttl: float | None
    reconcile: Reconciler | None
    on_stale: StalePolicy
    reconcile_timeout_s: float | None = None  # None: the reconciler is waited for without bound
    # What a claim records for a reconciler asked from another process: the tool's name
    # and the ttl (every tool's claims), the reconciler's import path; the claim adds the
    # arguments when the call has a reconciler (`reconcile`).
    call: dict[str, Any] | None = None

    def of_call(self, fingerprint: str, args: Any) -> _Options:
        """These options for one call: its fingerprint and arguments filled in."""
        return _Options(
            fingerprint, args, self.wait_s, self.lease_s, self.ttl, self.reconcile,
            self.on_stale, self.reconcile_timeout_s, self.call,
        )  # fmt: skip


def classify_failure(exc: BaseException) -> tuple[Status, str]:
    """How a body's exception is recorded: FAILED (the next attempt runs) only for an
    ordinary exception; UNCERTAIN for anything that does not prove the effect is absent."""
    if isinstance(exc, OutcomeUnknown):
        return Status.UNCERTAIN, f"the tool reported an unknown outcome: {exc}"
    # asyncio by name: `import crewai_idempotent` does not load it, and a CancelledError
    # exists only once something has.
    asyncio = sys.modules.get("asyncio")
    cancelled = asyncio is not None and isinstance(exc, asyncio.CancelledError)
    if isinstance(exc, TimeoutError) or cancelled or _looks_like_timeout(exc):
        return Status.UNCERTAIN, (
            f"the body was interrupted ({type(exc).__name__}: {exc}); a timeout or "
            "cancellation does not prove the effect did not happen"
        )
    if not isinstance(exc, Exception):
        return Status.UNCERTAIN, f"the body was interrupted by {type(exc).__name__}"
    return Status.FAILED, f"{type(exc).__name__}: {exc}"


def _looks_like_timeout(exc: BaseException) -> bool:
    # HTTP clients' timeouts (requests' ReadTimeout, httpx's TimeoutException, urllib3's
    # ReadTimeoutError) do not subclass TimeoutError; a request that timed out may still
    # have been carried out, so treat them as unknown rather than as a safe failure.
    return any("timeout" in cls.__name__.lower() for cls in type(exc).__mro__)
