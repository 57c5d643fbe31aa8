"""Approval requests bound to the call's key and fingerprint, decided from any process.

Effects are counted at the fake provider (tests/support/faults/provider.py). Races and crashes use
real processes (fork, SIGKILL).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import CacheBackend, Ledger, Status, backend_from_url
from crewai_idempotent._errors import (
    ApprovalDenied,
    ApprovalRequired,
    IdempotencyKeyConflict,
    OutcomeUncertain,
    SpendCapExceeded,
)
from crewai_idempotent.gates._approvals import (
    ApprovalAlreadyDecided,
    ApprovalNotFound,
    Approvals,
    ApprovalState,
    add_listener,
    remove_listener,
    request_id,
    summarize,
)
from crewai_idempotent.gates._plan import Plan
from crewai_idempotent.gates._spend import Money, SpendCap, SpendLedger, Where
from crewai_idempotent.ledger._record import _whoami
from crewai_idempotent.notifications import Outbox
from tests.support.approver import approve_first_pending
from tests.support.clock import ManualClock
from tests.support.faults.provider import Provider
from tests.support.forked_race import fork_together
from tests.support.stores import DURABLE_BACKENDS

PROCESSES = 16


@pytest.fixture(params=DURABLE_BACKENDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _plan(cents: int, **extra: Any) -> Plan:
    return Plan(
        tool="pay_invoice",
        fingerprint=f"fp-{cents}",
        approval=True,
        approval_reason="amount_cents > 50000",
        summary={"amount_cents": cents},
        where=Where(kickoff="k1", crew="c1", task="t1"),
        **extra,
    )


def _pay(ledger: Ledger, provider: Provider, key: str, cents: int, **extra: Any) -> Any:
    plan = _plan(cents, **extra)
    return ledger.run(
        key,
        lambda: provider.charge(key),
        fingerprint=plan.fingerprint,
        stage=plan,
    )


def _in_child(fn: Any) -> int:
    """Run `fn` in a forked child; its exit code."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            fn()
            code = 0
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _approve_elsewhere(url: str, rid: str, **options: Any) -> None:
    def approve() -> None:
        backend = backend_from_url(url)
        Approvals(backend).approve(rid, by="ops@example", reason="checked the invoice", **options)
        backend.close()

    assert _in_child(approve) == 0


def test_sixteen_processes_create_one_request_then_an_approval_runs_it_once(
    backend_url: str, backend: CacheBackend, tmp_path: Path
) -> None:
    provider = Provider.create(tmp_path / "effects")
    out = tmp_path / "out"

    def pay_big_invoice(gate: int) -> None:  # pragma: no cover - runs in the child
        ledger = Ledger(backend_from_url(backend_url), wait_s=30.0)
        os.read(gate, 1)
        try:
            _pay(ledger, Provider(provider.path), "inv-big", 90_000)
            verdict = "ran"
        except ApprovalRequired as exc:
            verdict = exc.request_id
        fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, f"{verdict}\n".encode())
        os.close(fd)
        ledger.close()

    codes = fork_together([pay_big_invoice] * PROCESSES)
    assert all(code == 0 for code in codes)

    rid = request_id("inv-big", "fp-90000")
    assert out.read_text().split() == [rid] * PROCESSES
    assert provider.effects() == []
    approvals = Approvals(backend)
    (request,) = approvals.list()
    assert request.id == rid and request.state is ApprovalState.PENDING
    assert [e["what"] for e in request.history] == ["requested"]
    assert request.summary == {"amount_cents": 90_000} and request.kickoff == "k1"
    # Sixteen processes asked, one request was made: one entry for a person, not sixteen
    # (the losers' entries, if any, wait for writes that never landed: never delivered).
    (asked,) = Outbox(backend).entries()
    assert (asked.type, asked.data["id"], asked.data["round"]) == ("approval.requested", rid, 1)

    _approve_elsewhere(backend_url, rid)
    decided = approvals.get(rid)
    assert decided.state is ApprovalState.APPROVED and decided.decided_by == "ops@example"
    assert decided.decision_reason == "checked the invoice"

    ledger = Ledger(backend)
    receipt = _pay(ledger, provider, "inv-big", 90_000)  # the re-kickoff
    for _ in range(3):
        assert _pay(ledger, provider, "inv-big", 90_000) == receipt  # replays
    assert provider.receipts("inv-big") == [receipt]
    assert approvals.get(rid).state is ApprovalState.USED


