"""Every way of flagging a tool, and every execution path outside a crew kickoff."""

from __future__ import annotations

import asyncio
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from crewai import Agent
from crewai.flow.flow import Flow
from crewai.tools import BaseTool, tool
from crewai.tools.base_tool import Tool

from crewai_idempotent import IdempotencyKeyConflict, InvalidIdempotencyKey, idempotent
from crewai_idempotent.integration._flag import ledger_owns_cache
from tests.support.crewai.crews import (
    ChargeTool,
    PlainChargeTool,
    charge_tool,
    payment_crew,
    scripted,
)
from tests.support.crewai.provider import FakeProvider
from tests.support.crewai.versions import (
    AGENT_EXECUTOR,
    HAS_FLOW_TOOL_ACTIONS,
    HAS_STEP_EXECUTOR,
    HAS_TOOL_FAILURE,
    skip_unless,
)

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")

ALICE = {"amount": 5, "recipient": "alice", "invoice": "inv-1"}


# -- the three ways a tool comes to be guarded, in a crew, on both paths --------------


def test_basetool_subclass_with_class_default(native: bool, charges: FakeProvider) -> None:
    charge = ChargeTool(provider_path=str(charges.path))
    crew, _ = payment_crew(
        [charge], scripted(native, [("charge_card", ALICE)], fail_times=1), reject=1
    )
    crew.kickoff()
    assert charges.count() == 1


def test_basetool_subclass_flagged_by_keyword(native: bool, charges: FakeProvider) -> None:
    charge = PlainChargeTool(
        provider_path=str(charges.path), idempotent=True, idempotency_key="pay:{invoice}"
    )
    crew, _ = payment_crew([charge], scripted(native, [("charge_card", ALICE)]), reject=1)
    crew.kickoff()
    assert charges.count() == 1


def test_unflagged_tool_is_left_alone(native: bool, charges: FakeProvider) -> None:
    # The control: the same crew without the flag charges on every retry. crewai's own
    # result cache (on by default before 1.15.3) is off, or it would hide the second charge.
    charge = PlainChargeTool(provider_path=str(charges.path))
    crew, _ = payment_crew(
        [charge], scripted(native, [("charge_card", ALICE)]), reject=1, cache=False
    )
    crew.kickoff()
    assert charges.count() == 2


def test_wrapped_third_party_tool(native: bool, charges: FakeProvider) -> None:
    third_party = PlainChargeTool(provider_path=str(charges.path))
    guarded = idempotent(third_party, key="pay:{invoice}")
    assert guarded is not third_party

    crew, _ = payment_crew(
        [guarded], scripted(native, [("charge_card", ALICE)], fail_times=1), reject=1
    )
    crew.kickoff()
    assert charges.count() == 1

    third_party.run(**ALICE)  # the original stays as its author wrote it
    third_party.run(**ALICE)
    assert charges.count() == 3


def test_wrapped_function_tool(charges: FakeProvider) -> None:
    plain = charge_tool(charges)
    guarded = idempotent(plain, idempotency_key="pay:{invoice}", ttl=3600)
    guarded.run(**ALICE)
    guarded.run(**ALICE)
    assert charges.count() == 1
    plain.run(**ALICE)
    assert charges.count() == 2


# -- paths outside a crew --------------------------------------------------------------


def test_direct_run_and_func_and_structured_invoke(charges: FakeProvider) -> None:
    charge = charge_tool(charges, idempotent=True)
    first = charge.run(**ALICE)
    assert charge.run(amount=5, recipient="alice") == first  # defaults bound: the same call
    assert charge.func(5, "alice") == first  # positional, straight at the function
    assert charge.to_structured_tool().invoke(ALICE) == first  # the ReAct path's callable
    assert charges.count() == 1


