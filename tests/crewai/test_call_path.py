"""A guarded call goes down once and back up once: every piece of per-call work is done
once, the gates run as a stage the ledger drives (on its clock, on its pools), and the
integration reads nothing back that it already had.

The counts are taken with `sys.setprofile` over one call (the functions are named by
their code objects, so the count is exact, not sampled). Effects are counted at the fake
provider.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from crewai.tools import BaseTool

from crewai_idempotent import (
    ApprovalRequired,
    InMemoryCacheBackend,
    Ledger,
    Money,
    SpendCap,
    Status,
    configure,
)
from crewai_idempotent.gates._plan import Plan
from crewai_idempotent.gates._spend import Where
from crewai_idempotent.integration import _compat, _config, _gates, _guard, _keying
from crewai_idempotent.ledger import _keys, _ledger, _policy
from tests.support.clock import ManualClock
from tests.support.faults.provider import Provider

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")

# The per-call work the path used to do twice or more: each at most once now.
ONCE = {
    "validate_key": _keys.validate_key.__code__,
    "canonical_json": _keys.canonical_json.__code__,
    "arguments": _keying.Target.arguments.__code__,
    "settings_for": _config.settings_for.__code__,
    "resolve": _config._resolve.__code__,
    "gate_rules": _config.gate_rules.__code__,
    "plan": _gates.GateRules.plan.__code__,
    "task_key": _guard._task_key.__code__,
    "execution_uuid": _compat.execution_uuid.__code__,
    "classify_failure": _policy.classify_failure.__code__,
    "current_claim": _ledger.current_claim.__code__,
    "process_config": _config.process_config.__code__,
}
NAMES = {code: name for name, code in ONCE.items()}


def _counted(fn: Callable[[], Any]) -> tuple[Any, Counter[str]]:
    counts: Counter[str] = Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = NAMES.get(frame.f_code)
            if name is not None:
                counts[name] += 1

    sys.setprofile(profile)
    try:
        result: Any = fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        result = exc
    finally:
        sys.setprofile(None)
    return result, counts


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[Provider]:
    yield Provider.create(tmp_path / "effects")


def _pay_tool(provider: Provider, **options: Any) -> BaseTool:
    class PayInvoice(BaseTool):
        name: str = "pay_invoice"
        description: str = "Pay an invoice."

        def _run(self, invoice: str, amount_cents: int) -> str:
            if invoice.startswith("BAD"):
                raise ValueError("no such invoice")
            return provider.charge(invoice)

    return PayInvoice(idempotent=True, **options)


def test_a_fresh_call_a_replay_and_a_failure_each_do_their_work_once(provider: Provider) -> None:
    configure(backend=InMemoryCacheBackend())
    tool = _pay_tool(
        provider,
        idempotency_key="pay:{invoice}",
        spend=lambda args: Money(args["amount_cents"], "EUR"),
        caps=[SpendCap(10_000, "EUR")],
    )
    paid, first = _counted(lambda: tool.run(invoice="INV-1", amount_cents=500))
    assert provider.receipts("INV-1") == [paid]
    # The first call of the tool resolves its settings; no later one does.
    assert first == {
        "validate_key": 1, "canonical_json": 1, "arguments": 1, "settings_for": 1,
        "resolve": 1, "gate_rules": 1, "plan": 1, "task_key": 1, "execution_uuid": 1,
    }  # fmt: skip

    replayed, again = _counted(lambda: tool.run(invoice="INV-1", amount_cents=500))
    assert replayed == paid and len(provider.effects()) == 1
    assert again == {
        "validate_key": 1, "canonical_json": 1, "arguments": 1, "settings_for": 1,
        "plan": 1, "task_key": 1, "execution_uuid": 1,
    }  # fmt: skip

    failed, failing = _counted(lambda: tool.run(invoice="BAD-2", amount_cents=1))
    assert isinstance(failed, ValueError)
    assert failing["classify_failure"] == 1  # the ledger's; the guard does not ask again
    assert all(count == 1 for count in failing.values()), failing


def test_a_call_without_gates_or_template_touches_neither(provider: Provider) -> None:
    configure(backend=InMemoryCacheBackend())
    tool = _pay_tool(provider)
    tool.run(invoice="INV-3", amount_cents=1)
    _, counts = _counted(lambda: tool.run(invoice="INV-4", amount_cents=1))
    assert counts == {"validate_key": 1, "canonical_json": 1, "arguments": 1, "settings_for": 1}


def test_configure_and_the_environment_are_read_again_when_they_change(
    provider: Provider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = InMemoryCacheBackend(), InMemoryCacheBackend()
    tool = _pay_tool(provider)
    configure(backend=first)
    tool.run(invoice="INV-5", amount_cents=1)
    configure(backend=second)
    tool.run(invoice="INV-6", amount_cents=1)
    assert [r.key for r in first.scan()] == [f"pay_invoice:{r.fingerprint}" for r in first.scan()]
    assert len(list(first.scan())) == 1 and len(list(second.scan())) == 1
    configure(None)
    monkeypatch.setenv("CREWAI_IDEMPOTENCY_URL", f"sqlite:///{tmp_path / 'env.db'}")
    tool.run(invoice="INV-7", amount_cents=1)
    monkeypatch.setenv("CREWAI_IDEMPOTENCY_URL", f"sqlite:///{tmp_path / 'env2.db'}")
    tool.run(invoice="INV-8", amount_cents=1)
    assert (tmp_path / "env.db").exists() and (tmp_path / "env2.db").exists()
    assert len(provider.effects()) == 4


def _approval_plan(wait_s: float) -> Plan:
    return Plan(
        tool="pay", fingerprint="fp-1", approval=True, approval_reason="always",
        where=Where(kickoff="k"), approval_wait_s=wait_s,
    )  # fmt: skip


def test_the_approval_wait_runs_on_the_ledgers_clock(provider: Provider) -> None:
    clock = ManualClock()
    ledger = Ledger(InMemoryCacheBackend(), clock=clock)
    plan = _approval_plan(wait_s=3600.0)
    with pytest.raises(ApprovalRequired):
        ledger.run("inv-9", lambda: provider.charge("inv-9"), fingerprint="fp-1", stage=plan)
    # The hour passed on the ledger's clock (the real time the call took is all it lacks).
    assert clock.offset > 3500.0
    assert provider.effects() == []
    record = ledger.get("inv-9")
    assert record is not None and record.status is Status.FAILED  # nothing ran


def test_an_async_gated_call_never_uses_the_loops_default_executor(
    provider: Provider, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("asyncio.to_thread was used")

    monkeypatch.setattr(asyncio, "to_thread", refused)
    ledger = Ledger(InMemoryCacheBackend())
    plan = Plan(
        tool="pay", fingerprint="fp-2", amount=Money(100, "EUR"),
        caps=[("pay", SpendCap(1_000, "EUR"))], where=Where(kickoff="k"),
    )  # fmt: skip

    async def body() -> str:
        return provider.charge("inv-10")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(_RefusingExecutor())
        await ledger.arun("inv-10", body, fingerprint="fp-2", stage=plan)

    asyncio.run(main())
    assert len(provider.effects()) == 1


class _RefusingExecutor(concurrent.futures.ThreadPoolExecutor):
    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the loop's default executor was used")