def test_different_arguments_after_approval_are_a_new_request(
    backend: CacheBackend, tmp_path: Path
) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger = Ledger(backend)
    approvals = Approvals(backend)
    with pytest.raises(ApprovalRequired) as first:
        _pay(ledger, provider, "inv-7", 60_000)
    approvals.approve(first.value.request_id, by="ops")
    # The same key with another amount: never covered by the grant for 60 000.
    with pytest.raises((ApprovalRequired, IdempotencyKeyConflict)) as other:
        _pay(ledger, provider, "inv-7", 95_000)
    if isinstance(other.value, ApprovalRequired):
        assert other.value.request_id != first.value.request_id
    # Another key (a key derived from the arguments) with another amount: a new request.
    with pytest.raises(ApprovalRequired) as third:
        _pay(ledger, provider, "inv-7-b", 95_000)
    assert third.value.request_id != first.value.request_id
    assert provider.effects() == []
    assert approvals.get(first.value.request_id).state is ApprovalState.APPROVED


def test_a_denied_request_never_runs(backend: CacheBackend, tmp_path: Path) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger = Ledger(backend)
    approvals = Approvals(backend)
    with pytest.raises(ApprovalRequired) as asked:
        _pay(ledger, provider, "inv-9", 70_000)
    approvals.deny(asked.value.request_id, by="cfo", reason="duplicate invoice")
    for _ in range(3):
        with pytest.raises(ApprovalDenied, match="duplicate invoice") as denied:
            _pay(ledger, provider, "inv-9", 70_000)
        assert denied.value.by == "cfo"
    with pytest.raises(ApprovalAlreadyDecided):
        approvals.approve(asked.value.request_id, by="someone else")
    assert provider.effects() == []
    record = ledger.get("inv-9")
    assert record is not None and record.status is Status.FAILED


def test_an_expired_approval_is_refused_and_asked_again(
    backend: CacheBackend, tmp_path: Path
) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger = Ledger(backend)
    approvals = Approvals(backend)
    with pytest.raises(ApprovalRequired) as asked:
        _pay(ledger, provider, "inv-3", 80_000)
    rid = asked.value.request_id
    approvals.approve(rid, by="ops", ttl_s=0.2)
    time.sleep(0.5)
    with pytest.raises(ApprovalRequired, match="expired"):
        _pay(ledger, provider, "inv-3", 80_000)
    again = approvals.get(rid)
    assert again.state is ApprovalState.PENDING and again.round == 2
    assert provider.effects() == []
    approvals.approve(rid, by="ops")
    _pay(ledger, provider, "inv-3", 80_000)
    assert len(provider.receipts("inv-3")) == 1


def test_sigkill_after_approval_before_the_body_loses_nothing(
    backend_url: str, backend: CacheBackend, tmp_path: Path
) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger = Ledger(backend, lease_s=0.5)
    approvals = Approvals(backend)
    with pytest.raises(ApprovalRequired) as asked:
        _pay(ledger, provider, "inv-5", 75_000)
    approvals.approve(asked.value.request_id, by="ops")

    def killed_before_the_effect() -> None:
        child = Ledger(backend_from_url(backend_url), lease_s=0.5)
        plan = _plan(75_000)

        def body() -> str:
            os.kill(os.getpid(), signal.SIGKILL)  # the gates passed; the charge never starts
            return provider.charge("inv-5")

        child.run("inv-5", body, fingerprint=plan.fingerprint, stage=plan)

    assert _in_child(killed_before_the_effect) == -signal.SIGKILL
    assert approvals.get(asked.value.request_id).state is ApprovalState.USED
    time.sleep(1.0)  # the dead owner's lease lapses
    with pytest.raises(OutcomeUncertain):  # the ledger cannot know the body never started
        _pay(ledger, provider, "inv-5", 75_000)
    ledger.resolve("inv-5", absent=True, by="ops", reason="no charge at the provider")
    receipt = _pay(ledger, provider, "inv-5", 75_000)  # the same grant, no new request
    assert _pay(ledger, provider, "inv-5", 75_000) == receipt
    assert provider.receipts("inv-5") == [receipt]
    assert approvals.get(asked.value.request_id).round == 1


