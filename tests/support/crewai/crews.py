"""Building the small payment crews the crewai tests run."""

from __future__ import annotations

import os
from typing import Any

from crewai import Agent, Crew, Task
from crewai.tools import BaseTool, tool

from .llm import Call, ScriptedLLM
from .provider import FakeProvider


def charge_tool(provider: FakeProvider, name: str = "charge_card", **options: Any) -> BaseTool:
    """A `@tool` function that charges at `provider`; `options` go to `@tool`."""

    @tool(name, **options)
    def charge_card(amount: int, recipient: str, invoice: str = "inv-1") -> str:
        """Charge `amount` to `recipient` for `invoice`. Returns the provider's receipt id."""
        return provider.charge(amount, recipient, invoice=invoice)

    return charge_card


class ChargeTool(BaseTool):
    """A class tool, idempotent by class default."""

    name: str = "charge_card"
    description: str = "Charge an amount to a recipient for an invoice; returns the receipt id."
    idempotent: bool = True
    provider_path: str

    def _run(self, amount: int, recipient: str, invoice: str = "inv-1") -> str:
        return FakeProvider(self.provider_path).charge(amount, recipient, invoice=invoice)


class PlainChargeTool(BaseTool):
    """A class tool as a third party would ship it: no idea of idempotency."""

    name: str = "charge_card"
    description: str = "Charge an amount to a recipient for an invoice; returns the receipt id."
    provider_path: str

    def _run(self, amount: int, recipient: str, invoice: str = "inv-1") -> str:
        return FakeProvider(self.provider_path).charge(amount, recipient, invoice=invoice)


def scripted(native: bool, *batches: list[Call], **options: Any) -> ScriptedLLM:
    return ScriptedLLM(model="scripted-model", native=native, batches=list(batches), **options)


def payment_crew(
    tools: list[BaseTool],
    llm: ScriptedLLM,
    *,
    reject: int = 0,
    max_retry_limit: int = 2,
    description: str = "Charge 5 to alice for invoice inv-1.",
    executor_class: type | None = None,
    **crew_options: Any,
) -> tuple[Crew, Task]:
    """One cashier agent, one task. The task's guardrail rejects the first `reject` outputs.

    `cache` goes to the agent too: before crewai 1.15.3 the agent caches tool results
    whatever the crew says. `executor_class` picks crewai's agent executor."""
    agent_options: dict[str, Any] = {}
    if "cache" in crew_options:
        agent_options["cache"] = crew_options["cache"]
    if executor_class is not None:
        agent_options["executor_class"] = executor_class
    agent = Agent(
        role="Cashier",
        goal="Charge each invoice exactly once",
        backstory="Careful with money.",
        llm=llm,
        tools=tools,
        max_retry_limit=max_retry_limit,
        allow_delegation=False,
        verbose=False,
        **agent_options,
    )
    seen = {"outputs": 0}

    def guardrail(output):  # type: ignore[no-untyped-def]  # crewai inspects the annotation
        seen["outputs"] += 1
        if seen["outputs"] <= reject:
            return False, "Rejected on purpose: redo the task."
        return True, output.raw

    task = Task(
        description=description,
        expected_output="The receipt id.",
        agent=agent,
        guardrail=guardrail if reject else None,
        guardrail_max_retries=max(reject, 1) + 1,
    )
    crew = Crew(agents=[agent], tasks=[task], verbose=False, **crew_options)
    return crew, task


class EnvChargeTool(BaseTool):
    """Idempotent by class default and constructible without arguments (as flow tool
    actions build their tools); the provider file comes from FAKE_PROVIDER_PATH."""

    name: str = "charge_card"
    description: str = "Charge an amount to a recipient for an invoice; returns the receipt id."
    idempotent: bool = True
    idempotency_key: str = "flow:{invoice}"

    def _run(self, amount: int, recipient: str, invoice: str = "inv-1") -> str:
        provider = FakeProvider(os.environ["FAKE_PROVIDER_PATH"])
        return provider.charge(amount, recipient, invoice=invoice)
