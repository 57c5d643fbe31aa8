"""An uncertain outcome stops the kickoff with OutcomeUncertain naming the key (crewai
would otherwise turn it into text for the model and retry), or is reported to the model
with on_uncertain="report"; either way nothing runs again."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from crewai.tools import tool

from crewai_idempotent import (
    Absent,
    Found,
    IdempotencyConfig,
    InMemoryCacheBackend,
    OutcomeUncertain,
    OutcomeUnknown,
    Record,
    Status,
    fingerprint,
)
from crewai_idempotent.integration.events import IdempotencyUncertainEvent
from tests.support.crewai.crews import payment_crew, scripted
from tests.support.crewai.provider import FakeProvider

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")

ALICE = {"amount": 5, "recipient": "alice"}


def _timing_out_charge(charges: FakeProvider, failure: BaseException, **options: Any) -> Any:
    @tool("charge_card", idempotent=True, idempotency_key="pay:{recipient}", **options)
    def charge(amount: int, recipient: str) -> str:
        """Charge `amount` to `recipient`. The gateway may time out after charging."""
        charges.charge(amount, recipient)
        raise failure

    return charge


@pytest.mark.parametrize(
    "failure",
    [OutcomeUnknown("gateway timed out after the request was sent"), TimeoutError("read timeout")],
    ids=["OutcomeUnknown", "TimeoutError"],
)
def test_uncertain_body_stops_the_kickoff(
    native: bool, charges: FakeProvider, idem_events: Any, failure: BaseException
) -> None:
    backend = InMemoryCacheBackend()
    charge = _timing_out_charge(charges, failure)
    llm = scripted(native, [("charge_card", ALICE)], fail_times=1)
    crew, task = payment_crew([charge], llm, reject=2, cache_backend=backend)

    with pytest.raises(OutcomeUncertain) as caught:
        crew.kickoff()

    assert caught.value.key == "pay:alice" and "pay:alice" in str(caught.value)
    assert type(caught.value.__cause__) is type(failure)  # what the tool raised
    assert llm.calls == 1 and task.retry_count == 0  # no agent retry, no guardrail retry
    assert charges.count() == 1
    assert backend.get("pay:alice").status is Status.UNCERTAIN
    (event,) = idem_events.of(IdempotencyUncertainEvent)
    assert event.halted and event.key == "pay:alice"


def test_recorded_uncertain_stops_every_later_kickoff(native: bool, charges: FakeProvider) -> None:
    backend = InMemoryCacheBackend()
    _uncertain_record(backend)

    @tool("charge_card", idempotent=True, idempotency_key="pay:{recipient}")
    def charge(amount: int, recipient: str) -> str:
        """Charge `amount` to `recipient`."""
        return charges.charge(amount, recipient)

    crew, _ = payment_crew(
        [charge], scripted(native, [("charge_card", ALICE)]), cache_backend=backend
    )
    with pytest.raises(OutcomeUncertain, match="pay:alice"):
        crew.kickoff()
    with pytest.raises(OutcomeUncertain, match="pay:alice"):
        crew.kickoff()
    assert charges.count() == 0


def test_reconciler_settles_a_recorded_uncertain(native: bool, charges: FakeProvider) -> None:
    backend = InMemoryCacheBackend()
    _uncertain_record(backend)
    asked: list[tuple[str, Any]] = []

    def reconcile(key: str, args: Any) -> Any:
        asked.append((key, args))
        return Found("ch_from_the_provider")

    @tool("charge_card", idempotent=True, idempotency_key="pay:{recipient}", reconcile=reconcile)
    def charge(amount: int, recipient: str) -> str:
        """Charge `amount` to `recipient`."""
        return charges.charge(amount, recipient)

    crew, _ = payment_crew(
        [charge], scripted(native, [("charge_card", ALICE)]), cache_backend=backend
    )
    out = crew.kickoff()
    assert out.raw == "ch_from_the_provider"
    assert asked == [("pay:alice", ALICE)]
    assert charges.count() == 0


def test_reconciler_saying_absent_runs_once(charges: FakeProvider) -> None:
    backend = InMemoryCacheBackend()
    _uncertain_record(backend)

    @tool(
        "charge_card",
        idempotent=True,
        idempotency_key="pay:{recipient}",
        reconcile=lambda k, a: Absent(),
    )
    def charge(amount: int, recipient: str) -> str:
        """Charge `amount` to `recipient`."""
        return charges.charge(amount, recipient)

    crew, _ = payment_crew(
        [charge], scripted(True, [("charge_card", ALICE)]), reject=1, cache_backend=backend
    )
    crew.kickoff()
    assert charges.count() == 1


def test_report_mode_tells_the_model_and_never_charges_again(
    native: bool, charges: FakeProvider, idem_events: Any
) -> None:
    # On ReAct a failing call is invoked twice per attempt (crewAI #7449) and retried by
    # ToolUsage; none of those may reach the provider again.
    charge = _timing_out_charge(charges, OutcomeUnknown("gateway timed out"))
    config = IdempotencyConfig(backend=InMemoryCacheBackend(), on_uncertain="report")
    llm = scripted(native, [("charge_card", ALICE)], [("charge_card", ALICE)])
    crew, _ = payment_crew([charge], llm, reject=1, idempotency=config)

    crew.kickoff()

    assert charges.count() == 1
    assert any("outcome of idempotency key 'pay:alice' is uncertain" in p for p in llm.prompts)
    uncertain = idem_events.of(IdempotencyUncertainEvent)
    assert len(uncertain) > 1 and not any(e.halted for e in uncertain)


def test_direct_call_raises_outcome_uncertain(charges: FakeProvider) -> None:
    charge = _timing_out_charge(charges, OutcomeUnknown("no answer"))
    with pytest.raises(OutcomeUncertain, match="the tool reported an unknown outcome: no answer"):
        charge.run(**ALICE)
    with pytest.raises(OutcomeUncertain, match="pay:alice"):
        charge.run(**ALICE)
    assert charges.count() == 1


def test_native_parallel_call_halts_the_kickoff(charges: FakeProvider) -> None:
    charge = _timing_out_charge(charges, OutcomeUnknown("no answer"))
    llm = scripted(True, [("charge_card", ALICE), ("charge_card", {**ALICE, "recipient": "bob"})])
    crew, _ = payment_crew([charge], llm, cache_backend=InMemoryCacheBackend())
    with pytest.raises(OutcomeUncertain):
        crew.kickoff()
    assert charges.count() == 2 and llm.calls == 1


def test_async_kickoff_halts(native: bool, charges: FakeProvider) -> None:
    charge = _timing_out_charge(charges, OutcomeUnknown("no answer"))
    llm = scripted(native, [("charge_card", ALICE)])
    crew, _ = payment_crew([charge], llm, reject=1, cache_backend=InMemoryCacheBackend())
    with pytest.raises(OutcomeUncertain, match="pay:alice"):
        asyncio.run(crew.akickoff())
    assert charges.count() == 1


def test_async_task_halts_the_crew(charges: FakeProvider) -> None:
    from crewai import Crew, Task

    charge = _timing_out_charge(charges, OutcomeUnknown("no answer"))
    crew, task = payment_crew([charge], scripted(True, [("charge_card", ALICE)]))
    background = Task(
        description=task.description, expected_output="x", agent=task.agent, async_execution=True
    )
    final = Task(description="Report.", expected_output="y", agent=task.agent, context=[background])
    crew = Crew(
        agents=[task.agent], tasks=[background, final], cache_backend=InMemoryCacheBackend()
    )
    with pytest.raises(OutcomeUncertain):
        crew.kickoff()
    assert charges.count() == 1


def _uncertain_record(backend: Any) -> None:
    """The record a worker leaves when it died (or timed out) after charging alice."""
    now = time.time()
    args = {"amount": 5, "recipient": "alice"}
    backend.insert(
        Record(
            key="pay:alice",
            status=Status.UNCERTAIN,
            fingerprint=fingerprint({"tool": "charge_card", "args": args}),
            token=1,
            revision=1,
            owner=None,
            attempts=1,
            created_at=now,
            updated_at=now,
            error="worker died after the charge request was sent",
        )
    )


def test_uncertain_stops_a_kickoff_with_max_execution_time(
    native: bool, charges: FakeProvider
) -> None:
    # max_execution_time runs the agent in a worker thread (without the caller's context
    # up to crewai 1.10.1): the crew's ledger is used and the kickoff still stops.
    backend = InMemoryCacheBackend()
    charge = _timing_out_charge(charges, OutcomeUnknown("no answer"))
    crew, _ = payment_crew(
        [charge], scripted(native, [("charge_card", ALICE)]), cache_backend=backend
    )
    crew.agents[0].max_execution_time = 120
    with pytest.raises(OutcomeUncertain):
        crew.kickoff()
    assert charges.count() == 1
    assert backend.get("pay:alice").status is Status.UNCERTAIN  # type: ignore[union-attr]


def test_many_halted_kickoffs_in_one_thread(charges: FakeProvider) -> None:
    # crewai refuses an event scope stack deeper than 100: each halt must close its scopes.
    backend = InMemoryCacheBackend()
    charge = _timing_out_charge(charges, OutcomeUnknown("no answer"))
    for _ in range(105):
        crew, _ = payment_crew(
            [charge], scripted(True, [("charge_card", ALICE)]), cache_backend=backend
        )
        with pytest.raises(OutcomeUncertain):
            crew.kickoff()
    assert charges.count() == 1