def test_a_grant_used_by_a_run_that_committed_is_not_used_again(
    backend: CacheBackend, tmp_path: Path
) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger = Ledger(backend, ttl=0.3)
    approvals = Approvals(backend)
    with pytest.raises(ApprovalRequired) as asked:
        _pay(ledger, provider, "inv-6", 55_000)
    approvals.approve(asked.value.request_id, by="ops")
    _pay(ledger, provider, "inv-6", 55_000)
    time.sleep(0.6)  # the receipt expires: the key may run again, but not on the old grant
    with pytest.raises(ApprovalRequired, match="used"):
        _pay(ledger, provider, "inv-6", 55_000)
    assert len(provider.receipts("inv-6")) == 1


def test_a_call_over_the_cap_is_refused_without_asking(
    backend: CacheBackend, tmp_path: Path
) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger = Ledger(backend)
    caps = [("pay_invoice", SpendCap(100_000, "EUR", per="kickoff"))]
    with pytest.raises(SpendCapExceeded):
        _pay(ledger, provider, "inv-huge", 150_000, amount=Money(150_000, "EUR"), caps=caps)
    assert Approvals(backend).list() == []
    # Within the cap but over the threshold: asks, and once approved runs and counts.
    with pytest.raises(ApprovalRequired) as asked:
        _pay(ledger, provider, "inv-ok", 90_000, amount=Money(90_000, "EUR"), caps=caps)
    assert SpendLedger(backend).budgets() == []  # nothing reserved while waiting
    Approvals(backend).approve(asked.value.request_id, by="ops")
    _pay(ledger, provider, "inv-ok", 90_000, amount=Money(90_000, "EUR"), caps=caps)
    ((budget),) = SpendLedger(backend).budgets()
    assert (budget.committed, budget.reserved) == (90_000, 0)
    assert [e["key"] for e in provider.effects()] == ["inv-ok"]


