"""The async path through crewai: parallel native tool calls and concurrent kickoffs.

crewai runs a batch of native tool calls on a thread pool, and runs an async tool there
with `asyncio.run`, so twenty parallel calls of one async tool are callers of one key on
several event loops at once. `kickoff_async` runs whole crews concurrently. Effects are
counted at the fake provider: they must equal the distinct operations.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from crewai.tools import BaseTool
from crewai.utilities import agent_utils

from crewai_idempotent import SQLiteCacheBackend
from crewai_idempotent.integration import configure
from tests.support.crewai.crews import payment_crew, scripted
from tests.support.crewai.provider import FakeProvider

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")

BODY_S = 0.05


class AsyncChargeTool(BaseTool):
    """An async class tool, idempotent, keyed by invoice (the same across crews)."""

    name: str = "charge_card"
    description: str = "Charge an amount to a recipient for an invoice; returns the receipt id."
    idempotent: bool = True
    idempotency_key: str = "pay:{invoice}"
    provider_path: str

    async def _arun(self, amount: int, recipient: str, invoice: str = "inv-1") -> str:
        await asyncio.sleep(BODY_S)  # the provider's round trip
        return FakeProvider(self.provider_path).charge(amount, recipient, invoice=invoice)

    def _run(self, amount: int, recipient: str, invoice: str = "inv-1") -> str:
        return asyncio.run(self._arun(amount, recipient, invoice))


def _call(invoice: str) -> tuple[str, dict[str, Any]]:
    return ("charge_card", {"amount": 5, "recipient": "alice", "invoice": invoice})


@pytest.fixture
def shared_ledger(tmp_path: Path) -> Any:
    backend = SQLiteCacheBackend(tmp_path / "ledger.db")
    previous = configure(backend=backend)
    yield backend
    configure(previous)
    backend.close()


def test_twenty_parallel_calls_of_an_async_tool_charge_once(
    charges: FakeProvider, shared_ledger: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # crewai stops an agent at its fifth identical (tool, arguments, result) call, and
    # replays are identical by design; this test is about the twenty calls, not that.
    monkeypatch.setattr(agent_utils, "MAX_REPEATED_TOOL_CALLS", 100)
    tool = AsyncChargeTool(provider_path=str(charges.path))
    llm = scripted(True, [_call("inv-1")] * 20)
    crew, _ = payment_crew([tool], llm)
    result = crew.kickoff()
    [effect] = charges.effects("charge")
    assert effect["invoice"] == "inv-1"
    # Every one of the twenty calls answered with the one receipt.
    assert str(result).split("; ") == [effect["receipt"]] * 20


def test_ten_crews_kicked_off_concurrently_charge_each_invoice_once(
    charges: FakeProvider, shared_ledger: Any
) -> None:
    invoices = [f"inv-{n % 4}" for n in range(10)]  # four distinct operations

    async def main() -> list[Any]:
        crews = []
        for invoice in invoices:
            tool = AsyncChargeTool(provider_path=str(charges.path))
            # Each crew's model also asks for its charge three times in one batch.
            crew, _ = payment_crew([tool], scripted(True, [_call(invoice)] * 3))
            crews.append(crew)
        return await asyncio.gather(*(crew.kickoff_async() for crew in crews))

    results = asyncio.run(main())
    effects = charges.effects("charge")
    assert sorted(e["invoice"] for e in effects) == sorted(set(invoices))
    receipt = {e["invoice"]: e["receipt"] for e in effects}
    for invoice, result in zip(invoices, results, strict=True):
        assert str(result).split("; ") == [receipt[invoice]] * 3
