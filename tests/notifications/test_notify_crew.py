"""A real (offline) crew that hits an approval gate: one "approval requested" entry per
request round, delivered once, by the dispatcher its own settings start; the channel
settings at the crew, `configure()` and the environment, refused where they are given.

Charges are counted at the fake provider; deliveries at a local receiver.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from crewai.tools import tool

from crewai_idempotent import (
    ApprovalRequired,
    Approvals,
    IdempotencyConfig,
    LedgerConfigurationError,
    backend_from_url,
    configure,
)
from crewai_idempotent.cli import main as cli
from crewai_idempotent.notifications import Outbox
from tests.support.crewai.crews import payment_crew, scripted
from tests.support.crewai.provider import FakeProvider
from tests.support.notify import Receiver

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")

LARGE = {"invoice": "INV-3", "amount_cents": 80_000}


def _pay_tool(charges: FakeProvider) -> Any:
    @tool("pay_invoice", idempotent=True, approval=True)
    def pay_invoice(invoice: str, amount_cents: int) -> str:
        """Pay `amount_cents` (euro cents) for `invoice`. Returns the payment id."""
        return charges.charge(amount_cents, "supplier", invoice=invoice)

    return pay_invoice


def _until(condition: Any, what: str, timeout: float = 60.0) -> None:
    """A hang guard for the dispatcher's thread, not a measurement."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _cli(url: str, *args: str) -> str:
    result = CliRunner().invoke(cli, ["--ledger", url, *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_a_gated_crew_makes_one_request_entry_per_round_each_delivered_once(
    native: bool, charges: FakeProvider, tmp_path: Path
) -> None:
    receiver = Receiver().start()
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    settings = {"notify": [receiver.webhook()]}
    pay = _pay_tool(charges)

    def kickoff() -> None:
        crew, _ = payment_crew(
            [pay], scripted(native, [("pay_invoice", LARGE)]), cache_backend=url,
            idempotency=settings,
        )  # fmt: skip
        crew.kickoff()

    def delivered(kind: str) -> int:
        return sum(1 for r in receiver.received if r["json"]["type"] == kind)

    try:
        with pytest.raises(ApprovalRequired) as stopped:
            kickoff()
        rid = stopped.value.request_id
        _until(lambda: delivered("approval.requested") == 1, "the request was not delivered")
        for _ in range(2):  # still pending: the same request, no new entry
            with pytest.raises(ApprovalRequired):
                kickoff()
        _cli(url, "approvals", "approve", rid, "--ttl", "1s")
        _until(lambda: delivered("approval.approved") == 1, "the approval was not delivered")
        backend = backend_from_url(url)
        try:
            # The grant runs out unused (its second, on the host's clock): the next call
            # opens round 2, which is asked for once more.
            grant = Approvals(backend).get(rid).grant_expires_at
            assert grant is not None
            _until(lambda: backend.now() > grant + 0.05, "the grant never ended")
            with pytest.raises(ApprovalRequired):
                kickoff()
            _until(lambda: delivered("approval.requested") == 2, "round 2 was not delivered")
            _cli(url, "approvals", "approve", rid)
            kickoff()  # approved: paid once
            kickoff()  # a replay
            _until(lambda: delivered("approval.approved") == 2, "round 2's approval")
            assert [c["invoice"] for c in charges.effects("charge")] == ["INV-3"]
            entries = Outbox(backend).entries()
        finally:
            backend.close()
        types = Counter(e.type for e in entries)
        assert types == {
            "approval.requested": 2, "approval.approved": 2, "approval.expired": 1,
        }, types  # fmt: skip
        rounds = [e.data["round"] for e in entries if e.type == "approval.requested"]
        assert rounds == [1, 2]
        _until(lambda: len(receiver.received) == len(entries), "not every entry came")
        time.sleep(0.3)  # the dispatcher keeps running: nothing more must come
        ids = receiver.ids()
        assert sorted(ids) == sorted(e.id for e in entries)  # each delivered once
        assert all(r["verified"] for r in receiver.received)
        asked = next(
            r["json"] for r in receiver.received if r["json"]["type"] == "approval.requested"
        )
        assert asked["data"]["summary"] == LARGE and asked["data"]["tool"] == "pay_invoice"
    finally:
        receiver.stop()


def test_configure_and_the_environment_name_channels_and_refuse_bad_ones(
    charges: FakeProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(LedgerConfigurationError, match="exactly one of #secret_env"):
        configure(notify="webhook+https://hooks.example.com/in")
    with pytest.raises(LedgerConfigurationError, match="did you mean 'notify'"):
        configure(notfy="webhook+https://hooks.example.com/in")
    with pytest.raises(LedgerConfigurationError, match="unknown notification channel"):
        IdempotencyConfig(notify=["pagerduty+https://x.example.com"])
    receiver = Receiver().start()
    try:
        monkeypatch.setenv("CREWAI_IDEMPOTENCY_NOTIFY", receiver.webhook())
        url = f"sqlite:///{tmp_path / 'ledger.db'}"
        crew, _ = payment_crew(
            [_pay_tool(charges)], scripted(False, [("pay_invoice", LARGE)]), cache_backend=url
        )
        with pytest.raises(ApprovalRequired):
            crew.kickoff()
        _until(lambda: len(receiver.received) == 1, "the environment's channel got nothing")
        assert receiver.received[0]["json"]["type"] == "approval.requested"
    finally:
        receiver.stop()


def test_a_bad_channel_in_the_environment_stops_the_kickoff_not_the_model(
    charges: FakeProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CREWAI_IDEMPOTENCY_NOTIFY", "slack+ftp://nowhere")
    crew, _ = payment_crew(
        [_pay_tool(charges)], scripted(False, [("pay_invoice", LARGE)]),
        cache_backend=f"sqlite:///{tmp_path / 'ledger.db'}",
    )  # fmt: skip
    with pytest.raises(LedgerConfigurationError, match="CREWAI_IDEMPOTENCY_NOTIFY"):
        crew.kickoff()
    assert charges.effects("charge") == []
