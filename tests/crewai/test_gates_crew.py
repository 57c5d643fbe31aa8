"""Approval gates and spend caps in real (offline) crews: a scripted model pays invoices.

Charges are counted at the fake provider, never in log lines.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from crewai.events.event_bus import crewai_event_bus
from crewai.tools import BaseTool, tool

from crewai_idempotent import (
    ApprovalDenied,
    ApprovalRequired,
    Approvals,
    ApprovalState,
    IdempotencyConfig,
    Money,
    SpendCap,
    SpendLedger,
    backend_from_url,
    idempotent,
)
from crewai_idempotent.cli import main as cli
from crewai_idempotent.integration.approval_events import (
    ApprovalDecidedEvent,
    ApprovalRequestedEvent,
)
from crewai_idempotent.ledger._record import _whoami
from tests.support.approver import approve_first_pending
from tests.support.crewai.crews import payment_crew, scripted
from tests.support.crewai.provider import FakeProvider

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")

THRESHOLD = 50_000  # cents: above this, a payment waits for a person
SMALL_1 = {"invoice": "INV-1", "amount_cents": 20_000}
SMALL_2 = {"invoice": "INV-2", "amount_cents": 30_000}
LARGE = {"invoice": "INV-3", "amount_cents": 80_000}
FOURTH = {"invoice": "INV-4", "amount_cents": 60_000}
PER_KICKOFF = SpendCap(130_000, "EUR", per="kickoff")


def _pay_tool(charges: FakeProvider, **options: Any) -> BaseTool:
    @tool(
        "pay_invoice",
        idempotent=True,
        approval=lambda args, ctx: args["amount_cents"] > THRESHOLD,
        spend=lambda args: Money(args["amount_cents"], "EUR"),
        **options,
    )
    def pay_invoice(invoice: str, amount_cents: int) -> str:
        """Pay `amount_cents` (euro cents) for `invoice`. Returns the payment id."""
        return charges.charge(amount_cents, "supplier", invoice=invoice)

    return pay_invoice


def _paid(charges: FakeProvider) -> list[str]:
    return [effect["invoice"] for effect in charges.effects("charge")]


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


WIDE = {"COLUMNS": "400"}


def _cli(url: str, *args: str) -> str:
    result = CliRunner().invoke(cli, ["--ledger", url, *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_three_invoices_one_large_then_approve_and_a_fourth_over_the_cap(
    native: bool, charges: FakeProvider, tmp_path: Path
) -> None:
    url = _url(tmp_path)
    pay = _pay_tool(charges, caps=[PER_KICKOFF])
    requested: list[Any] = []
    with crewai_event_bus.scoped_handlers():

        @crewai_event_bus.on(ApprovalRequestedEvent)
        def heard(source: Any, event: ApprovalRequestedEvent) -> None:
            requested.append(event)

        first = scripted(
            native, [("pay_invoice", SMALL_1)], [("pay_invoice", SMALL_2)], [("pay_invoice", LARGE)]
        )
        crew, _ = payment_crew([pay], first, cache_backend=url)
        with pytest.raises(ApprovalRequired) as stopped:
            crew.kickoff()
        crewai_event_bus.flush()  # handlers run on the bus's own threads

    assert _paid(charges) == ["INV-1", "INV-2"]  # the two small ones ran
    rid = stopped.value.request_id
    assert f"approvals approve {rid}" in str(stopped.value)
    assert [e.request_id for e in requested] == [rid]
    assert requested[0].summary == LARGE

    listed = _cli(url, "approvals", "ls")
    assert rid in listed and "INV-3" in listed
    assert "APPROVED" in _cli(url, "approvals", "approve", rid, "--reason", "ok")
    assert _whoami() in _cli(url, "approvals", "show", rid)

    second = scripted(
        native,
        [("pay_invoice", SMALL_1)],
        [("pay_invoice", SMALL_2)],
        [("pay_invoice", LARGE)],
        [("pay_invoice", FOURTH)],
    )
    crew, _ = payment_crew([pay], second, cache_backend=url)
    crew.kickoff()
    # The small ones replayed (a replay counts nothing), the large one was paid once, the
    # fourth refused by the cap (80 000 + 60 000 > 130 000 in this kickoff) without asking
    # anyone, and never reached the provider.
    assert _paid(charges) == ["INV-1", "INV-2", "INV-3"]
    assert any("spend cap" in prompt for prompt in second.prompts)
    backend = backend_from_url(url)
    try:
        assert Approvals(backend).get(rid).state is ApprovalState.USED
        assert [r.id for r in Approvals(backend).list("all")] == [rid]
        budgets = {b.window: (b.committed, b.reserved) for b in SpendLedger(backend).budgets()}
    finally:
        backend.close()
    assert sorted(budgets.values()) == [(50_000, 0), (80_000, 0)]  # one window per kickoff
    shown = _cli(url, "spend")
    assert "committed 800.00 EUR" in shown and "limit 1,300.00 EUR" in shown

    third = scripted(native, [("pay_invoice", LARGE)])
    crew, _ = payment_crew([pay], third, cache_backend=url)
    crew.kickoff()  # a replay: nothing asked, nothing paid, nothing counted
    assert _paid(charges) == ["INV-1", "INV-2", "INV-3"]


def test_report_mode_tells_the_agent_and_nothing_runs(
    charges: FakeProvider, tmp_path: Path
) -> None:
    url = _url(tmp_path)
    pay = _pay_tool(charges, on_approval="report")
    llm = scripted(True, [("pay_invoice", LARGE)], [("pay_invoice", SMALL_1)])
    crew, _ = payment_crew([pay], llm, cache_backend=url)
    crew.kickoff()  # not stopped: the agent read the error and went on
    assert _paid(charges) == ["INV-1"]
    assert any("needs approval" in prompt for prompt in llm.prompts)


def test_a_denied_request_is_an_error_the_agent_sees(charges: FakeProvider, tmp_path: Path) -> None:
    url = _url(tmp_path)
    pay = _pay_tool(charges)
    crew, _ = payment_crew([pay], scripted(True, [("pay_invoice", LARGE)]), cache_backend=url)
    with pytest.raises(ApprovalRequired) as stopped:
        crew.kickoff()
    decided: list[Any] = []
    backend = backend_from_url(url)
    with crewai_event_bus.scoped_handlers():

        @crewai_event_bus.on(ApprovalDecidedEvent)
        def heard(source: Any, event: ApprovalDecidedEvent) -> None:
            decided.append(event)

        Approvals(backend).deny(stopped.value.request_id, by="cfo", reason="duplicate")
        crewai_event_bus.flush()
    backend.close()
    assert [(e.state, e.decided_by) for e in decided] == [("DENIED", "cfo")]
    llm = scripted(True, [("pay_invoice", LARGE)])
    crew, _ = payment_crew([pay], llm, cache_backend=url)
    crew.kickoff()
    assert _paid(charges) == []
    assert any(
        "was denied by cfo" in prompt and ApprovalDenied.__name__ not in prompt
        for prompt in llm.prompts
    )  # the agent read the denial as a tool error


def test_crew_settings_gate_a_tool_by_name(charges: FakeProvider, tmp_path: Path) -> None:
    url = _url(tmp_path)

    @tool("pay_invoice", idempotent=True)
    def pay_invoice(invoice: str, amount_cents: int) -> str:
        """Pay `amount_cents` (euro cents) for `invoice`. Returns the payment id."""
        return charges.charge(amount_cents, "supplier", invoice=invoice)

    config = IdempotencyConfig(
        backend=url,
        approval={"pay_invoice": True},
        spend={"pay_invoice": lambda a: Money(a["amount_cents"], "EUR")},
        caps=[SpendCap(10_000, "EUR", per="total")],
    )
    llm = scripted(True, [("pay_invoice", SMALL_1)])
    crew, _ = payment_crew([pay_invoice], llm, idempotency=config)
    crew.kickoff()  # over the total cap: refused without asking anyone
    assert _paid(charges) == []
    assert Approvals(backend_from_url(url)).list("all") == []
    assert any("spend cap" in prompt for prompt in llm.prompts)


def test_idempotent_wrapper_takes_gates_and_waits_for_an_approval_given_meanwhile(
    charges: FakeProvider, tmp_path: Path
) -> None:
    url = _url(tmp_path)

    class Pay(BaseTool):
        name: str = "pay_invoice"
        description: str = "Pay an invoice; returns the payment id."

        def _run(self, invoice: str, amount_cents: int) -> str:
            return charges.charge(amount_cents, "supplier", invoice=invoice)

    pay = idempotent(Pay(), approval=True, approval_wait_s=30.0)
    backend = backend_from_url(url)

    async def main() -> None:
        llm = scripted(True, [("pay_invoice", LARGE)])
        crew, _ = payment_crew([pay], llm, cache_backend=url)
        # The approver runs on the same loop: the waiting call must not block it.
        await asyncio.gather(crew.kickoff_async(), approve_first_pending(backend, poll_s=0.05))

    asyncio.run(main())
    backend.close()
    assert _paid(charges) == ["INV-3"]


def test_bad_gate_options_are_refused_where_given() -> None:
    with pytest.raises(TypeError, match="approval must be"):

        @tool("t", idempotent=True, approval="yes")
        def t1(x: int) -> str:
            """T."""
            return ""

    with pytest.raises(ValueError, match="on_approval"):

        @tool("t", idempotent=True, on_approval="ask")
        def t2(x: int) -> str:
            """T."""
            return ""

    with pytest.raises(ValueError, match="idempotent=False"):

        @tool("t", idempotent=False, approval=True)
        def t3(x: int) -> str:
            """T."""
            return ""

    with pytest.raises(TypeError, match="caps must hold SpendCap"):
        IdempotencyConfig(caps=[100])


def test_two_approvers_above_an_amount_and_the_request_names_who_asked(
    charges: FakeProvider, tmp_path: Path
) -> None:
    url = _url(tmp_path)
    pay = _pay_tool(charges, approvers=lambda args, ctx: 2 if args["amount_cents"] > 70_000 else 1)
    crew, _ = payment_crew(
        [pay], scripted(True, [("pay_invoice", FOURTH)], [("pay_invoice", LARGE)]),
        cache_backend=url, name="Payables",
    )  # fmt: skip
    with pytest.raises(ApprovalRequired):
        crew.kickoff()
    approvals = Approvals(backend_from_url(url))
    (fourth,) = approvals.list("pending")
    assert fourth.approvers_needed == 1  # 60 000: under the amount, one approver
    assert fourth.origin == {
        "crew": "Payables", "task": "Charge 5 to alice for invoice inv-1.", "agent": "Cashier",
    }  # fmt: skip
    approvals.approve(fourth.id, by="alice")
    crew, _ = payment_crew(
        [pay], scripted(True, [("pay_invoice", FOURTH)], [("pay_invoice", LARGE)]),
        cache_backend=url,
    )  # fmt: skip
    with pytest.raises(ApprovalRequired):
        crew.kickoff()
    large = next(r for r in approvals.list("pending") if r.summary == LARGE)
    assert large.approvers_needed == 2  # 80 000: two people
    approvals.approve(large.id, by="alice")

    def again() -> None:
        llm = scripted(True, [("pay_invoice", FOURTH)], [("pay_invoice", LARGE)])
        crew, _ = payment_crew([pay], llm, cache_backend=url)
        crew.kickoff()

    with pytest.raises(ApprovalRequired, match="1 of 2 approvers"):
        again()
    assert _paid(charges) == ["INV-4"]
    approvals.approve(large.id, by="bob")
    again()
    again()
    assert _paid(charges) == ["INV-4", "INV-3"]


def test_crew_settings_set_approvers_by_tool_name(charges: FakeProvider, tmp_path: Path) -> None:
    url = _url(tmp_path)

    @tool("pay_invoice", idempotent=True)
    def pay_invoice(invoice: str, amount_cents: int) -> str:
        """Pay `amount_cents` (euro cents) for `invoice`. Returns the payment id."""
        return charges.charge(amount_cents, "supplier", invoice=invoice)

    config = IdempotencyConfig(
        backend=url, approval={"pay_invoice": True}, approvers={"pay_invoice": 3}
    )
    crew, _ = payment_crew(
        [pay_invoice], scripted(True, [("pay_invoice", SMALL_1)]), idempotency=config
    )
    with pytest.raises(ApprovalRequired):
        crew.kickoff()
    (request,) = Approvals(backend_from_url(url)).list("pending")
    assert request.approvers_needed == 3
    assert _paid(charges) == []


def test_bad_approvers_options_are_refused_where_given(
    charges: FakeProvider, tmp_path: Path
) -> None:
    for bad in (0, True, "two", 1.5):
        with pytest.raises(TypeError, match="approvers must be a whole number"):
            _pay_tool(charges, approvers=bad)
    with pytest.raises(TypeError, match=r"approvers\['pay_invoice'\]"):
        IdempotencyConfig(approvers={"pay_invoice": 0})
    pay = _pay_tool(charges, approvers=lambda args, ctx: 0)
    crew, _ = payment_crew(
        [pay], scripted(True, [("pay_invoice", LARGE)]), cache_backend=_url(tmp_path)
    )
    crew.kickoff()  # the rule's answer refuses the call: a tool error, nothing ran
    assert _paid(charges) == []


def test_the_approvals_demo_says_it_all_and_leaves_nothing_behind() -> None:
    result = CliRunner().invoke(cli, ["demo-approvals"], catch_exceptions=False, env=WIDE)
    assert result.exit_code == 0, result.output
    # The cap's refusal, whole: the reason comes at its end.
    (refusal,) = [line for line in result.output.splitlines() if "spend cap" in line]
    assert refusal.rstrip().endswith("would exceed the limit of 1,200.00 EUR; nothing was run")
    (said,) = [line for line in result.output.splitlines() if line.startswith("Ledger: ")]
    url = said.split()[1]
    assert "(a throwaway ledger, deleted when the demo ends;" in said
    assert f"Operator: crewai-idempotent --ledger {url} approvals approve ap_" in result.output
    folder = Path(url.removeprefix("sqlite://")).parent
    assert folder.name.startswith("crewai-idempotent-demo-approvals-") and not folder.exists()


def test_the_approvals_demo_runs_offline(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["demo-approvals", "--ledger-path", str(tmp_path / "demo.db")], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert "needs approval" in result.output and "refused by the per-kickoff cap" in result.output
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    assert "USED" in _cli(url, "approvals", "ls", "--state", "all")
    assert "committed 900.00 EUR" in _cli(url, "spend")
