"""The outbox's entries are written with the transitions that cause them: one per
transition that happened, none for a write that lost its race or never landed.

Every durable backend, in process; real processes and SIGKILL are in test_outbox_kill.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import (
    Absent,
    CacheBackend,
    Ledger,
    OutcomeUncertain,
    OutcomeUnknown,
    Record,
    Status,
)
from crewai_idempotent._errors import ApprovalRequired, SpendCapExceeded
from crewai_idempotent.gates._approvals import Approvals
from crewai_idempotent.gates._plan import Plan
from crewai_idempotent.gates._spend import Money, SpendCap, SpendLedger, Where
from crewai_idempotent.notifications import Outbox, alert, put
from crewai_idempotent.notifications._outbox import OUTBOX, confirmation, doc_of
from tests.support.clock import ClockedBackend, ManualClock
from tests.support.faults.provider import Provider
from tests.support.stores import DURABLE_BACKENDS


@pytest.fixture(params=["memory", *DURABLE_BACKENDS])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider.create(tmp_path / "effects")


def _types(backend: CacheBackend) -> list[str]:
    return [entry.type for entry in Outbox(backend).entries()]


def _plan(cents: int, **extra: Any) -> Plan:
    return Plan(
        tool="pay_invoice", fingerprint=f"fp-{cents}", approval=True,
        approval_reason="amount_cents > 50000",
        summary={"invoice": "INV-9", "amount_cents": cents, "memo": "m" * 10_000},
        where=Where(kickoff="k1", crew="c1", task="t1"), **extra,
    )  # fmt: skip


def _pay(ledger: Ledger, provider: Provider, key: str, plan: Plan) -> Any:
    return ledger.run(key, lambda: provider.charge(key), fingerprint=plan.fingerprint, stage=plan)


def _unknown() -> Any:
    raise OutcomeUnknown("the gateway timed out after accepting the charge")


def test_an_uncertain_outcome_and_its_resolution_are_one_entry_each(backend: CacheBackend) -> None:
    ledger = Ledger(backend)
    with pytest.raises(OutcomeUnknown):
        ledger.run("charge:1", _unknown)
    with pytest.raises(OutcomeUncertain):
        ledger.run("charge:1", _unknown)  # still uncertain: nothing new for a person
    (entry,) = Outbox(backend).entries()
    assert (entry.type, entry.subject, entry.state) == ("record.uncertain", "charge:1", "due")
    assert entry.data["status"] == "UNCERTAIN" and "timed out" in entry.data["error"]
    ledger.resolve("charge:1", result="ch_1", by="ops", reason="in the dashboard")
    assert _types(backend) == ["record.uncertain", "record.resolved"]
    resolved = Outbox(backend).entries()[1]
    assert resolved.data["by"] == "ops" and resolved.data["status"] == "COMMITTED"
    assert resolved.data["previous"] == "UNCERTAIN"


def test_a_stale_claim_marked_uncertain_and_reconciled_absent(backend: CacheBackend) -> None:
    clock = ManualClock()
    clocked = ClockedBackend(backend, clock)
    ledger = Ledger(clocked, lease_s=5.0, clock=clock)
    now = clocked.now()
    stale = Record(
        "charge:2", Status.PENDING, "", 1, 1, None, 1, now, now, now - 1,
        history=(),
    )  # fmt: skip
    assert clocked.insert(stale) is None
    clock.advance(10)
    with pytest.raises(OutcomeUncertain):
        ledger.run("charge:2", lambda: "never")
    assert _types(backend) == ["record.uncertain"]
    assert ledger.run("charge:2", lambda: "ran", reconcile=lambda key, args: Absent()) == "ran"
    assert _types(backend) == ["record.uncertain", "record.resolved"]
    assert Outbox(backend).entries()[1].data["event"] == "takeover"


def test_a_failure_or_a_commit_puts_nothing_in_the_outbox(backend: CacheBackend) -> None:
    ledger = Ledger(backend)
    assert ledger.run("k", lambda: 1) == 1
    with pytest.raises(ValueError):
        ledger.run("k2", lambda: (_ for _ in ()).throw(ValueError("no")))
    assert ledger.run("k2", lambda: 2) == 2
    assert Outbox(backend).entries() == []


def test_each_approval_transition_is_one_entry(backend: CacheBackend, provider: Provider) -> None:
    clock = ManualClock()
    clocked = ClockedBackend(backend, clock)
    ledger = Ledger(clocked, clock=clock)
    plan = _plan(90_000)
    with pytest.raises(ApprovalRequired) as asked:
        _pay(ledger, provider, "inv-9", plan)
    with pytest.raises(ApprovalRequired):
        _pay(ledger, provider, "inv-9", plan)  # still pending: no second entry
    rid = asked.value.request_id
    (requested,) = Outbox(backend).entries()
    assert requested.type == "approval.requested" and requested.data["id"] == rid
    assert requested.data["summary"]["memo"] == "m" * 10_000  # the whole call
    assert (requested.data["round"], requested.data["kickoff"]) == (1, "k1")
    approvals = Approvals(clocked)
    approvals.approve(rid, by="ops", reason="checked", ttl_s=60)
    assert approvals.expire(rid, 1) is None  # not yet: nothing written
    clock.advance(61)
    assert approvals.expire(rid, 1) is not None
    assert approvals.expire(rid, 1) is None  # once
    with pytest.raises(ApprovalRequired):
        _pay(ledger, provider, "inv-9", plan)  # a new round; its expiry was already said
    assert _types(backend) == [
        "approval.requested", "approval.approved", "approval.expired", "approval.requested",
    ]  # fmt: skip
    rounds = [e.data["round"] for e in Outbox(backend).entries()]
    assert rounds == [1, 1, 1, 2]
    approvals.deny(rid, by="ops", reason="duplicate invoice")
    assert _types(backend)[-1] == "approval.denied"
    assert provider.effects() == []


def test_an_expired_grant_met_by_a_call_is_said_once(
    backend: CacheBackend, provider: Provider
) -> None:
    clock = ManualClock()
    clocked = ClockedBackend(backend, clock)
    ledger = Ledger(clocked, clock=clock)
    plan = _plan(70_000)
    with pytest.raises(ApprovalRequired) as asked:
        _pay(ledger, provider, "inv-7", plan)
    Approvals(clocked).approve(asked.value.request_id, by="ops", ttl_s=60)
    clock.advance(61)
    with pytest.raises(ApprovalRequired):
        _pay(ledger, provider, "inv-7", plan)
    assert _types(backend) == [
        "approval.requested", "approval.approved", "approval.expired", "approval.requested",
    ]  # fmt: skip


def test_the_request_keeps_the_amount_against_each_cap(
    backend: CacheBackend, provider: Provider
) -> None:
    ledger = Ledger(backend)
    cap = SpendCap(200_000, "EUR", per="kickoff")
    plan = _plan(90_000, amount=Money(90_000, "EUR"), caps=[("crew", cap)])
    with pytest.raises(ApprovalRequired) as asked:
        _pay(ledger, provider, "inv-8", plan)
    request = Approvals(backend).get(asked.value.request_id)
    assert request.spend == {
        "amount": 90_000, "currency": "EUR",
        "caps": [{"cap": "crew/kickoff-EUR/kickoff-k1", "limit": 200_000, "committed": 0,
                  "reserved": 0}],
    }  # fmt: skip
    assert Outbox(backend).entries()[0].data["spend"] == request.spend


def test_a_refusal_is_one_entry_per_call_and_window(
    backend: CacheBackend, provider: Provider
) -> None:
    ledger = Ledger(backend)
    cap = SpendCap(100_00, "EUR", per="total")
    plan = Plan(
        tool="pay_invoice", fingerprint="fp-big", amount=Money(150_00, "EUR"),
        caps=[("crew", cap)], summary={"invoice": "INV-1"},
    )  # fmt: skip
    for _ in range(3):  # an agent retrying the same call
        with pytest.raises(SpendCapExceeded):
            _pay(ledger, provider, "inv-1", plan)
    (entry,) = Outbox(backend).entries()
    assert entry.type == "spend.refused" and entry.subject == "inv-1"
    assert (entry.data["amount"], entry.data["limit"], entry.data["cap"]) == (
        150_00, 100_00, "crew/total-EUR/total",
    )  # fmt: skip
    assert entry.data["summary"] == {"invoice": "INV-1"}
    assert provider.effects() == []


def test_a_cap_window_warns_once_when_it_passes_its_share(
    backend: CacheBackend, provider: Provider
) -> None:
    ledger = Ledger(backend)
    cap = SpendCap(100_00, "EUR", per="total", warn_at=0.8)

    def pay(key: str, cents: int) -> Any:
        plan = Plan(
            tool="pay", fingerprint=f"fp-{key}", amount=Money(cents, "EUR"),
            caps=[("crew", cap)],
        )  # fmt: skip
        return _pay(ledger, provider, key, plan)

    pay("a", 50_00)
    assert _types(backend) == []
    pay("b", 35_00)  # 85 of 100: past 80%
    pay("c", 10_00)  # 95: already said
    (entry,) = Outbox(backend).entries()
    assert entry.type == "spend.threshold"
    assert (entry.data["share"], entry.data["key"], entry.data["cap"]) == (
        0.8, "b", "crew/total-EUR/total",
    )  # fmt: skip
    assert entry.data["committed"] + entry.data["reserved"] == 85_00
    assert SpendLedger(backend).budgets()[0].committed == 95_00


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, True, "80%"])
def test_a_warning_share_outside_0_to_1_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="warn_at"):
        SpendCap(100, "EUR", warn_at=bad)


class _LosesTheNextWrite(CacheBackend):
    """A store where another writer gets in first, once: the next `replace` of `key`
    finds the record changed (as a concurrent writer would leave it)."""

    def __init__(self, inner: CacheBackend, key: str, other: Any) -> None:
        self.inner, self.key, self.other = inner, key, other
        self.read_first, self.host_clock = inner.read_first, inner.host_clock

    def now(self) -> float:
        return self.inner.now()

    def insert(self, record: Record) -> Record | None:
        return self.inner.insert(record)

    def replace(self, current: Record, new: Record) -> bool:
        if current.key == self.key and self.other is not None:
            other, self.other = self.other, None
            other(self.inner)
        return self.inner.replace(current, new)

    def get(self, key: str) -> Record | None:
        return self.inner.get(key)

    def scan(self, status: Status | None = None) -> Any:
        return self.inner.scan(status)

    def scan_prefix(self, prefix: str) -> Any:
        return self.inner.scan_prefix(prefix)

    def delete(self, current: Record) -> bool:
        return self.inner.delete(current)


def test_the_entry_of_a_write_that_lost_its_race_is_never_delivered(
    backend: CacheBackend, provider: Provider
) -> None:
    ledger = Ledger(backend)
    with pytest.raises(ApprovalRequired) as asked:
        _pay(ledger, provider, "inv-5", _plan(60_000))
    rid = asked.value.request_id
    key = f"crewai-idempotent/approval/{rid}"

    def someone_denies(store: CacheBackend) -> None:
        Approvals(store).deny(rid, by="alice", reason="no")

    racing = _LosesTheNextWrite(backend, key, someone_denies)
    with pytest.raises(Exception, match="only a PENDING request can be approved"):
        Approvals(racing).approve(rid, by="bob")  # lost, re-read, refused
    assert _types(backend) == ["approval.requested", "approval.denied"]
    stored = [doc_of(r) for r in backend.scan_prefix(OUTBOX)]
    assert len(stored) == 3  # bob's entry is there, waiting for a write that lost
    (lost,) = [
        d for d in stored if d["state"] == "unconfirmed" and d["type"] == "approval.approved"
    ]
    assert confirmation(backend, lost) == "void"


def test_the_same_record_entry_twice_is_one_entry(backend: CacheBackend) -> None:
    """A write the store may or may not have taken is sent again (the commit's retry
    loop): the entry of the same transition has the same id, and is inserted once."""
    ledger = Ledger(backend)
    with pytest.raises(OutcomeUnknown):
        ledger.run("charge:3", _unknown)
    record = ledger.get("charge:3")
    assert record is not None
    from crewai_idempotent.notifications._outbox import of_transition, put_entries

    held = record.evolve(None, status=Status.PENDING, revision=record.revision - 1)
    again = of_transition(held, record)
    put_entries(backend, again)
    assert _types(backend) == ["record.uncertain"]


def test_alerts_of_your_own_are_due_at_once_and_once_per_dedupe(backend: CacheBackend) -> None:
    first = alert(
        backend, "alert.stale_uncertain", "charge:1 has been uncertain for 2 h",
        "Check the provider, then resolve it.", subject="charge:1",
        fields={"age_s": 7200}, dedupe="charge:1:token-1",
    )  # fmt: skip
    again = alert(backend, "alert.stale_uncertain", "other text", dedupe="charge:1:token-1")
    assert again == first and first.state == "due"
    other = put(backend, "alert.custom", {"x": {1, 2}})  # no dedupe: a new entry each time
    assert other.data == {"x": repr({1, 2})}
    assert [e.type for e in Outbox(backend).entries()] == [
        "alert.stale_uncertain", "alert.custom",
    ]  # fmt: skip
    assert Outbox(backend).get(first.id) == first


def test_an_alert_s_text_must_be_a_string_and_nothing_is_written(backend: CacheBackend) -> None:
    with pytest.raises(TypeError, match="text must be a str, not int"):
        alert(backend, "alert.custom", "a title", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a title"):
        alert(backend, "alert.custom", "  ")
    assert Outbox(backend).entries() == []


@pytest.mark.parametrize("bad", ["Alert", "alert", "alert..x", "alert.x y", "", 3])
def test_an_entry_type_must_be_dotted_lower_case_words(backend: CacheBackend, bad: Any) -> None:
    with pytest.raises(ValueError, match="entry type"):
        put(backend, bad, {})