def test_async_function_tool(charges: FakeProvider) -> None:
    @tool("charge_card", idempotent=True)
    async def charge(amount: int, recipient: str) -> str:
        """Charge `amount` to `recipient` (async)."""
        await asyncio.sleep(0)
        return charges.charge(amount, recipient)

    async def both() -> tuple[str, str]:
        return await charge.arun(amount=5, recipient="bob"), await charge.arun(
            amount=5, recipient="bob"
        )

    first, second = asyncio.run(both())
    assert first == second
    assert charge.run(amount=5, recipient="bob") == first  # sync run of an async tool
    assert charges.count() == 1


def test_async_class_tool(charges: FakeProvider) -> None:
    class AsyncCharge(BaseTool):
        name: str = "charge_card"
        description: str = "Charge asynchronously."
        idempotent: bool = True

        async def _arun(self, amount: int, recipient: str) -> str:
            await asyncio.sleep(0)
            return charges.charge(amount, recipient)

        def _run(self, amount: int, recipient: str) -> str:
            return charges.charge(amount, recipient)

    charge = AsyncCharge()
    first = asyncio.run(charge.arun(amount=5, recipient="bob"))
    assert asyncio.run(charge.arun(amount=5, recipient="bob")) == first
    assert charge.run(amount=5, recipient="bob") == first  # sync and async share the key
    assert charges.count() == 1


def test_standalone_agent_kickoff(native: bool, charges: FakeProvider) -> None:
    charge = charge_tool(charges, idempotent=True)
    for _ in range(2):  # re-triggered from outside: a second kickoff of the same work
        agent = Agent(
            role="Cashier",
            goal="Charge once",
            backstory="Careful.",
            llm=scripted(native, [("charge_card", ALICE)]),
            tools=[charge],
        )
        agent.kickoff("Charge 5 to alice for inv-1.")
    assert charges.count() == 1


