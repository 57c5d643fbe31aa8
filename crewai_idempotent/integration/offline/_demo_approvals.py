"""`crewai-idempotent demo-approvals`: an approval gate and a spend cap, offline.

A scripted model pays invoices through a `pay_invoice` tool that needs a person's approval
above 500.00 EUR and may spend at most 1,200.00 EUR per kickoff. The first kickoff pays
two small invoices and stops on the large one; an operator approves it; the second kickoff
replays the small ones, pays the large one once, and the cap refuses a fourth. The ledger
is a throwaway SQLite file in a temporary folder, deleted when the demo ends (or the
ledger given: a URL, or a SQLite file); the provider is fake.

With `--receipt FILE` the same two kickoffs then run once more without the guard (the
control: pay_invoice is a plain tool, with no approval, cap or ledger, on a fresh fake
bank), and a JSON receipt of both runs is written (_scripted.py,
docs/receipts.md). crewai's own files for the run go in a throwaway folder too.

Run it with `crewai-idempotent demo-approvals` or `python -m crewai_idempotent.demo_approvals`.
crewai is imported once the offline environment is set, so this module imports it late.
"""

from __future__ import annotations

import json
import secrets
import threading
from typing import Any

from rich.markup import escape

from ..._errors import ApprovalRequired, command
from ..._units import format_money
from ...gates._approvals import Approvals
from ...gates._spend import Money, SpendCap, SpendLedger
from ...ledger._backend import ledger_option
from .. import install
from ._scripted import (
    Reply,
    publish_receipt,
    run_offline,
    say,
    scripted_model,
    tool_call,
)

THRESHOLD_CENTS = 500_00
CAP = 1_200_00


class FakeBank:
    """Stands in for a payments API: records every payment it is asked to make."""

    def __init__(self) -> None:
        self.payments: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def pay(self, invoice: str, amount_cents: int) -> str:
        with self._lock:
            receipt = f"pay_{secrets.token_hex(5)}"
            self.payments.append(
                {"receipt": receipt, "invoice": invoice, "amount_cents": amount_cents}
            )
            return receipt


def run_demo(
    ledger_path: str | None = None,
    *,
    ledger_url: str | None = None,
    console: Any = None,
    receipt: str | None = None,
) -> int:
    """Run the demo; 0 when the bank saw exactly the three expected payments. With
    `receipt` (a file name), run the unguarded control after it and write the receipt
    there; 0 then also needs the control to have paid on every call."""
    return run_offline("demo-approvals", _Demo, ledger_path, ledger_url, console, receipt)


