"""Spend caps and approvals around one guarded body, without crewAI.

The gates run inside the ledger's claim, after the claim and before the body: the claim's
holder is the only caller of its key that can be here, so deciding per key needs no lock
of its own, and every refusal raises before the body starts. The ledger then records the
claim FAILED (nothing ran), which is what lets the next attempt, after an approval or
once the budget allows, run the body. In order:

1. spend caps, read only: a call over a cap is refused before anyone is asked to approve;
2. approval: the grant for this key and fingerprint is used, or `ApprovalRequired` /
   `ApprovalDenied` is raised (optionally waiting `approval_wait_s` for a decision);
3. spend caps, for good: the amount is reserved in every cap window by compare-and-set;
4. the body; then its reservation becomes spent (it returned), is released (it failed
   before any effect: FAILED), or is kept (its outcome is unknown: UNCERTAIN).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ._approvals import Approvals
from ._backend import CacheBackend
from ._errors import ApprovalRequired, classify_failure
from ._ledger import current_claim
from ._record import Record, Status
from ._spend import Money, SpendCap, SpendLedger, Where, Window, windows

T = TypeVar("T")
log = logging.getLogger("crewai_idempotent")

_POLL_FIRST_S = 0.25
_POLL_MAX_S = 5.0


@dataclass(frozen=True, slots=True)
class Plan:
    """What the gates need to know about one call."""

    tool: str
    fingerprint: str
    amount: Money | None = None
    caps: Sequence[tuple[str, SpendCap]] = ()
    where: Where = field(default_factory=Where)
    approval: bool = False
    approval_reason: str = "the tool requires approval"
    summary: Mapping[str, Any] = field(default_factory=dict)
    approval_wait_s: float = 0.0

    @property
    def gated(self) -> bool:
        return self.approval or (self.amount is not None and bool(self.caps))


class _Entered:
    def __init__(self, spend: SpendLedger, claim: Record, reserved: list[Window]) -> None:
        self.spend = spend
        self.claim = claim
        self.reserved = reserved

    def done(self, exc: BaseException | None) -> None:
        if not self.reserved:
            return
        if exc is not None and classify_failure(exc)[0] is Status.UNCERTAIN:
            return  # the money may be gone: kept until the record is resolved
        try:
            self.spend.settle(self.claim.key, self.claim.token, self.reserved, spent=exc is None)
        except Exception:
            # Never let book-keeping turn a body that ran into a failure (the next attempt
            # would run it again): the entry stays reserved, and is settled from the key's
            # record by the next call that needs the room, or by `crewai-idempotent spend`.
            log.warning("could not settle the spend of %r yet", self.claim.key, exc_info=True)


def _claim() -> Record:
    claim = current_claim()
    if claim is None:
        raise RuntimeError("approval and spend gates run only inside a ledger claim")
    return claim


def _check_and_authorize(backend: CacheBackend, plan: Plan, claim: Record) -> list[Window]:
    found: list[Window] = []
    if plan.amount is not None and plan.caps:
        found = windows(plan.caps, plan.where, backend.now())
        SpendLedger(backend).check(claim.key, plan.amount, found)
    if plan.approval:
        Approvals(backend).authorize(
            claim, plan.fingerprint, tool=plan.tool, reason=plan.approval_reason,
            summary=plan.summary, crew=plan.where.crew, task=plan.where.task,
            kickoff=plan.where.kickoff,
        )  # fmt: skip
    return found


def _reserve(backend: CacheBackend, plan: Plan, claim: Record, found: list[Window]) -> _Entered:
    spend = SpendLedger(backend)
    if plan.amount is not None and found:
        spend.reserve(claim.key, claim.token, plan.amount, found)
    return _Entered(spend, claim, found if plan.amount is not None else [])


def enter(backend: CacheBackend, plan: Plan) -> _Entered:
    """Pass the gates for the current claim (waiting for a decision if the plan says so)."""
    claim = _claim()
    deadline = time.monotonic() + plan.approval_wait_s
    pause = _POLL_FIRST_S
    while True:
        try:
            found = _check_and_authorize(backend, plan, claim)
            break
        except ApprovalRequired:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX_S)
    return _reserve(backend, plan, claim, found)


async def aenter(backend: CacheBackend, plan: Plan) -> _Entered:
    """`enter` for the event loop: store calls on a worker thread, waits as asyncio sleeps."""
    claim = _claim()
    deadline = time.monotonic() + plan.approval_wait_s
    pause = _POLL_FIRST_S
    while True:
        try:
            found = await asyncio.to_thread(_check_and_authorize, backend, plan, claim)
            break
        except ApprovalRequired:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX_S)
    return await asyncio.to_thread(_reserve, backend, plan, claim, found)


def run(backend: CacheBackend, plan: Plan, body: Callable[[], T]) -> T:
    """Pass the gates, run `body`, settle the reservation by how it ended."""
    if not plan.gated:
        return body()
    entered = enter(backend, plan)
    try:
        value = body()
    except BaseException as exc:
        entered.done(exc)
        raise
    entered.done(None)
    return value


async def arun(backend: CacheBackend, plan: Plan, body: Callable[[], Awaitable[T]]) -> T:
    if not plan.gated:
        return await body()
    entered = await aenter(backend, plan)
    try:
        value = await body()
    except BaseException as exc:
        await asyncio.to_thread(entered.done, exc)
        raise
    await asyncio.to_thread(entered.done, None)
    return value