def test_waiting_mode_runs_once_the_approval_arrives(
    backend_url: str, backend: CacheBackend, tmp_path: Path
) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger = Ledger(backend)
    rid = request_id("inv-w", "fp-65000")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the operator, in another process
        code = 1
        try:
            other = Approvals(backend_from_url(backend_url))
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    other.approve(rid, by="ops")
                    code = 0
                    break
                except ApprovalNotFound:
                    time.sleep(0.05)
        finally:
            os._exit(code)
    receipt = _pay(ledger, provider, "inv-w", 65_000, approval_wait_s=30.0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert provider.receipts("inv-w") == [receipt]


def test_waiting_mode_gives_up_after_approval_wait_s(backend: CacheBackend, tmp_path: Path) -> None:
    provider = Provider.create(tmp_path / "effects")
    clock = ManualClock()  # the gates wait on the ledger's clock: a minute passes at once
    ledger = Ledger(backend, clock=clock)
    with pytest.raises(ApprovalRequired):
        _pay(ledger, provider, "inv-x", 65_000, approval_wait_s=60.0)
    assert clock.offset > 59.0  # it waited the minute out (less the real time it took)
    assert provider.effects() == []


def test_operator_errors_are_specific(backend: CacheBackend) -> None:
    approvals = Approvals(backend)
    with pytest.raises(ValueError, match="not an approval request id"):
        approvals.get("42")
    with pytest.raises(ApprovalNotFound):
        approvals.approve("ap_" + "0" * 20, by="ops")
    with pytest.raises(ValueError, match="by="):
        approvals.deny("ap_" + "0" * 20, by=" ")
    with pytest.raises(ValueError, match="ttl_s"):
        approvals.approve("ap_" + "0" * 20, by="ops", ttl_s=0)


def test_listeners_hear_created_and_decided(backend: CacheBackend, tmp_path: Path) -> None:
    heard: list[tuple[str, str]] = []

    def listener(kind: str, request: Any) -> None:
        heard.append((kind, request.state.value))

    add_listener(listener)
    try:
        provider = Provider.create(tmp_path / "effects")
        ledger = Ledger(backend)
        with pytest.raises(ApprovalRequired) as asked:
            _pay(ledger, provider, "inv-l", 51_000)
        with pytest.raises(ApprovalRequired):
            _pay(ledger, provider, "inv-l", 51_000)  # still pending: no second "created"
        Approvals(backend).approve(asked.value.request_id, by="ops")
    finally:
        remove_listener(listener)
    assert heard == [("created", "PENDING"), ("decided", "APPROVED")]


def test_summaries_keep_the_whole_call_and_hide_what_they_are_told_to() -> None:
    memo = "x" * 1_000_000
    lines = [{"sku": "A-1", "qty": 2, "note": "y" * 5_000}] * 3
    summary = summarize(
        {"iban": "DE89370400440532013000", "amount_cents": 5, "memo": memo, "x": object(),
         "lines": lines, "ratio": float("nan"), "pair": (1, "two")},
        redact=("iban",),
    )  # fmt: skip
    assert summary["iban"] == "<redacted>" and summary["amount_cents"] == 5
    assert summary["memo"] == memo  # never cut: channels shorten what they display
    assert summary["lines"] == lines  # structure kept, as JSON
    assert summary["x"].startswith("<object") and summary["ratio"] == "nan"
    assert summary["pair"] == [1, "two"]


def test_async_waiting_polls_without_blocking_the_loop(
    backend: CacheBackend, tmp_path: Path
) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger = Ledger(backend)
    plan = _plan(65_000, approval_wait_s=30.0)

    async def body() -> str:
        return provider.charge("inv-async")

    async def main() -> Any:
        paid, _ = await asyncio.gather(
            ledger.arun("inv-async", body, fingerprint=plan.fingerprint, stage=plan),
            approve_first_pending(backend, poll_s=0.02),  # on the waiting call's loop
        )
        return paid

    receipt = asyncio.run(main())
    assert provider.receipts("inv-async") == [receipt]


def test_cli_decides_and_reports_errors_clearly(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from crewai_idempotent import SQLiteCacheBackend
    from crewai_idempotent.cli import main as cli

    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path)
    provider = Provider.create(tmp_path / "effects")
    ledger = Ledger(backend)
    with pytest.raises(ApprovalRequired) as asked:
        _pay(ledger, provider, "inv-cli", 70_000)
    rid = asked.value.request_id
    url = f"sqlite:///{path}"

    def invoke(*args: str) -> Any:
        return CliRunner().invoke(cli, ["--ledger", url, *args], catch_exceptions=False)

    listed = invoke("approvals", "ls", "--json")
    assert listed.exit_code == 0 and [r["id"] for r in json.loads(listed.output)] == [rid]
    missing_reason = invoke("approvals", "deny", rid)
    assert missing_reason.exit_code == 2 and "--reason" in missing_reason.output
    typed = invoke("approvals", "deny", rid, "--reason", "not ours", "--by", "cfo")
    assert typed.exit_code == 2 and "not a typed name" in typed.output
    assert Approvals(backend).get(rid).state is ApprovalState.PENDING
    me = _whoami()
    denied = invoke("approvals", "deny", rid, "--reason", "not ours")
    assert denied.exit_code == 0 and f"DENIED by {me}" in denied.output
    assert Approvals(backend).get(rid).history[-1]["via"] == "cli"
    again = invoke("approvals", "approve", rid)
    assert again.exit_code == 1 and f"is DENIED (by {me})" in again.output
    unknown = invoke("approvals", "show", "ap_" + "f" * 20)
    assert unknown.exit_code == 1 and "no approval request" in unknown.output
    malformed = invoke("approvals", "approve", "42")
    assert malformed.exit_code == 1 and "not an approval request id" in malformed.output
    bad_ttl = invoke("approvals", "approve", rid, "--ttl", "0")
    assert bad_ttl.exit_code == 2
    with pytest.raises(ApprovalDenied):
        _pay(ledger, provider, "inv-cli", 70_000)
    assert provider.effects() == []
    spent = invoke("spend", "--json")
    assert spent.exit_code == 0 and json.loads(spent.output) == []
