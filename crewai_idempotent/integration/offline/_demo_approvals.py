"""`crewai-idempotent demo-approvals`: an approval gate and a spend cap, offline.

A scripted model pays invoices through a `pay_invoice` tool that needs a person's approval
above 500.00 EUR and may spend at most 1,200.00 EUR per kickoff. The first kickoff pays
two small invoices and stops on the large one; an operator approves it; the second kickoff
replays the small ones, pays the large one once, and the cap refuses a fourth. The ledger
is a throwaway SQLite file in a temporary folder, deleted when the demo ends (or the
ledger given: a URL, or a SQLite file); the provider is fake.

Run it with `crewai-idempotent demo-approvals` or `python -m crewai_idempotent.demo_approvals`.
crewai is imported once the offline environment is set, so this module imports it late.
"""

from __future__ import annotations

import json
import secrets
import threading
from typing import Any

from rich.markup import escape

from ..._errors import ApprovalRequired, LedgerConfigurationError, LedgerUnavailable, command
from ..._units import format_money
from ...gates._approvals import Approvals
from ...gates._spend import Money, SpendCap, SpendLedger
from ...ledger._backend import ledger_option
from .. import install
from ._scripted import Reply, demo_ledger, go_offline, narrator, say, scripted_model, tool_call

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
            self.payments.append({"invoice": invoice, "amount_cents": amount_cents})
            return receipt


def run_demo(
    ledger_path: str | None = None, *, ledger_url: str | None = None, console: Any = None
) -> int:
    """Run the demo; 0 when the bank saw exactly the three expected payments."""
    go_offline()
    out = narrator(console)
    try:
        with demo_ledger(ledger_path, ledger_url, "demo-approvals") as (backend, described):
            return _Demo(out, backend, described).run()
    except (LedgerUnavailable, LedgerConfigurationError) as exc:
        say(out, f"[red]cannot use that ledger:[/] {escape(str(exc))}")
        return 1


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

    def say(self, text: str) -> None:
        say(self.console, text)

    def crew(self, invoices: list[tuple[str, int]]) -> Any:
        from crewai import Agent, Crew, Task
        from crewai.tools import tool

        install()
        bank = self.bank

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
            if len(results) < len(invoices):
                invoice, cents = invoices[len(results)]
                arguments = {"invoice": invoice, "amount_cents": cents}
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
            self.crew(first).kickoff()
        except ApprovalRequired as stopped:
            rid = stopped.request_id
            self.say(f"  [yellow]stopped:[/] {escape(str(stopped))}\n")
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
        second = [*self.small, self.large, self.fourth]
        self.say("[bold]Kickoff 2[/]: " + ", ".join(f"{i} {euros(c)}" for i, c in second))
        self.crew(second).kickoff()
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
