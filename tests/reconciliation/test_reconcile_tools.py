"""A crewAI tool names its reconciler by import path, or gives a callable: its claims
record what a sweeper in another process needs (the tool, the path, the arguments), a
bad path is refused where the tool is built, a sweeper in the process that built the
tool finds its callable by the tool's name, and one registered for a tool by its name is
found for a tool that names none (its claims record the tool's name all the same)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from crewai.tools import tool

from crewai_idempotent import Absent, Found, OutcomeUncertain, OutcomeUnknown, Status, configure
from crewai_idempotent.ledger._results import encode
from crewai_idempotent.reconciliation import Sweeper, register, unregister
from tests.support.crewai.provider import FakeProvider

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")


def _lost(amount: int, answer: str) -> str:
    """Charge `amount`; the provider's answer is lost."""
    raise OutcomeUnknown("the provider did not answer")


def test_a_tool_names_its_reconciler_by_path_and_a_sweeper_elsewhere_finds_it(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    configure(backend=url)
    charge_card = tool("charge_card", idempotent=True, reconcile="tests.support.reconcile:answer")(
        _lost
    )
    with pytest.raises(OutcomeUncertain):
        charge_card.run(amount=5, answer="found")
    sweeper = Sweeper(url, imports=["tests.support.reconcile"], channels=[], entry_points=False)
    try:
        (record,) = sweeper.ledger.records(Status.UNCERTAIN)  # and the outbox's entry for it
        assert record.status is Status.UNCERTAIN
        assert record.call == {
            "tool": "charge_card", "reconciler": "tests.support.reconcile:answer",
            "ttl": None, "args": encode({"amount": 5, "answer": "found"}),
        }  # fmt: skip
        (result,) = sweeper.sweep().results
        assert result.outcome == "found"
    finally:
        sweeper.close()
    assert charge_card.run(amount=5, answer="found") == f"receipt-{record.key}"


def test_a_tools_callable_reconciler_is_found_by_its_name_in_its_own_process(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    configure(backend=url)

    def find(key: str, args: Any) -> Any:
        return Found(f"found-{args['amount']}")

    refund = tool("refund_card", idempotent=True, reconcile=find)(_lost)
    with pytest.raises(OutcomeUncertain):
        refund.run(amount=7, answer="")
    with Sweeper(url, channels=[], entry_points=False) as sweeper:
        (result,) = sweeper.sweep().results
    assert (result.outcome, result.reconciler) == (
        "found",
        f"{find.__qualname__} (a tool built here)",
    )
    assert refund.run(amount=7, answer="") == "found-7"


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("not a path", "an import path is 'package.module:function'"),
        (
            "no_such_pkg.payments:find",
            "cannot find module 'no_such_pkg.payments': No module named 'no_such_pkg'",
        ),
        ("tests.support.reconcile:nope", "tests.support.reconcile has no 'nope'"),
        ("tests.support.reconcile:ASKED_ENV", "names a str, not a callable"),
    ],
)
def test_a_bad_path_is_refused_where_the_tool_is_built(path: str, said: str) -> None:
    with pytest.raises(ValueError) as refused:
        tool("charge_card", idempotent=True, reconcile=path)(_lost)
    assert said in str(refused.value)


def test_a_reconciler_registered_by_tool_name_is_found_for_a_tool_with_none(
    tmp_path: Path, charges: FakeProvider
) -> None:
    # docs/recovery.md: a sweeper finds a reconciler by the tool's name, which the claim
    # records, whatever the key template says; the tool itself names no reconciler.
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    configure(backend=url)

    def charge(order: str, amount: int) -> str:
        """Charge `amount` for `order`; the provider's answer is lost."""
        charges.charge(amount, "alice", invoice=order)
        raise OutcomeUnknown("the provider did not answer")

    charge_card = tool("charge_card", idempotent=True, idempotency_key="charge:{order}")(charge)
    with pytest.raises(OutcomeUncertain):
        charge_card.run(order="o-1", amount=5)
    asked: list[tuple[str, Any]] = []

    def find_charge(key: str, args: Any) -> Any:
        asked.append((key, args))
        effect = charges.find("charge", invoice=key.partition(":")[2])
        return Found(effect["receipt"]) if effect else Absent()

    register("charge_card", find_charge)
    try:
        with Sweeper(url, channels=[], entry_points=False) as sweeper:
            record = sweeper.ledger.get("charge:o-1")
            assert record is not None and record.status is Status.UNCERTAIN
            # The tool's name and ttl, not its arguments: the tool has no reconciler.
            assert record.call == {"tool": "charge_card", "ttl": None}
            (result,) = sweeper.sweep().results
    finally:
        unregister("charge_card")
    assert (result.outcome, result.tool) == ("found", "charge_card"), result.reason
    assert asked == [("charge:o-1", None)]
    receipt = charges.find("charge", invoice="o-1")
    assert receipt is not None
    assert charge_card.run(order="o-1", amount=5) == receipt["receipt"]  # replayed
    assert charges.count() == 1
