"""`{flow}` in a key: the id of the crewAI Flow state a tool call runs in.

A flow with `@persist` resumed with `kickoff(inputs={"id": ...})` starts again at its
`@start` and gets a new `{kickoff}`, so a `pay:{kickoff}:{invoice}` key charges again on a
resume; `pay:{flow}:{invoice}` is one operation for every resume of one flow, and another
for another flow. Outside a flow's method `{flow}` is a clear error and nothing runs. The
resume after SIGKILL runs the flow in real processes: the first is killed after its
charge is committed, the second resumes the same flow id; one charge at the provider.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from crewai.tools import tool

from crewai_idempotent import InvalidIdempotencyKey, SQLiteCacheBackend, Status, configure
from tests.support.crewai.crews import charge_tool, payment_crew, scripted
from tests.support.crewai.fixtures import PYTHON, REPO, subprocess_env
from tests.support.crewai.flows import INVOICE, payment_flow
from tests.support.crewai.provider import FakeProvider
from tests.support.killing import STARTUP_TIMEOUT, sigkill_once

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    path = tmp_path / "ledger.db"
    configure(backend=f"sqlite:///{path}")
    return path


def test_a_flow_key_is_one_operation_across_resumes_and_another_per_flow(
    ledger: Path, charges: FakeProvider, tmp_path: Path
) -> None:
    flow_class = payment_flow(charges, tmp_path / "flows.db", "pay:{flow}:{invoice}")
    first = flow_class()
    receipt = first.kickoff()
    flow_id = first.state["id"]
    assert charges.count() == 1

    resumed = flow_class()
    assert resumed.kickoff(inputs={"id": flow_id}) == receipt  # replayed: the same flow
    assert resumed.state["id"] == flow_id
    assert charges.count() == 1

    other = flow_class()
    assert other.kickoff() != receipt  # another flow: another operation
    assert charges.count() == 2
    with SQLiteCacheBackend(ledger) as backend:
        keys = sorted(r.key for r in backend.scan())
    assert keys == sorted(f"pay:{i}:{INVOICE['invoice']}" for i in (flow_id, other.state["id"]))


def test_a_kickoff_key_charges_again_on_a_resume(charges: FakeProvider, tmp_path: Path) -> None:
    # Why the docs say {flow} for "once per flow run": a resume is a new kickoff.
    configure(backend=f"sqlite:///{tmp_path / 'ledger.db'}")
    flow_class = payment_flow(charges, tmp_path / "flows.db", "pay:{kickoff}:{invoice}")
    first = flow_class()
    first.kickoff()
    flow_class().kickoff(inputs={"id": first.state["id"]})
    assert charges.count() == 2


def test_a_flow_inside_a_flows_step_shares_the_outer_flows_id(
    ledger: Path, charges: FakeProvider
) -> None:
    # Resuming the outer flow runs the inner one again under a new id: the outer id is
    # the one that stays. crewai's own flows (the agent executor) never count either.
    from crewai.flow.flow import Flow, start

    charge = charge_tool(charges, idempotent=True, idempotency_key="pay:{flow}:{invoice}")

    class Inner(Flow):  # type: ignore[type-arg]
        @start()
        def pay(self) -> str:
            return str(charge.run(**INVOICE))

    class Outer(Flow):  # type: ignore[type-arg]
        @start()
        def run_inner(self) -> str:
            return str(Inner().kickoff())

    outer = Outer()
    outer.kickoff()
    with SQLiteCacheBackend(ledger) as backend:
        assert [r.key for r in backend.scan()] == [f"pay:{outer.state['id']}:inv-flow"]


def test_a_flow_key_outside_a_flow_is_a_clear_error_and_nothing_runs(
    ledger: Path, charges: FakeProvider
) -> None:
    charge = charge_tool(charges, idempotent=True, idempotency_key="pay:{flow}:{invoice}")
    with pytest.raises(InvalidIdempotencyKey) as refused:
        charge.run(**INVOICE)
    assert str(refused.value) == (
        "tool 'charge_card': its idempotency key uses {flow}, the id of the crewAI Flow state "
        "the call runs in, but this call does not run inside a flow's method (a crew kicked "
        "off on its own, or a direct call?); nothing was run"
    )
    llm = scripted(True, [("charge_card", INVOICE)])
    crew, _ = payment_crew([charge], llm)
    crew.kickoff()  # the model is told, as for any tool error
    assert any("does not run inside a flow's method" in p for p in llm.prompts)
    assert charges.count() == 0


def test_flow_is_a_context_field_where_the_tool_is_flagged(charges: FakeProvider) -> None:
    charge_tool(charges, idempotent=True, idempotency_key="pay:{flow}")  # accepted

    def pay(flow: str, amount: int) -> str:
        """Pay `amount` for `flow`."""
        return "never"

    with pytest.raises(ValueError, match=r"key template field \{flow\} is ambiguous"):
        tool("pay", idempotent=True, idempotency_key="pay:{flow}")(pay)


def _spawn(spec: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PYTHON, "-m", "tests.support.crewai.run_flow", json.dumps(spec)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _result(out: str) -> dict[str, Any]:
    # crewai prints the flow's progress on stdout too; the runner's line is the last.
    return dict(json.loads(out.strip().splitlines()[-1]))


@pytest.mark.slow  # two fresh interpreters importing crewai
def test_a_flow_resumed_after_sigkill_does_not_charge_again(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.db"
    env = subprocess_env(
        CREWAI_IDEMPOTENCY_URL=f"sqlite:///{ledger}", XDG_DATA_HOME=str(tmp_path / "xdg")
    )
    charges = FakeProvider(tmp_path / "charges.jsonl")
    hold = tmp_path / "held"
    spec = {
        "provider": str(charges.path), "states": str(tmp_path / "flows.db"),
        "key": "pay:{flow}:{invoice}",
    }  # fmt: skip
    worker = _spawn({**spec, "hold": str(hold)}, env)
    sigkill_once(worker, lambda: hold.exists() and bool(hold.read_text()), "its second step")
    held = json.loads(hold.read_text())
    key = f"pay:{held['id']}:{INVOICE['invoice']}"
    with SQLiteCacheBackend(ledger) as backend:
        record = backend.get(key)
    assert record is not None and record.status is Status.COMMITTED
    assert charges.count() == 1

    resume = _spawn({**spec, "id": held["id"]}, env)
    out, err = resume.communicate(timeout=STARTUP_TIMEOUT)
    assert resume.returncode == 0, err[-3000:]
    result = _result(out)
    assert result == {"raw": held["receipt"], "id": held["id"]}, result  # replayed
    assert charges.count() == 1
