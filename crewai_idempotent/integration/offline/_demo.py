"""`crewai-idempotent demo`: a payment crew whose task is retried twice, charging once.

Offline: the model is scripted and the payment provider is fake. The crew's task asks
for one charge; crewai re-runs the task after its guardrail rejects the first answer and
re-runs the agent after a model error, and each time the model calls the charge tool
again. The tool is `idempotent=True`, so the first call charges and the others replay
its receipt from the ledger: a throwaway SQLite file in a temporary folder, deleted when
the demo ends, or the ledger given (a URL, or a SQLite file); configure(),
CREWAI_IDEMPOTENCY_URL and the embedded default are never used, so the demo writes
nothing into a real ledger unless asked to.

With `--receipt FILE` the same crew then runs once more without the guard (the control:
the charge tool is not idempotent, on a fresh fake provider), and a JSON receipt of both
runs is written (_scripted.py, docs/receipts.md).

crewai's own files for the run (its kickoff outputs database, its lock files) go in a
throwaway folder too (`_scripted.crewai_files_thrown_away`); the demo says which of
crewai's per-user folders importing crewai made, if it made any.

Run it with `crewai-idempotent demo` or `python -m crewai_idempotent.demo [LEDGER_PATH]`.
crewai is imported once the offline environment is set, so this module imports it late.
"""

from __future__ import annotations

import logging
import secrets
import threading
from typing import Any

from rich.markup import escape

from ..._units import format_money
from .. import IdempotencyConfig, install
from ._scripted import (
    current_attempt,
    publish_receipt,
    run_offline,
    say,
    scripted_model,
    tool_call,
)

_MODEL_FAILURE = "503: upstream model overloaded (scripted)"


class FakePaymentProvider:
    """Stands in for a card processor: records every charge it is asked to make."""

    def __init__(self) -> None:
        self.charges: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def charge(self, invoice: str, amount_cents: int, customer: str, idempotency_key: str) -> str:
        with self._lock:
            receipt = f"ch_{secrets.token_hex(6)}"
            self.charges.append(
                {"receipt": receipt, "invoice": invoice, "amount_cents": amount_cents,
                 "customer": customer, "idempotency_key": idempotency_key}
            )  # fmt: skip
            return receipt


def run_demo(
    ledger_path: str | None = None,
    *,
    ledger_url: str | None = None,
    console: Any = None,
    receipt: str | None = None,
) -> int:
    """Run the demo; 0 when the provider saw exactly one charge, else 1. With `receipt`
    (a file name), run the unguarded control after it and write the receipt there; 0 then
    also needs the control to have charged once per call."""
    return run_offline("demo", _Demo, ledger_path, ledger_url, console, receipt)