class _Demo:
    def __init__(self, console: Any, backend: Any, described: str) -> None:
        self.console = console
        self.backend = backend
        self.described = described
        self.ledger = ledger_option(backend)  # what the operator's commands add: --ledger
        self.bank = FakeBank()
        tag = secrets.token_hex(2).upper()
        self.small = [(f"INV-{tag}-1", 120_00), (f"INV-{tag}-2", 80_00)]
        self.large = (f"INV-{tag}-3", 900_00)
        self.fourth = (f"INV-{tag}-4", 400_00)
        self.guarded = True
        self.timeline: list[dict[str, Any]] = []  # the run's steps, for the receipt
        self.decisions: list[tuple[str, str]] = []  # (executed/replayed, key), from events
        self.tool_calls = 0
        self.kickoffs = 0
        self.before = 0  # payments at the bank when the model last asked for one

    def say(self, text: str) -> None:
        say(self.console, text)

    def crew(self, invoices: list[tuple[str, int]]) -> Any:
        from crewai import Agent, Crew, Task
        from crewai.tools import tool

        install()
        bank = self.bank

        if self.guarded:

            @tool(  # type: ignore[call-overload]  # crewai's stubs don't know our options
                "pay_invoice",
                idempotent=True,
                approval=lambda args, ctx: args["amount_cents"] > THRESHOLD_CENTS,
                spend=lambda args: Money(args["amount_cents"], "EUR"),
                caps=[SpendCap(CAP, "EUR", per="kickoff")],
            )
            def pay_invoice(invoice: str, amount_cents: int) -> str:
                """Pay a supplier invoice (amount in euro cents). Returns the payment id."""
                return bank.pay(invoice, amount_cents)

        else:  # the control: the same body, no guard, no gate, no cap

            @tool("pay_invoice")
            def pay_invoice(invoice: str, amount_cents: int) -> str:
                """Pay a supplier invoice (amount in euro cents). Returns the payment id."""
                return bank.pay(invoice, amount_cents)

        agent = Agent(
            role="Accounts payable clerk",
            goal="Pay each approved invoice exactly once",
            backstory="You pay supplier invoices through the bank's API.",
            llm=scripted_model("scripted-approvals-model", self.reply_paying(invoices)),
            tools=[pay_invoice],
            allow_delegation=False,
            verbose=False,
        )
        task = Task(
            description="Pay these invoices: " + ", ".join(i for i, _ in invoices),
            expected_output="The payment ids.",
            agent=agent,
        )
        if not self.guarded:
            return Crew(agents=[agent], tasks=[task], verbose=False)
        return Crew(  # type: ignore[call-arg]  # cache_backend is the integration's
            agents=[agent], tasks=[task], verbose=False, cache_backend=self.backend
        )

    def reply_paying(self, invoices: list[tuple[str, int]]) -> Reply:
        """The model: calls pay_invoice for each invoice in turn (native tool calls), then
        answers."""

        def reply(messages: list[Any], tools: Any) -> Any:
            results = [
                str(m.get("content", ""))
                for m in messages
                if isinstance(m, dict) and m.get("role") == "tool"
            ]
            if results:  # whole: a refusal says why at its end
                self.say(f"  tool result: {escape(results[-1].strip())}")
                self.on_tool_result(invoices[len(results) - 1][0], results[-1].strip())
            if len(results) < len(invoices):
                invoice, cents = invoices[len(results)]
                arguments = {"invoice": invoice, "amount_cents": cents}
                self.before = len(self.bank.payments)
                self.step("tool_call", tool="pay_invoice", arguments=arguments)
                return [tool_call(f"call_{len(results)}", "pay_invoice", arguments)]
            return "Done: " + "; ".join(r.strip()[:40] for r in results)

        return reply

    def run(self) -> int:
        def euros(cents: int) -> str:
            return format_money(cents, "EUR")

        self.say(f"[bold]Ledger:[/] {escape(self.described)}")
        self.say(
            f"pay_invoice needs approval above {euros(THRESHOLD_CENTS)}; "
            f"at most {euros(CAP)} per kickoff\n"
        )
        first = [*self.small, self.large]
        self.say("[bold]Kickoff 1[/]: " + ", ".join(f"{i} {euros(c)}" for i, c in first))
        try:
            self.kickoff(first)
        except ApprovalRequired as stopped:
            rid = stopped.request_id
            self.say(f"  [yellow]stopped:[/] {escape(str(stopped))}\n")
            self.step(
                "failure_injected",
                how="the approval gate stops kickoff 1 (ApprovalRequired) at the large invoice",
                after="the two small invoices were paid",
                before="the kickoff returns its answer, so nothing acknowledges those payments",
                crewai_retries="nothing: the operator approves, then the kickoff is run again",
            )
        else:
            self.say("[red]the kickoff was not stopped for approval[/]")
            return 1
        self.say(f"  the bank has made {len(self.bank.payments)} payments")

        approvals = Approvals(self.backend)
        (pending,) = approvals.list("pending")
        listing = command(self.ledger, "approvals", "ls")
        self.say(
            f"[bold]Operator[/]: {escape(listing)}\n  "
            f"{pending.id} {pending.tool} {escape(json.dumps(pending.summary))}"
        )
        approvals.approve(rid, by="demo-operator", reason="invoice checked with supplier")
        approve = command(
            self.ledger, "approvals", "approve", rid, "--reason", "'invoice checked with supplier'"
        )
        self.say(f"[bold]Operator[/]: {escape(approve)}\n")
        self.step("operator", decision="approved", request=rid, by="demo-operator")
        second = [*self.small, self.large, self.fourth]
        self.say("[bold]Kickoff 2[/]: " + ", ".join(f"{i} {euros(c)}" for i, c in second))
        self.step("retry", by="the same kickoff again, with a fourth invoice added")
        self.kickoff(second)
        for budget in SpendLedger(self.backend).budgets():
            self.say(
                f"  budget {budget.cap} {escape(budget.window)}: {euros(budget.committed)} "
                f"of {euros(budget.limit)} spent"
            )

        paid = [p["invoice"] for p in self.bank.payments]
        expected = [i for i, _ in self.small] + [self.large[0]]
        self.say(f"\nThe bank made {len(paid)} payments: {', '.join(paid)}")
        if paid != expected:
            self.say(f"[red]expected exactly {', '.join(expected)}[/]")
            return 1
        self.say(
            "[green]The small invoices were paid once (replayed in kickoff 2), the large one "
            f"once after approval, and {self.fourth[0]} was refused by the per-kickoff cap.[/]"
        )
        return 0

    # -- the receipt: the steps, the control run, and the document -----------------------

    def step(self, event: str, **fields: Any) -> None:
        """One step of the run's timeline (the receipt's)."""
        self.timeline.append(
            {"step": len(self.timeline) + 1, "event": event, "kickoff": self.kickoffs, **fields}
        )

    def kickoff(self, invoices: list[tuple[str, int]]) -> None:
        """One kickoff paying `invoices`, its guard decisions heard on the event bus."""
        from crewai.events.event_bus import crewai_event_bus

        from ..events import IdempotencyClaimEvent, IdempotencyReplayEvent  # imports crewai

        self.kickoffs += 1
        self.step("kickoff", invoices=[invoice for invoice, _ in invoices])
        with crewai_event_bus.scoped_handlers():

            @crewai_event_bus.on(IdempotencyClaimEvent)
            def executed(source: Any, event: Any) -> None:
                self.decisions.append(("executed", event.key))

            @crewai_event_bus.on(IdempotencyReplayEvent)
            def replayed(source: Any, event: Any) -> None:
                self.decisions.append(("replayed", event.key))

            try:
                self.crew(invoices).kickoff()
            finally:
                crewai_event_bus.flush()
        self.step("acknowledged", how="the kickoff returns its answer")

    def on_tool_result(self, invoice: str, result: str) -> None:
        from crewai.events.event_bus import crewai_event_bus

        crewai_event_bus.flush()
        self.tool_calls += 1
        payments = len(self.bank.payments)
        decision, key = self.decisions.pop() if self.decisions else ("refused", None)
        self.decisions.clear()
        if result.endswith("nothing was run"):  # a spend cap's refusal, as the agent sees it
            decision = "refused"
        self.step(
            "tool_result",
            invoice=invoice,
            guard=decision if self.guarded else None,
            idempotency_key=key,
            result=result,
            provider_payments_before=self.before,
            provider_payments_after=payments,
            effect="a new payment" if payments > self.before else "no new payment",
        )

    def summary(self, guard: str) -> dict[str, Any]:
        """This run for the receipt; its effects are the bank's own list."""
        payments = [dict(payment) for payment in self.bank.payments]
        by_invoice: dict[str, int] = {}
        for payment in payments:
            by_invoice[payment["invoice"]] = by_invoice.get(payment["invoice"], 0) + 1
        return {
            "guard": guard,
            "tool_calls": self.tool_calls,
            "timeline": self.timeline,
            "effects": {
                "count": len(payments),
                "by_invoice": by_invoice,
                "read_from": "the fake bank's own list of payments, not the ledger",
                "payments": payments,
            },
        }

    def receipt(self, path: str) -> int:
        """Run the control (the same two kickoffs, pay_invoice unguarded, a fresh fake
        bank) and write the receipt of both runs to `path`; 0 when the control paid on
        every call and the guarded run each approved invoice once."""
        keys = [
            step["idempotency_key"]
            for step in self.timeline
            if step["event"] == "tool_result" and step["idempotency_key"]
        ]
        actions = []
        for key in dict.fromkeys(keys):
            record = self.backend.get(key)
            invoice = next(s["invoice"] for s in self.timeline if s.get("idempotency_key") == key)
            fingerprint = record.fingerprint if record is not None else None
            actions.append({"invoice": invoice, "idempotency_key": key, "fingerprint": fingerprint})
        guarded = self.summary(
            f"pay_invoice(idempotent=True), approval above {format_money(THRESHOLD_CENTS, 'EUR')}"
            f", a cap of {format_money(CAP, 'EUR')} per kickoff, on the demo's ledger"
        )
        self.say(
            "\n[bold]control[/]: the same kickoffs again, pay_invoice [bold]without[/] the guard"
        )
        self.guarded, self.bank = False, FakeBank()
        self.timeline, self.decisions, self.tool_calls, self.kickoffs = [], [], 0, 0
        first, second = [*self.small, self.large], [*self.small, self.large, self.fourth]
        self.kickoff(first)  # nothing stops it: no gate
        self.step("retry", by="the same second kickoff as the guarded run's")
        self.kickoff(second)
        unguarded = self.summary("none: pay_invoice is a plain crewai tool")
        paid = len(self.bank.payments)
        self.say(f"the bank made {paid} payments without the guard")
        counts = guarded["effects"]["count"], unguarded["effects"]["count"]
        if not publish_receipt(
            self.say,
            path,
            "demo-approvals",
            "Two small invoices paid, then the approval gate stops the kickoff at a large one; "
            "an operator approves; the kickoff runs again with a fourth invoice that the "
            "per-kickoff cap refuses. Run with the guard, then without it.",
            {"guarded": guarded, "unguarded": unguarded},
            {"tool": "pay_invoice", "calls": actions},
            counts,
        ):
            return 1
        return 0 if counts == (3, self.tool_calls) else 1
