"""The two-person rule: N distinct approvers before a grant is live, and the request's other
promises (bound to the call, used once) kept with it.

Effects are counted at the fake provider (tests/support/faults/provider.py); time moves on a
`ManualClock` the test advances (tests/support/clock.py), never by sleeping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import CacheBackend, Ledger
from crewai_idempotent._errors import ApprovalDenied, ApprovalRequired
from crewai_idempotent.gates._approvals import (
    ApprovalAlreadyDecided,
    ApprovalMovedOn,
    ApprovalNeedsAnother,
    Approvals,
    ApprovalState,
)
from crewai_idempotent.gates._plan import Plan
from crewai_idempotent.gates._spend import Where
from tests.support.clock import ClockedBackend, ManualClock
from tests.support.faults.provider import Provider
from tests.support.stores import DURABLE_BACKENDS


@pytest.fixture(params=DURABLE_BACKENDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(backend: CacheBackend, clock: ManualClock) -> CacheBackend:
    return ClockedBackend(backend, clock)


def _plan(approvers: int = 2, cents: int = 90_000) -> Plan:
    return Plan(
        tool="pay_invoice",
        fingerprint=f"fp-{cents}",
        approval=True,
        approval_reason="large payment",
        summary={"amount_cents": cents},
        where=Where(kickoff="k1", crew="c1", task="t1"),
        approvers=approvers,
        origin={"crew": "Payments", "task": "Pay the invoices", "agent": "Cashier"},
    )


def _pay(ledger: Ledger, provider: Provider, key: str, approvers: int = 2) -> Any:
    plan = _plan(approvers)
    return ledger.run(key, lambda: provider.charge(key), fingerprint=plan.fingerprint, stage=plan)


def _forget_receipt(store: CacheBackend, key: str) -> None:
    """The key's record gone (as a receipt whose TTL passed is purged); its request stays."""
    record = store.get(key)
    assert record is not None and store.delete(record)


def _asked(ledger: Ledger, provider: Provider, key: str, approvers: int = 2) -> str:
    with pytest.raises(ApprovalRequired) as asked:
        _pay(ledger, provider, key, approvers)
    return asked.value.request_id


def test_two_distinct_approvers_then_it_runs_once(store: CacheBackend, tmp_path: Path) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger, approvals = Ledger(store), Approvals(store)
    rid = _asked(ledger, provider, "inv-2p")
    request = approvals.get(rid)
    assert request.approvers_needed == 2 and request.approvals == ()
    assert request.origin == {"crew": "Payments", "task": "Pay the invoices", "agent": "Cashier"}

    one = approvals.approve(rid, by="alice", reason="invoice checked", via="console")
    assert one.state is ApprovalState.PENDING and [a["by"] for a in one.approvals] == ["alice"]
    with pytest.raises(ApprovalRequired, match="1 of 2 approvers"):
        _pay(ledger, provider, "inv-2p")
    with pytest.raises(ApprovalNeedsAnother, match="alice has already approved"):
        approvals.approve(rid, by="alice")
    assert provider.effects() == []

    two = approvals.approve(rid, by="bob", reason="budget ok", via="slack")
    assert two.state is ApprovalState.APPROVED and two.decided_by == "alice, bob"
    assert two.decision_reason == "alice: invoice checked; bob: budget ok"
    assert [(e["what"], e["by"], e.get("via")) for e in two.history[1:]] == [
        ("approved", "alice", "console"),
        ("approved", "bob", "slack"),
    ]
    receipt = _pay(ledger, provider, "inv-2p")
    assert _pay(ledger, provider, "inv-2p") == receipt  # a replay: nothing asked, nothing run
    assert provider.receipts("inv-2p") == [receipt]
    assert approvals.get(rid).state is ApprovalState.USED


def test_a_new_round_needs_two_again(store: CacheBackend, tmp_path: Path) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger, approvals = Ledger(store), Approvals(store)
    rid = _asked(ledger, provider, "inv-round")
    approvals.approve(rid, by="alice")
    approvals.approve(rid, by="bob")
    _pay(ledger, provider, "inv-round")
    # The receipt goes; the same call under a new record needs a new grant.
    _forget_receipt(store, "inv-round")
    with pytest.raises(ApprovalRequired, match="used by a run that finished"):
        _pay(ledger, provider, "inv-round")
    again = approvals.get(rid)
    assert again.state is ApprovalState.PENDING and again.round == 2 and again.approvals == ()
    approvals.approve(rid, by="alice")
    with pytest.raises(ApprovalRequired, match="1 of 2"):
        _pay(ledger, provider, "inv-round")
    approvals.approve(rid, by="carol")
    _pay(ledger, provider, "inv-round")
    assert len(provider.receipts("inv-round")) == 2  # one per round, each approved by two