def test_lite_agent(charges: FakeProvider) -> None:
    from crewai.lite_agent import LiteAgent

    charge = charge_tool(charges, idempotent=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LiteAgent is deprecated
        for _ in range(2):
            agent = LiteAgent(
                role="Cashier",
                goal="Charge once",
                backstory="Careful.",
                llm=scripted(False, [("charge_card", ALICE)]),
                tools=[charge],
            )
            agent.kickoff("Charge 5 to alice for inv-1.")
    assert charges.count() == 1


@skip_unless(HAS_FLOW_TOOL_ACTIONS, "flow tool actions", "1.15.0")
def test_flow_tool_action(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from crewai.flow.flow_definition import FlowToolActionDefinition
    from crewai.flow.runtime._actions import ToolAction

    monkeypatch.setenv("FAKE_PROVIDER_PATH", str(tmp_path / "flow-charges.jsonl"))
    definition = FlowToolActionDefinition(
        call="tool",
        ref="tests.support.crewai.crews:EnvChargeTool",
        **{"with": {"amount": 5, "recipient": "bob", "invoice": "inv-9"}},
    )
    flow = Flow()
    first = ToolAction(flow, definition).run()
    assert ToolAction(flow, definition).run() == first
    assert FakeProvider(tmp_path / "flow-charges.jsonl").count() == 1


# -- what flagging does and refuses ----------------------------------------------------


def test_flagging_replaces_the_crew_cache_function(charges: FakeProvider) -> None:
    charge = charge_tool(charges, idempotent=True)
    assert charge.cache_function is ledger_owns_cache
    assert charge_tool(charges).cache_function is not ledger_owns_cache


def test_custom_cache_function_is_replaced_with_a_warning(charges: FakeProvider) -> None:
    plain = charge_tool(charges)
    plain.cache_function = lambda args, result: True
    with pytest.warns(UserWarning, match="cache_function is replaced"):
        guarded = idempotent(plain)
    assert guarded.cache_function is ledger_owns_cache


def test_template_naming_an_unknown_field_is_refused_at_definition(charges: FakeProvider) -> None:
    with pytest.raises(ValueError, match=r"uses \{order_id\}, which is neither an argument"):
        charge_tool(charges, idempotent=True, idempotency_key="pay:{order_id}")
    with pytest.raises(ValueError, match="positional field"):
        charge_tool(charges, idempotent=True, idempotency_key="pay:{}")


def test_template_field_that_is_both_argument_and_context_is_refused(charges: FakeProvider) -> None:
    with pytest.raises(ValueError, match="ambiguous"):

        @tool("lookup", idempotent=True, idempotency_key="x:{task}")
        def lookup(task: str) -> str:
            """Look a task up."""
            return task


def test_options_beside_idempotent_false_are_refused(charges: FakeProvider) -> None:
    with pytest.raises(ValueError, match="idempotent=False together with"):
        charge_tool(charges, idempotent=False, idempotency_key="pay:{invoice}")
    plain = charge_tool(charges, idempotent=False)
    plain.run(**ALICE)
    plain.run(**ALICE)
    assert charges.count() == 2


def test_an_option_alone_implies_idempotent(charges: FakeProvider) -> None:
    charge = charge_tool(charges, idempotency_key="pay:{invoice}")
    charge.run(**ALICE)
    charge.run(**ALICE)
    assert charges.count() == 1


def test_bad_option_values_are_refused(charges: FakeProvider) -> None:
    with pytest.raises(ValueError, match="lease_s must be greater than 0"):
        charge_tool(charges, idempotent=True, lease_s=0)
    with pytest.raises(TypeError, match="idempotency_key must be a format template"):
        charge_tool(charges, idempotent=True, idempotency_key=42)
    with pytest.raises(ValueError, match="on_stale must be one of"):
        charge_tool(charges, idempotent=True, on_stale="sometimes")
    with pytest.raises(TypeError, match="takes a crewai BaseTool"):
        idempotent(lambda: None)  # type: ignore[arg-type]


def test_context_field_outside_a_task_is_a_clear_error(charges: FakeProvider) -> None:
    charge = charge_tool(charges, idempotent=True, idempotency_key="pay:{task}")
    with pytest.raises(InvalidIdempotencyKey, match=r"uses \{task\}.*nothing was run"):
        charge.run(**ALICE)
    assert charges.count() == 0


def test_callable_key_gets_arguments_and_context(charges: FakeProvider) -> None:
    seen: list[Any] = []

    def key(args: dict[str, Any], ctx: Any) -> str:
        seen.append((args, ctx))
        return f"{ctx.tool}:{args['recipient']}:{args['invoice']}"

    charge = charge_tool(charges, idempotent=True, idempotency_key=key)
    charge.run(**ALICE)
    charge.run(**ALICE)
    assert charges.count() == 1
    args, ctx = seen[0]
    assert args == ALICE and ctx.tool == "charge_card" and ctx.task is None
    assert len(ctx.fingerprint) == 64


def test_same_key_for_other_arguments_is_a_conflict(charges: FakeProvider) -> None:
    charge = charge_tool(charges, idempotent=True, idempotency_key="pay:{recipient}")
    charge.run(**ALICE)
    with pytest.raises(IdempotencyKeyConflict, match="different arguments"):
        charge.run(**{**ALICE, "amount": 6})
    assert charges.count() == 1


def test_two_tools_sharing_a_template_do_not_replay_each_other(charges: FakeProvider) -> None:
    charge = charge_tool(charges, "charge_card", idempotent=True, idempotency_key="order:{invoice}")
    refund = charge_tool(charges, "refund_card", idempotent=True, idempotency_key="order:{invoice}")
    charge.run(**ALICE)
    with pytest.raises(IdempotencyKeyConflict):  # the fingerprint covers the tool name
        refund.run(**ALICE)


def test_explicit_key_from_a_direct_caller_wins(charges: FakeProvider) -> None:
    @tool("charge_card", idempotent=True)
    def charge(amount: int, recipient: str, idempotency_key: str | None = None) -> str:
        """Charge, passing the key on."""
        return charges.charge(amount, recipient, idempotency_key=idempotency_key)

    charge.func(5, "alice", idempotency_key="order-77")
    charge.func(5, "alice", idempotency_key="order-77")
    charge.run(amount=5, recipient="alice")  # derived key: a different operation
    keys = [e["idempotency_key"] for e in charges.effects()]
    assert len(keys) == 2 and keys[0] == "order-77" and keys[1].startswith("charge_card:")


def test_unflagging_restores_the_function(charges: FakeProvider) -> None:
    from crewai_idempotent.integration._config import ToolOptions
    from crewai_idempotent.integration._flag import flag

    charge = charge_tool(charges, idempotent=True)
    original = charge.func.__crewai_idempotent_guard__
    flag(charge, ToolOptions(idempotent=False))
    assert charge.func is original
    assert isinstance(charge, Tool)


@skip_unless(HAS_STEP_EXECUTOR, "StepExecutor (plan-and-execute)", "1.11.0")
def test_step_executor_in_planning_mode(charges: FakeProvider) -> None:
    """Plan-and-execute mode runs each step in crewai's StepExecutor (its own native
    tool-calling loop); a guardrail retry re-plans and re-runs the step."""
    import json

    from crewai.agent.planning_config import PlanningConfig
    from crewai.agents.step_executor import StepExecutor

    from tests.support.crewai.llm import ScriptedLLM

    class PlanningLLM(ScriptedLLM):
        def call(self, messages: Any, tools: Any = None, *args: Any, **kwargs: Any) -> Any:
            names = [t.get("function", {}).get("name") for t in tools or [] if isinstance(t, dict)]
            if "create_reasoning_plan" in names:
                step = {
                    "step_number": 1,
                    "description": "Charge the card",
                    "tool_to_use": "charge_card",
                }
                return json.dumps({"plan": "Charge once.", "ready": True, "steps": [step]})
            return super().call(messages, tools, *args, **kwargs)

    steps: list[Any] = []
    original = StepExecutor.execute

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        steps.append(self)
        return original(self, *args, **kwargs)

    charge = charge_tool(charges, idempotent=True)
    llm = PlanningLLM(model="scripted-model", native=True, batches=[[("charge_card", ALICE)]])
    # Only the flow-based AgentExecutor plans (the default executor from 1.14.5).
    crew, _ = payment_crew([charge], llm, reject=1, executor_class=AGENT_EXECUTOR)
    crew.agents[0].planning_config = PlanningConfig(reasoning_effort="low")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StepExecutor, "execute", counted)
        crew.kickoff()

    assert len(steps) >= 2  # the step ran in the StepExecutor on both attempts
    assert charges.count() == 1


def test_class_tool_receives_the_key_and_hides_it(charges: FakeProvider) -> None:
    class StripeCharge(BaseTool):
        name: str = "charge_card"
        description: str = "Charge through a provider that takes an Idempotency-Key."
        idempotent: bool = True
        idempotency_key: str = "stripe:{invoice}"

        def _run(self, amount: int, invoice: str, idempotency_key: str) -> str:
            return charges.charge(amount, "alice", invoice=invoice, idempotency_key=idempotency_key)

    charge = StripeCharge()
    assert set(charge.args_schema.model_fields) == {"amount", "invoice"}
    structured = charge.to_structured_tool()
    # The prompt text: computed from 1.15.3, baked into `description` before.
    prompt = getattr(structured, "formatted_description", structured.description)
    assert "idempotency_key" not in prompt
    charge.run(amount=5, invoice="inv-3")
    charge.run(amount=5, invoice="inv-3")
    assert [e["idempotency_key"] for e in charges.effects()] == ["stripe:inv-3"]


def test_ttl_lets_an_operation_run_again_after_it_expires(charges: FakeProvider) -> None:
    charge = charge_tool(charges, idempotent=True, ttl=0.3)
    first = charge.run(**ALICE)
    assert charge.run(**ALICE) == first
    time.sleep(0.5)
    assert charge.run(**ALICE) != first
    assert charges.count() == 2


def test_crew_template_field_is_the_crew_key(charges: FakeProvider) -> None:
    from crewai_idempotent import InMemoryCacheBackend

    backend = InMemoryCacheBackend()
    charge = charge_tool(charges, idempotent=True, idempotency_key="pay:{crew}:{invoice}")
    crew, _ = payment_crew(
        [charge], scripted(True, [("charge_card", ALICE)]), cache_backend=backend
    )
    crew.kickoff()
    assert [r.key for r in backend.scan()] == [f"pay:{crew.key}:inv-1"]


def test_class_default_survives_model_validate(charges: FakeProvider) -> None:
    # crewai restores checkpointed tools with model_validate, which skips __init__.
    restored = ChargeTool.model_validate({"provider_path": str(charges.path)})
    restored.run(**ALICE)
    restored.run(**ALICE)
    assert charges.count() == 1
    assert restored.cache_function is ledger_owns_cache


# -- what differs between crewai releases ----------------------------------------------


def test_long_tool_names_key_the_same_on_every_release(charges: FakeProvider) -> None:
    import hashlib

    from crewai.utilities.string_utils import sanitize_tool_name

    from crewai_idempotent.integration._compat import tool_name

    long_name = "Charge The Customer Card " * 4
    slug = "_".join(["charge_the_customer_card"] * 4)
    expected = slug[:55].rstrip("_") + "_" + hashlib.sha256(slug.encode()).hexdigest()[:8]
    assert tool_name(long_name) == expected
    if sanitize_tool_name(long_name).endswith(expected[-9:]):  # 1.10.1+; 1.10.0 only cuts
        assert sanitize_tool_name(long_name) == expected
    charge = charge_tool(charges, name=long_name, idempotent=True)
    configure_memory()
    charge.run(amount=1, recipient="bob")
    (record,) = _ledger_records()
    assert record.key.startswith(expected + ":")


@skip_unless(HAS_TOOL_FAILURE, "ToolFailure results", "1.15.9")
def test_a_returned_tool_failure_is_not_a_receipt(charges: FakeProvider) -> None:
    from crewai.tools.tool_failure import ToolFailure, ToolFailureReason

    from crewai_idempotent import Status

    answers = [ToolFailure(message="server said no", reason=ToolFailureReason.MCP_ERROR), "ok"]

    @tool("charge_card", idempotent=True)
    def charge_card(amount: int) -> Any:
        """Charge."""
        charges.charge(amount, "bob")
        return answers.pop(0)

    configure_memory()
    failed = charge_card.run(amount=1)
    assert isinstance(failed, ToolFailure)  # crewai's tool-failure policy still sees it
    assert _ledger_records()[0].status is Status.FAILED
    assert charge_card.run(amount=1) == "ok"  # ran again: a failure is never replayed
    assert charges.count() == 2
    assert charge_card.run(amount=1) == "ok" and charges.count() == 2


@skip_unless(HAS_TOOL_FAILURE, "ToolFailure results", "1.15.9")
def test_a_returned_timeout_failure_is_uncertain(charges: FakeProvider) -> None:
    from crewai.tools.tool_failure import ToolFailure

    from crewai_idempotent import OutcomeUncertain, Status

    @tool("charge_card", idempotent=True)
    def charge_card(amount: int) -> Any:
        """Charge."""
        charges.charge(amount, "bob")
        return ToolFailure(message="no answer in 30 s", code="request_timeout")

    configure_memory()
    with pytest.raises(OutcomeUncertain):
        charge_card.run(amount=1)
    assert _ledger_records()[0].status is Status.UNCERTAIN
    with pytest.raises(OutcomeUncertain):
        charge_card.run(amount=1)  # not run again: the charge may have gone through
    assert charges.count() == 1


_memory_ledger: list[Any] = []


def configure_memory() -> None:
    from crewai_idempotent import InMemoryCacheBackend, configure

    backend = InMemoryCacheBackend()
    _memory_ledger[:] = [backend]
    configure(backend=backend)


def _ledger_records() -> list[Any]:
    return list(_memory_ledger[0].scan())
