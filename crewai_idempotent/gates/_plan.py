"""Spend caps and approvals: the stage the ledger drives between a claim and its body.

`Plan` is a `Stage` (`_steps`): the ledger enters it once the claim is durable and
before the body starts, so the claim's holder is the only caller of its key here and
deciding per key needs no lock of its own. Every refusal raises before the body starts;
the ledger then records the claim FAILED (nothing ran), which is what lets the next
attempt, after an approval or once the budget allows, run the body. In order:

1. spend caps, read only: a call over a cap is refused before anyone is asked to approve;
2. approval: the grant for this key and fingerprint is used, or `ApprovalRequired` /
   `ApprovalDenied` is raised (optionally waiting `approval_wait_s` for a decision, on
   the ledger's clock); with `trusted_keys`, a grant whose approvals do not all verify
   and match this call is `DecisionRefused` (`_approvals.Approvals.authorize`);
3. spend caps, for good: the amount is reserved in every cap window by compare-and-set;
4. the body; then, once its outcome is recorded, the reservation becomes spent (it
   returned), is released (it failed before any effect: FAILED), or is kept (its outcome
   is unknown: UNCERTAIN).

Each store operation is one `_Call` step: the sync driver runs it in the caller's
thread, the async one on the ledger's pools.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import signing
from .._errors import ApprovalRequired, SpendCapExceeded
from ..ledger._backend import CacheBackend
from ..ledger._record import Record, Status
from ..ledger._steps import Settled, Step, _Call, _Sleep
from ..notifications import _outbox
from ._approvals import Approvals
from ._spend import Money, SpendCap, SpendLedger, Where, Window, windows

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
    approvers: int = 1  # distinct approvers before a grant is live (the two-person rule)
    origin: Mapping[str, Any] = field(default_factory=dict)  # crew, task, agent by name
    # Signed approvals: the keys a grant's approvals must verify against (None: unsigned
    # grants are used as written), and until when unsigned ones still count.
    trusted_keys: signing.TrustedKeys | None = None
    accept_unsigned_grants_until: float | None = None

    def __post_init__(self) -> None:
        count = self.approvers
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"approvers must be a whole number, 1 or more, not {count!r}")

    @property
    def gated(self) -> bool:
        return self.approval or (self.amount is not None and bool(self.caps))

    def enter(
        self, claim: Record, backend: CacheBackend, monotonic: Callable[[], float]
    ) -> Step[_Reserved | None]:
        """Pass the gates for `claim` (waiting for a decision if the plan says so)."""
        deadline = monotonic() + self.approval_wait_s
        pause = _POLL_FIRST_S
        while True:
            try:
                found = yield _Call(_check_and_authorize, backend, self, claim)
                break
            except ApprovalRequired:
                left = deadline - monotonic()
                if left <= 0:
                    raise
                yield _Sleep(min(pause, left))
                pause = min(pause * 2, _POLL_MAX_S)
            except SpendCapExceeded as refused:
                yield _Call(_note_refusal, backend, self, claim, refused)
                raise
        if self.amount is None or not found:
            return None
        try:
            yield _Call(SpendLedger(backend).reserve, claim.key, claim.token, self.amount, found)
        except SpendCapExceeded as refused:
            yield _Call(_note_refusal, backend, self, claim, refused)
            raise
        return _Reserved(claim.key, claim.token, found)

    def settle(
        self, entered: _Reserved | None, settled: Settled, backend: CacheBackend
    ) -> Step[None]:
        """The reservation becomes spent or is released; kept while the outcome is unknown."""
        if entered is None or settled.status is Status.UNCERTAIN:
            return  # nothing reserved, or the money may be gone: kept until it is resolved
        spent = settled.status is Status.COMMITTED
        # A failure here leaves the entry reserved: it is settled from the key's record by
        # the next call that needs the room, or by `crewai-idempotent spend`.
        yield _Call(_settle, backend, entered, spent)


@dataclass(frozen=True, slots=True)
class _Reserved:
    """What a claim holds in the cap windows until its outcome is known."""

    key: str
    token: int
    windows: list[Window]


def _check_and_authorize(backend: CacheBackend, plan: Plan, claim: Record) -> list[Window]:
    found: list[Window] = []
    spend: dict[str, Any] | None = None  # the amount against each cap, for the approver
    amount = plan.amount
    if amount is not None:
        standing: list[dict[str, Any]] = []
        if plan.caps:
            found = windows(plan.caps, plan.where, backend.now())
            standing = SpendLedger(backend).check(claim.key, amount, found)
        spend = {"amount": amount.amount, "currency": amount.currency, "caps": standing}
    if plan.approval:
        approvals = Approvals(
            backend, trusted_keys=plan.trusted_keys,
            accept_unsigned_grants_until=plan.accept_unsigned_grants_until,
        )  # fmt: skip
        approvals.authorize(
            claim, plan.fingerprint, tool=plan.tool, reason=plan.approval_reason,
            summary=plan.summary, crew=plan.where.crew, task=plan.where.task,
            kickoff=plan.where.kickoff, spend=spend, approvers=plan.approvers,
            origin=plan.origin,
        )  # fmt: skip
    return found


def _note_refusal(
    backend: CacheBackend, plan: Plan, claim: Record, refused: SpendCapExceeded
) -> None:
    """A spend cap refused the call: one "spend.refused" entry per call and cap window
    (an agent retrying the same call is not news). Never in the way of the refusal: if
    the store cannot take it, the refusal is raised all the same."""
    data = {
        "key": claim.key, "tool": plan.tool, "fingerprint": plan.fingerprint,
        "cap": refused.cap, "amount": refused.amount, "currency": refused.currency,
        "limit": refused.limit, "committed": refused.spent, "reserved": refused.reserved,
        "summary": dict(plan.summary), "crew": plan.where.crew, "task": plan.where.task,
        "kickoff": plan.where.kickoff, "message": str(refused),
    }  # fmt: skip
    dedupe = f"{claim.key}\x00{plan.fingerprint}\x00{refused.cap}"
    try:
        _outbox.put(backend, "spend.refused", data, subject=claim.key, dedupe=dedupe)
    except Exception:  # the refusal stands; the store's failure is logged
        logging.getLogger("crewai_idempotent").exception(
            "could not put the refusal of %r in the outbox", claim.key
        )


def _settle(backend: CacheBackend, reserved: _Reserved, spent: bool) -> None:
    SpendLedger(backend).settle(reserved.key, reserved.token, reserved.windows, spent=spent)