class _Demo:
    def __init__(self, console: Any, backend: Any, described: str) -> None:
        self.console = console
        self.backend = backend
        self.described = described
        self.provider = FakePaymentProvider()
        self.invoice = f"INV-{secrets.token_hex(3).upper()}"
        self.customer = "cus_ada"
        self.amount_cents = 4200
        self.decisions: list[str] = []  # "executed" / "replayed", from the event bus
        self.attempt = 0
        self.tool_calls = 0
        self.guarded = True
        self.timeline: list[dict[str, Any]] = []  # the run's steps, for the receipt
        self.charges_before = 0  # at the provider, when the model last asked for a charge

    # -- what the crew is made of ------------------------------------------------------

    def build(self) -> Any:
        from crewai import Agent, Crew, Task
        from crewai.tools import tool

        install()  # a no-op when the package activated itself on `import crewai`
        provider = self.provider

        if self.guarded:
            # crewai's stubs don't know the options the integration adds to @tool and Crew.
            @tool("charge_card", idempotent=True, idempotency_key="charge:{invoice}")  # type: ignore[call-overload]
            def charge_card(
                invoice: str, amount_cents: int, customer: str, idempotency_key: str
            ) -> str:
                """Charge a customer's card for an invoice. Returns the payment receipt id."""
                return provider.charge(invoice, amount_cents, customer, idempotency_key)

        else:  # the control: the same body, not idempotent (so no key to send either)

            @tool("charge_card")
            def charge_card(invoice: str, amount_cents: int, customer: str) -> str:
                """Charge a customer's card for an invoice. Returns the payment receipt id."""
                return provider.charge(invoice, amount_cents, customer, "")

        agent = Agent(
            role="Billing clerk",
            goal="Collect payment for each invoice exactly once",
            backstory="You settle invoices with the card processor.",
            llm=scripted_model("scripted-demo-model", self.reply),
            tools=[charge_card],
            max_retry_limit=2,
            allow_delegation=False,
            verbose=False,
        )
        task = Task(
            description=(
                f"Charge {self.customer} {format_money(self.amount_cents, 'EUR')} for invoice "
                f"{self.invoice}, then report the receipt."
            ),
            expected_output="A sentence naming the invoice, the amount and the receipt id.",
            agent=agent,
            guardrail=self.guardrail,
            guardrail_max_retries=2,
        )
        if not self.guarded:
            return Crew(agents=[agent], tasks=[task], verbose=False)
        # The demo's own ledger, whatever configure() or CREWAI_IDEMPOTENCY_URL say.
        config = IdempotencyConfig(backend=self.backend)
        return Crew(agents=[agent], tasks=[task], verbose=False, idempotency=config)  # type: ignore[call-arg]

    # No return annotation: crewai checks it must be tuple[bool, Any] and cannot evaluate
    # the postponed (string) annotations this module uses.
    def guardrail(self, output: Any):  # type: ignore[no-untyped-def]
        if "EUR" not in output.raw:
            answer = escape(repr(output.raw))
            self.say(f"  guardrail rejected the answer [dim]({answer} names no amount)[/]")
            self.say("  [yellow]-> crewai retries the task (guardrail_max_retries)[/]")
            self.step(
                "failure_injected",
                how="the task's guardrail rejects the answer, which names no amount",
                after="the charge_card result reached the model",
                before="crewai accepts the task's output",
                crewai_retries="the task (guardrail_max_retries=2)",
                answer=output.raw,
            )
            return False, "Name the amount in EUR in your answer."
        self.say(f"  guardrail accepted: {escape(repr(output.raw))}")
        self.step("acknowledged", how="the guardrail accepts the answer", answer=output.raw)
        return True, output.raw

    # -- running and reporting ---------------------------------------------------------

    def say(self, text: str) -> None:
        say(self.console, text)

    def run(self) -> int:
        self.say(
            "[bold]crewai-idempotent demo[/]: one invoice, a guardrail retry and an agent retry"
        )
        crew = self.build()
        self.say(f"ledger: {escape(self.described)}")
        self.say(
            f"task: charge {self.customer} {format_money(self.amount_cents, 'EUR')} "
            f"for {self.invoice}\n"
        )
        answer = self.kickoff(crew)
        charges = len(self.provider.charges)
        colour = "green" if charges == 1 else "red"
        self.say(f"\nfinal answer: {escape(answer)}")
        self.say(
            f"the model called charge_card {self.tool_calls} times; "
            f"[bold {colour}]charges at the fake provider: {charges}[/]"
        )
        if charges == 1:
            key = self.provider.charges[0]["idempotency_key"]
            self.say(f"[dim]the provider also received the idempotency key {escape(repr(key))}[/]")
        return 0 if charges == 1 else 1

    def kickoff(self, crew: Any) -> str:
        from crewai.events.event_bus import crewai_event_bus

        from ..events import IdempotencyClaimEvent, IdempotencyReplayEvent  # imports crewai

        with crewai_event_bus.scoped_handlers():

            @crewai_event_bus.on(IdempotencyClaimEvent)
            def executed(source: Any, event: Any) -> None:
                self.decisions.append("executed")

            @crewai_event_bus.on(IdempotencyReplayEvent)
            def replayed(source: Any, event: Any) -> None:
                self.decisions.append("replayed")

            # crewai logs the scripted model failure as an error; the demo narrates it.
            flow_log = logging.getLogger("crewai.flow.runtime")
            flow_log.addFilter(_scripted_failure)
            try:
                result = crew.kickoff()
            finally:
                flow_log.removeFilter(_scripted_failure)
            crewai_event_bus.flush()
        return str(result.raw)

    def reply(self, messages: list[Any], tools: Any) -> Any:
        """The model: calls the charge tool, then answers. Attempt 1 answers without the
        amount (the guardrail rejects it); attempt 2 fails after the tool call (the agent
        retries)."""
        results = [
            m.get("content", "")
            for m in current_attempt(messages)
            if isinstance(m, dict) and m.get("role") == "tool"
        ]
        if not results:
            self.attempt += 1
            self.say(f"attempt {self.attempt}")
            if self.attempt > 1:
                self.step("retry", by=_RETRIED_BY.get(self.attempt, "crewai"))
            arguments = {
                "invoice": self.invoice,
                "amount_cents": self.amount_cents,
                "customer": self.customer,
            }
            self.charges_before = len(self.provider.charges)
            call_id = f"call_{self.attempt}"
            self.step("tool_call", tool="charge_card", call_id=call_id, arguments=arguments)
            return [tool_call(call_id, "charge_card", arguments)]
        receipt = str(results[-1]).strip()
        self.on_tool_result(receipt)
        if self.attempt == 1:
            return f"Invoice {self.invoice} is paid, receipt {receipt}."
        if self.attempt == 2:
            self.say(f"  model call failed [dim]({_MODEL_FAILURE})[/]")
            self.say("  [yellow]-> crewai retries the agent (max_retry_limit)[/]")
            self.step(
                "failure_injected",
                how=f"the model call raises RuntimeError({_MODEL_FAILURE!r})",
                after="the charge_card result reached the model",
                before="the agent answers",
                crewai_retries="the agent (max_retry_limit=2)",
            )
            raise RuntimeError(_MODEL_FAILURE)
        return (
            f"Invoice {self.invoice}: charged {format_money(self.amount_cents, 'EUR')} to "
            f"{self.customer}, receipt {receipt}."
        )

    def on_tool_result(self, result: str) -> None:
        from crewai.events.event_bus import crewai_event_bus

        crewai_event_bus.flush()
        self.tool_calls += 1
        charges = len(self.provider.charges)
        if self.guarded:
            decision = self.decisions[-1] if self.decisions else "?"
        else:
            decision = "ran unguarded"
        style = "bold green" if decision == "executed" else "cyan"
        if not self.guarded:
            style = "bold red" if charges > 1 else "bold"
        call = escape(f"charge_card(invoice={self.invoice!r})")
        self.say(f"  {call} [{style}]{decision}[/] -> {escape(result)}")
        self.step(
            "tool_result",
            guard=decision if self.guarded else None,
            result=result,
            provider_charges_before=self.charges_before,
            provider_charges_after=charges,
            effect="a new charge" if charges > self.charges_before else "no new charge",
        )

    def step(self, event: str, **fields: Any) -> None:
        """One step of the run's timeline (the receipt's)."""
        self.timeline.append(
            {"step": len(self.timeline) + 1, "event": event, "attempt": self.attempt, **fields}
        )

    # -- the receipt: the control run, and the document --------------------------------

    def summary(self, guard: str) -> dict[str, Any]:
        """This run for the receipt; its effects are the provider's own list."""
        charges = [dict(charge) for charge in self.provider.charges]
        return {
            "guard": guard,
            "tool_calls": self.tool_calls,
            "timeline": self.timeline,
            "effects": {
                "count": len(charges),
                "read_from": "the fake payment provider's own list of charges, not the ledger",
                "charges": charges,
            },
        }

    def receipt(self, path: str) -> int:
        """Run the control (the same crew, charge_card unguarded, a fresh fake provider)
        and write the receipt of both runs to `path`; 0 when the control charged once per
        call and the guarded run once in all."""
        key = f"charge:{self.invoice}"
        record = self.backend.get(key)
        guarded = self.summary(
            "charge_card(idempotent=True, idempotency_key='charge:{invoice}') on the demo's ledger"
        )
        self.say("\n[bold]control[/]: the same crew again, charge_card [bold]without[/] the guard")
        self.guarded, self.provider = False, FakePaymentProvider()
        self.decisions, self.attempt, self.tool_calls, self.timeline = [], 0, 0, []
        self.kickoff(self.build())
        unguarded = self.summary("none: charge_card is a plain crewai tool")
        charges = len(self.provider.charges)
        colour = "red" if charges > 1 else "green"
        self.say(
            f"the model called charge_card {self.tool_calls} times; "
            f"[bold {colour}]charges at the fake provider: {charges}[/]"
        )
        counts = guarded["effects"]["count"], unguarded["effects"]["count"]
        if not publish_receipt(
            self.say,
            path,
            "demo",
            "One charge, a failure injected after the charge and before crewai accepts the "
            "task (twice: a guardrail rejection, then a model error), and crewai's retries; "
            "run with the guard, then without it.",
            {"guarded": guarded, "unguarded": unguarded},
            {
                "tool": "charge_card",
                "idempotency_key": key,
                "fingerprint": record.fingerprint if record is not None else None,
                "arguments": {
                    "invoice": self.invoice,
                    "amount_cents": self.amount_cents,
                    "customer": self.customer,
                },
            },
            counts,
        ):
            return 1
        return 0 if counts == (1, self.tool_calls) and self.tool_calls > 1 else 1


_RETRIED_BY = {
    2: "crewai re-runs the task (the guardrail rejected its output)",
    3: "crewai re-runs the agent (the model call failed)",
}


def _scripted_failure(record: logging.LogRecord) -> bool:
    return _MODEL_FAILURE not in record.getMessage()