def test_an_approval_that_lapsed_before_the_second_does_not_count(
    store: CacheBackend, clock: ManualClock, tmp_path: Path
) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger, approvals = Ledger(store), Approvals(store)
    rid = _asked(ledger, provider, "inv-lapse")
    approvals.approve(rid, by="alice", ttl_s=60)
    clock.advance(61)
    late = approvals.approve(rid, by="bob", ttl_s=3600)
    assert late.state is ApprovalState.PENDING and [a["by"] for a in late.approvals] == ["bob"]
    # alice again counts now: her first approval had lapsed
    approvals.approve(rid, by="alice", ttl_s=600)
    granted = approvals.get(rid)
    assert granted.state is ApprovalState.APPROVED
    assert granted.grant_expires_at == pytest.approx(store.now() + 600, abs=5)
    clock.advance(601)  # the grant lasts until the earliest approver's deadline
    with pytest.raises(ApprovalRequired, match="expired"):
        _pay(ledger, provider, "inv-lapse")
    assert provider.effects() == []


def test_one_denial_denies_whatever_was_approved(store: CacheBackend, tmp_path: Path) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger, approvals = Ledger(store), Approvals(store)
    rid = _asked(ledger, provider, "inv-deny")
    approvals.approve(rid, by="alice")
    denied = approvals.deny(rid, by="bob", reason="duplicate invoice")
    assert denied.state is ApprovalState.DENIED and denied.decided_by == "bob"
    with pytest.raises(ApprovalAlreadyDecided):
        approvals.approve(rid, by="carol")
    with pytest.raises(ApprovalDenied, match="duplicate invoice"):
        _pay(ledger, provider, "inv-deny")
    assert provider.effects() == []


def test_a_decision_bound_to_a_round_is_refused_once_the_request_moved_on(
    store: CacheBackend, tmp_path: Path
) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger, approvals = Ledger(store), Approvals(store)
    rid = _asked(ledger, provider, "inv-moved", approvers=1)
    approvals.approve(rid, by="alice", round=1)
    _pay(ledger, provider, "inv-moved", approvers=1)
    _forget_receipt(store, "inv-moved")
    with pytest.raises(ApprovalRequired):
        _pay(ledger, provider, "inv-moved", approvers=1)
    # A page (or a Slack message) showing round 1 cannot approve round 2.
    with pytest.raises(ApprovalMovedOn, match="round 2 now, not 1"):
        approvals.approve(rid, by="bob", round=1)
    with pytest.raises(ApprovalMovedOn):
        approvals.deny(rid, by="bob", round=1)
    assert approvals.get(rid).state is ApprovalState.PENDING
    assert len(provider.receipts("inv-moved")) == 1


def test_a_rule_made_stricter_takes_back_a_grant_short_of_it(
    store: CacheBackend, tmp_path: Path
) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger, approvals = Ledger(store), Approvals(store)
    rid = _asked(ledger, provider, "inv-strict", approvers=1)
    approvals.approve(rid, by="alice")
    # The configuration now says two: alice's grant alone is not live any more.
    with pytest.raises(ApprovalRequired, match="1 of 2"):
        _pay(ledger, provider, "inv-strict", approvers=2)
    request = approvals.get(rid)
    assert request.state is ApprovalState.PENDING and request.approvers_needed == 2
    assert [a["by"] for a in request.approvals] == ["alice"]
    # ... and a looser configuration later does not lower what the request needs.
    with pytest.raises(ApprovalRequired):
        _pay(ledger, provider, "inv-strict", approvers=1)
    approvals.approve(rid, by="bob")
    _pay(ledger, provider, "inv-strict", approvers=1)
    assert len(provider.receipts("inv-strict")) == 1


def test_one_approver_is_the_old_behaviour(store: CacheBackend, tmp_path: Path) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger, approvals = Ledger(store), Approvals(store)
    rid = _asked(ledger, provider, "inv-one", approvers=1)
    granted = approvals.approve(rid, by="ops", reason="fine", ttl_s=120)
    assert granted.state is ApprovalState.APPROVED and granted.decided_by == "ops"
    assert granted.decision_reason == "fine"
    assert granted.grant_expires_at == pytest.approx(store.now() + 120, abs=5)
    _pay(ledger, provider, "inv-one", approvers=1)
    assert len(provider.receipts("inv-one")) == 1


@pytest.mark.parametrize("backend_kind", ["memory"])
def test_bad_approver_counts_are_refused(store: CacheBackend) -> None:
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="approvers must be a whole number"):
            _plan(bad)  # type: ignore[arg-type]
