"""Every retry source crewai has, on the ReAct and the native function-calling path:
charges are counted at a fake provider that appends one line per charge to a file."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest
from crewai.tools import tool

from crewai_idempotent import SQLiteCacheBackend, Status, fingerprint
from crewai_idempotent.integration._ledgers import default_ledger_path, ledger_for
from crewai_idempotent.integration.events import (
    IdempotencyClaimEvent,
    IdempotencyConflictEvent,
    IdempotencyReplayEvent,
)
from tests.support.crewai.crews import charge_tool, payment_crew, scripted
from tests.support.crewai.provider import FakeProvider

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")

ALICE = {"amount": 5, "recipient": "alice", "invoice": "inv-1"}


def _records(status: Status | None = None) -> list[Any]:
    ledger = ledger_for(SQLiteCacheBackend(default_ledger_path()))
    try:
        return ledger.records(status)
    finally:
        ledger.close()


def test_guardrail_retry_charges_once(
    native: bool, charges: FakeProvider, idem_events: Any
) -> None:
    charge = charge_tool(charges, idempotent=True)
    llm = scripted(native, [("charge_card", ALICE)])
    crew, task = payment_crew([charge], llm, reject=1)

    out = crew.kickoff()

    assert task.retry_count == 1 and llm.attempts == 2  # the tool was asked for twice
    assert charges.count() == 1
    receipt = charges.effects()[0]["receipt"]
    assert out.raw == receipt  # the replay handed the model the first receipt
    assert len(idem_events.of(IdempotencyClaimEvent)) == 1
    replays = idem_events.of(IdempotencyReplayEvent)
    assert [e.tool_name for e in replays] == ["charge_card"]
    assert replays[0].task_id == str(task.id)


def test_agent_retry_after_llm_error_charges_once(native: bool, charges: FakeProvider) -> None:
    charge = charge_tool(charges, idempotent=True)
    llm = scripted(native, [("charge_card", ALICE)], fail_times=1)
    crew, _ = payment_crew([charge], llm, max_retry_limit=2)

    out = crew.kickoff()

    assert llm.failures == 1 and llm.attempts == 2  # max_retry_limit re-ran the task
    assert charges.count() == 1
    assert out.raw == charges.effects()[0]["receipt"]


def test_guardrail_and_agent_retry_together(native: bool, charges: FakeProvider) -> None:
    charge = charge_tool(charges, idempotent=True)
    llm = scripted(native, [("charge_card", ALICE)], fail_times=1)
    crew, _ = payment_crew([charge], llm, reject=2)

    crew.kickoff()

    assert llm.attempts == 4  # 1 + agent retry + 2 guardrail retries
    assert charges.count() == 1


def test_two_invoices_same_amount_and_recipient_charge_twice(
    native: bool, charges: FakeProvider
) -> None:
    charge = charge_tool(charges, idempotent=True, idempotency_key="charge:{invoice}")
    first = {**ALICE, "invoice": "inv-1"}
    second = {**ALICE, "invoice": "inv-2"}
    llm = scripted(native, [("charge_card", first)], [("charge_card", second)])
    crew, _ = payment_crew([charge], llm, reject=1)

    crew.kickoff()

    assert llm.attempts == 2
    assert sorted(e["invoice"] for e in charges.effects()) == ["inv-1", "inv-2"]


def test_two_identical_parallel_native_calls_charge_once(charges: FakeProvider) -> None:
    in_body = threading.Barrier(2, timeout=5)
    bodies: list[str] = []

    @tool("charge_card", idempotent=True)
    def slow_charge(amount: int, recipient: str, invoice: str = "inv-1") -> str:
        """Charge `amount` to `recipient`; slow, so that both calls overlap."""
        bodies.append(threading.current_thread().name)
        time.sleep(0.5)
        return charges.charge(amount, recipient, invoice=invoice)

    # Without the guard both threads would be in the body at once; prove they overlap
    # in time by having both reach the tool call before either finishes.
    started: list[float] = []
    original = slow_charge.func

    def observe(*args: Any, **kwargs: Any) -> Any:
        started.append(time.monotonic())
        with contextlib.suppress(threading.BrokenBarrierError):
            in_body.wait()
        return original(*args, **kwargs)

    slow_charge.func = observe
    llm = scripted(True, [("charge_card", ALICE), ("charge_card", ALICE)])
    crew, _ = payment_crew([slow_charge], llm, cache=True)

    out = crew.kickoff()

    assert len(started) == 2  # crewai really made two concurrent calls
    assert charges.count() == 1 and len(bodies) == 1
    receipt = charges.effects()[0]["receipt"]
    assert out.raw == f"{receipt}; {receipt}"


def test_only_executors_that_drop_the_context_get_a_context_copying_pool() -> None:
    """crewAI's executors submit parallel native tool calls in a copy of the caller's
    context from 1.11.0; 1.10.x's do not, and get a pool that does. From 1.14 `import
    crewai` copies base_agent's namespace, `__file__` included, into the executor modules:
    a check that read their source read base_agent.py and replaced pools it must not."""
    import concurrent.futures
    import importlib

    import crewai
    from packaging.version import Version

    from crewai_idempotent.integration import _compat

    copies_itself = Version(crewai.__version__) >= Version("1.11.0")
    pools = {}
    for name in _compat._EXECUTOR_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if "ThreadPoolExecutor" in vars(module):
            pools[name] = vars(module)["ThreadPoolExecutor"]
    assert pools, f"no executor module of crewai {crewai.__version__} has a thread pool"
    expected = (
        concurrent.futures.ThreadPoolExecutor
        if copies_itself
        else _compat.ContextCopyingThreadPoolExecutor
    )
    assert pools == dict.fromkeys(pools, expected)


def test_tool_raising_before_charging_is_retried_then_charges_once(
    native: bool, charges: FakeProvider
) -> None:
    attempts: list[int] = []

    @tool("charge_card", idempotent=True)
    def flaky_charge(amount: int, recipient: str, invoice: str = "inv-1") -> str:
        """Charge `amount` to `recipient`; the gateway refuses the first connection."""
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("gateway refused the connection; nothing was charged")
        return charges.charge(amount, recipient, invoice=invoice)

    # Native: the model sees the error and calls again. ReAct: crewai retries by itself.
    batches = (
        [[("charge_card", ALICE)], [("charge_card", ALICE)]]
        if native
        else [[("charge_card", ALICE)]]
    )
    llm = scripted(native, *batches)
    crew, _ = payment_crew([flaky_charge], llm, reject=1)

    crew.kickoff()

    assert len(attempts) == 2  # ran again after the failure; replayed on the guardrail retry
    assert charges.count() == 1
    (record,) = _records()
    assert record.status is Status.COMMITTED and record.attempts == 2
    assert [e.kind for e in record.history][:3] == ["claim", "fail", "takeover"]


def test_crew_cache_true_charges_once(native: bool, charges: FakeProvider) -> None:
    charge = charge_tool(charges, idempotent=True)
    llm = scripted(native, [("charge_card", ALICE)], fail_times=1)
    crew, _ = payment_crew([charge], llm, reject=1, cache=True)

    crew.kickoff()

    assert charges.count() == 1
    # crewai's in-memory cache never held the result: the ledger replayed it.
    assert crew._cache_handler._cache == {}
    assert len(_records(Status.COMMITTED)) == 1


def test_crew_cache_false_keeps_the_guard(native: bool, charges: FakeProvider) -> None:
    charge = charge_tool(charges, idempotent=True)
    crew, _ = payment_crew(
        [charge], scripted(native, [("charge_card", ALICE)]), reject=1, cache=False
    )
    crew.kickoff()
    assert charges.count() == 1


def test_replay_is_exactly_the_first_result(native: bool, tmp_path: Any) -> None:
    calls: list[dict[str, Any]] = []

    @tool("quote", idempotent=True)
    def quote(amount: int) -> dict:
        """Return a structured quote for `amount` (a dict, not a string)."""
        result = {"amount": amount, "fee": 0.3, "id": f"q{len(calls) + 1}", "tags": ["a", "b"]}
        calls.append(result)
        return result

    direct = quote.run(amount=7)
    again = quote.run(amount=7)
    assert calls == [direct] and again == direct and type(again) is dict

    crew, _ = payment_crew([quote], scripted(native, [("quote", {"amount": 7})]), reject=1)
    out = crew.kickoff()
    assert len(calls) == 1
    assert "q1" in out.raw


def test_result_as_answer_survives_replay(native: bool, charges: FakeProvider) -> None:
    charge = charge_tool(charges, idempotent=True)
    charge.result_as_answer = True
    llm = scripted(native, [("charge_card", ALICE)], final_answer="the model's own words")
    crew, _ = payment_crew([charge], llm, reject=1)

    out = crew.kickoff()

    assert charges.count() == 1
    assert out.raw == charges.effects()[0]["receipt"]  # the tool result, replayed, is the answer


def test_task_key_survives_a_guardrail_retry_that_changes_an_argument(
    native: bool, charges: FakeProvider, idem_events: Any
) -> None:
    charge = charge_tool(charges, idempotent=True, idempotency_key="pay:{task}")
    llm = scripted(
        native,
        [("charge_card", ALICE)],
        retry_batches=[[("charge_card", {**ALICE, "amount": 6})]],
    )
    crew, _ = payment_crew([charge], llm, reject=1)

    crew.kickoff()

    assert llm.attempts == 2
    assert [e["amount"] for e in charges.effects()] == [5]  # once per task
    conflicts = idem_events.of(IdempotencyConflictEvent)  # ReAct retries a tool error itself
    assert conflicts and all(c.reason == "fingerprint_mismatch" for c in conflicts)
    assert all(c.key.startswith("pay:") for c in conflicts)
    # The model was told, in the tool result, why nothing ran.
    assert any("already used with different arguments" in p for p in llm.prompts)


def test_kickoff_template_counts_a_new_kickoff_as_a_new_operation(
    native: bool, charges: FakeProvider
) -> None:
    charge = charge_tool(charges, idempotent=True, idempotency_key="pay:{kickoff}:{invoice}")
    crew, _ = payment_crew([charge], scripted(native, [("charge_card", ALICE)]), reject=1)
    crew.kickoff()
    assert charges.count() == 1
    crew.kickoff()  # same crew, same arguments, new kickoff
    assert charges.count() == 2


def test_idempotency_key_parameter_gets_the_key_and_is_hidden_from_the_model(
    native: bool, charges: FakeProvider
) -> None:
    @tool("charge_card", idempotent=True, idempotency_key="stripe:{invoice}")
    def charge(amount: int, recipient: str, invoice: str, idempotency_key: str) -> str:
        """Charge `amount` to `recipient`; passes the key to the charges."""
        return charges.charge(amount, recipient, invoice=invoice, idempotency_key=idempotency_key)

    assert "idempotency_key" not in charge.args_schema.model_fields
    llm = scripted(native, [("charge_card", ALICE)])
    crew, _ = payment_crew([charge], llm, reject=1)

    crew.kickoff()

    assert [e["idempotency_key"] for e in charges.effects()] == ["stripe:inv-1"]
    if native:
        schemas = str(llm.tool_schemas)
        assert "recipient" in schemas and "idempotency_key" not in schemas
    else:
        prompt = "\n".join(llm.prompts)
        assert "recipient" in prompt and "idempotency_key" not in prompt


def test_operation_in_progress_is_a_tool_error_and_nothing_runs(
    native: bool, charges: FakeProvider, idem_events: Any
) -> None:
    charge = charge_tool(charges, idempotent=True, idempotency_key="pay:{invoice}", wait_s=0.2)
    # Another worker holds a live claim on the key.
    ledger = ledger_for(SQLiteCacheBackend(default_ledger_path()))
    held = threading.Event()
    release = threading.Event()

    def other_worker() -> None:
        def body() -> str:
            held.set()
            release.wait(10)
            return "ch_other"

        same_call = fingerprint({"tool": "charge_card", "args": ALICE})
        ledger.run("pay:inv-1", body, fingerprint=same_call, lease_s=30)

    worker = threading.Thread(target=other_worker)
    worker.start()
    try:
        assert held.wait(5)
        llm = scripted(native, [("charge_card", ALICE)])
        crew, _ = payment_crew([charge], llm)
        crew.kickoff()
    finally:
        release.set()
        worker.join()

    assert charges.count() == 0
    refused = idem_events.of(IdempotencyConflictEvent)
    assert refused and all(e.reason == "in_progress" for e in refused)
    assert any("is being executed by" in p and "nothing was run" in p for p in llm.prompts)


def test_kickoff_template_in_a_flow_is_one_operation(charges: FakeProvider) -> None:
    # The outermost kickoff names the operation: two crews inside one flow share its id
    # (crewai's own id from 1.15.16, the plugin's before), a second flow kickoff does not.
    from crewai.flow.flow import Flow, start

    charge = charge_tool(charges, idempotent=True, idempotency_key="pay:{kickoff}:{invoice}")

    class TwoCrews(Flow):  # type: ignore[type-arg]
        @start()
        def pay_twice(self) -> None:
            for _ in range(2):
                crew, _ = payment_crew([charge], scripted(True, [("charge_card", ALICE)]))
                crew.kickoff()

    TwoCrews().kickoff()
    assert charges.count() == 1
    TwoCrews().kickoff()
    assert charges.count() == 2
