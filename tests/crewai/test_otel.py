"""OpenTelemetry: spans and metrics of guarded calls, read back from the SDK's in-memory
exporters."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from crewai_idempotent import (
    IdempotencyKeyConflict,
    InMemoryCacheBackend,
    Ledger,
    LedgerUnavailable,
    OutcomeUncertain,
    OutcomeUnknown,
    Record,
    Status,
    _otel,
    configure,
)
from tests.support.crewai.crews import charge_tool, payment_crew, scripted
from tests.support.crewai.fixtures import REPO, subprocess_env
from tests.support.crewai.provider import FakeProvider

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")

ALICE = {"amount": 5, "recipient": "alice", "invoice": "inv-1"}


class Telemetry:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.metrics = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.metrics])

    def finished(self) -> list[Any]:
        return [s for s in self.spans.get_finished_spans() if s.name.startswith("idempotency")]

    def points(self, name: str) -> list[Any]:
        data = self.metrics.get_metrics_data()
        found = []
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found

    def total(self, name: str) -> int:
        return sum(int(p.value) for p in self.points(name))


@pytest.fixture
def otel(monkeypatch: pytest.MonkeyPatch) -> Iterator[Telemetry]:
    # The suite switches the SDK off for crewai's own telemetry; these providers are ours.
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    telemetry = Telemetry()
    _otel.instrument(telemetry.tracer_provider, telemetry.meter_provider)
    yield telemetry
    _otel.uninstrument()
    _otel.stop_watching()


def _key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def test_a_claim_then_a_replay(otel: Telemetry, charges: FakeProvider) -> None:
    configure(backend=InMemoryCacheBackend())
    charge = charge_tool(charges, idempotent=True, idempotency_key="pay:{invoice}")
    first = charge.run(amount=5, recipient="alice", invoice="inv-1")
    assert charge.run(amount=5, recipient="alice", invoice="inv-1") == first
    assert charges.count() == 1

    claim, replay = otel.finished()
    assert (claim.name, replay.name) == ("idempotency.claim", "idempotency.replay")
    for span in (claim, replay):
        attrs = dict(span.attributes)
        assert attrs["idempotency.tool"] == "charge_card"
        assert attrs["idempotency.key_hash"] == _key_hash("pay:inv-1")
        assert "idempotency.key" not in attrs  # never the raw key unless asked
        assert "inv-1" not in repr(attrs)
        assert attrs["idempotency.status"] == "COMMITTED"
        assert attrs["idempotency.fencing_token"] == 1
        assert attrs["idempotency.attempt"] == 1
        assert attrs["idempotency.backend"] == "inmemory"
        assert attrs["idempotency.wait_s"] >= 0
    assert dict(claim.attributes)["idempotency.outcome"] == "claim"
    assert otel.total("idempotency.claims") == 1
    assert otel.total("idempotency.replays") == 1
    (claimed,) = otel.points("idempotency.claim.duration")
    (committed,) = otel.points("idempotency.commit.duration")
    assert claimed.count == committed.count == 1
    assert dict(claimed.attributes) == {"backend": "inmemory"}


def test_the_span_is_a_child_of_the_tool_span_and_parents_the_body(
    otel: Telemetry, charges: FakeProvider
) -> None:
    configure(backend=InMemoryCacheBackend())
    tracer = otel.tracer_provider.get_tracer("a tracing integration")

    @__import__("crewai.tools", fromlist=["tool"]).tool("charge_card", idempotent=True)
    def charge_card(amount: int) -> str:
        """Charge."""
        with tracer.start_as_current_span("provider.http"):
            return charges.charge(amount, "bob")

    with tracer.start_as_current_span("Tool Usage") as tool_span:
        charge_card.run(amount=3)
    spans = {s.name: s for s in otel.spans.get_finished_spans()}
    guard = spans["idempotency.claim"]
    assert guard.parent.span_id == tool_span.get_span_context().span_id
    assert spans["provider.http"].parent.span_id == guard.context.span_id


def test_a_crew_retry_is_a_claim_then_a_replay(
    otel: Telemetry, native: bool, charges: FakeProvider
) -> None:
    charge = charge_tool(charges, idempotent=True)
    crew, _ = payment_crew(
        [charge],
        scripted(native, [("charge_card", ALICE)]),
        reject=1,
        cache_backend=InMemoryCacheBackend(),
    )
    crew.kickoff()
    assert charges.count() == 1
    assert [s.name for s in otel.finished()] == ["idempotency.claim", "idempotency.replay"]


def test_conflict_and_uncertain(otel: Telemetry, charges: FakeProvider) -> None:
    configure(backend=InMemoryCacheBackend())
    charge = charge_tool(charges, idempotent=True, idempotency_key="pay:{invoice}")
    charge.run(amount=5, recipient="alice", invoice="inv-1")
    with pytest.raises(IdempotencyKeyConflict):
        charge.run(amount=6, recipient="alice", invoice="inv-1")

    @__import__("crewai.tools", fromlist=["tool"]).tool("refund", idempotent=True)
    def refund(amount: int) -> str:
        """Refund."""
        charges.charge(-amount, "alice")
        raise OutcomeUnknown("the provider hung up")

    with pytest.raises(OutcomeUncertain):
        refund.run(amount=5)
    _claim, conflict, uncertain = otel.finished()
    assert conflict.name == "idempotency.conflict"
    assert conflict.status.status_code is StatusCode.ERROR
    assert uncertain.name == "idempotency.uncertain"
    assert dict(uncertain.attributes)["idempotency.status"] == "UNCERTAIN"
    assert uncertain.status.status_code is StatusCode.ERROR
    assert otel.total("idempotency.conflicts") == 1
    assert otel.total("idempotency.uncertain") == 1
    assert otel.total("idempotency.claims") == 1


class _Unreachable(InMemoryCacheBackend):
    def insert(self, record: Record) -> Record | None:
        raise ConnectionError("ledger host unreachable")

    def get(self, key: str) -> Record | None:
        raise ConnectionError("ledger host unreachable")


def test_ledger_errors_are_counted(otel: Telemetry, charges: FakeProvider) -> None:
    configure(backend=_Unreachable())
    charge = charge_tool(charges, idempotent=True)
    with pytest.raises(LedgerUnavailable):
        charge.run(amount=5, recipient="alice")
    assert charges.count() == 0
    assert otel.total("idempotency.ledger_errors") == 1
    (span,) = otel.finished()
    assert span.status.status_code is StatusCode.ERROR


def test_raw_keys_only_when_configured(otel: Telemetry, charges: FakeProvider) -> None:
    _otel.instrument(otel.tracer_provider, otel.meter_provider, record_keys=True)
    configure(backend=InMemoryCacheBackend())
    charge_tool(charges, idempotent=True, idempotency_key="pay:{invoice}").run(
        amount=5, recipient="alice", invoice="inv-7"
    )
    (span,) = otel.finished()
    assert dict(span.attributes)["idempotency.key"] == "pay:inv-7"


def test_the_open_uncertain_gauge(otel: Telemetry) -> None:
    ledger = Ledger(InMemoryCacheBackend())

    def unknown() -> str:
        raise OutcomeUnknown("no answer")

    for key in ("a", "b"):
        with pytest.raises(OutcomeUnknown):
            ledger.run(key, unknown)
    ledger.run("c", lambda: "ok")
    assert [r.status for r in ledger.records()].count(Status.UNCERTAIN) == 2
    with pytest.raises(ValueError, match="interval_s"):
        _otel.watch_uncertain(ledger, interval_s=0)
    _otel.watch_uncertain(ledger, interval_s=0.05)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and otel.total("idempotency.uncertain.open") != 2:
        time.sleep(0.05)
    (point,) = otel.points("idempotency.uncertain.open")
    assert point.value == 2 and dict(point.attributes) == {"backend": "inmemory"}


def test_off_without_a_configured_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    _otel.uninstrument()
    # The API's default providers are proxies: nothing is configured in this process.
    assert _otel._instruments() is None
    assert _otel.observe("t", "k", InMemoryCacheBackend()) is _otel.NOTHING
    # Switched off, even with an SDK provider configured globally.
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.setenv("CREWAI_IDEMPOTENT_OTEL", "0")
    sdk = TracerProvider()
    monkeypatch.setattr(_otel._state, "api", (lambda: sdk, lambda: None))
    assert _otel._instruments() is None
    monkeypatch.setenv("CREWAI_IDEMPOTENT_OTEL", "1")
    _otel.uninstrument()
    instruments = _otel._instruments()
    assert instruments is not None and instruments.tracer is not None
    _otel.uninstrument()


NO_OTEL = r"""
import sys
sys.modules["opentelemetry"] = None  # as if the package were not installed
from crewai_idempotent import InMemoryCacheBackend, _otel
assert _otel.observe("t", "k", InMemoryCacheBackend()) is _otel.NOTHING
print("ok")
"""


def test_no_opentelemetry_installed_costs_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-c", NO_OTEL],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_observability_doc_names_what_the_code_emits() -> None:
    text = (Path(REPO) / "docs" / "observability.md").read_text()
    for name in (
        "idempotency.claims",
        "idempotency.replays",
        "idempotency.conflicts",
        "idempotency.uncertain",
        "idempotency.ledger_errors",
        "idempotency.claim.duration",
        "idempotency.commit.duration",
        "idempotency.uncertain.open",
        "idempotency.key_hash",
        "idempotency.fencing_token",
    ):
        assert f"`{name}`" in text, name


def test_async_tools_are_observed_too(otel: Telemetry, charges: FakeProvider) -> None:
    import asyncio

    from crewai.tools import tool

    configure(backend=InMemoryCacheBackend())

    @tool("charge_async", idempotent=True)
    async def charge_async(amount: int) -> str:
        """Charge."""
        return charges.charge(amount, "bob")

    async def twice() -> None:
        await charge_async.arun(amount=2)
        await charge_async.arun(amount=2)

    asyncio.run(twice())
    assert charges.count() == 1
    assert [s.name for s in otel.finished()] == ["idempotency.claim", "idempotency.replay"]


def test_a_gate_that_stops_the_call_is_an_approval_span(
    otel: Telemetry, charges: FakeProvider
) -> None:
    from crewai.tools import tool

    from crewai_idempotent import ApprovalRequired

    configure(backend=InMemoryCacheBackend())

    @tool("pay_invoice", idempotent=True, approval=True)
    def pay_invoice(amount: int) -> str:
        """Pay."""
        return charges.charge(amount, "bob")

    with pytest.raises(ApprovalRequired):
        pay_invoice.run(amount=9)
    assert charges.count() == 0
    (span,) = otel.finished()
    assert span.name == "idempotency.approval"
    assert dict(span.attributes)["idempotency.outcome"] == "approval"


# -- the outbox's deliveries -------------------------------------------------------------------


def test_every_delivery_try_is_a_span_and_counted(otel: Telemetry) -> None:
    from crewai_idempotent.notifications import Dispatcher, alert
    from tests.support.notify import Receiver

    receiver = Receiver().start()
    try:
        backend = InMemoryCacheBackend()
        entry = alert(backend, "alert.test", "hello")
        receiver.status = 503
        dispatcher = Dispatcher(backend, [receiver.webhook(name="ops")], backoff_s=0.001)
        dispatcher.run_once()
        time.sleep(0.01)  # past the millisecond of backoff
        receiver.status = 204
        dispatcher.run_once()
    finally:
        receiver.stop()
    spans = [s for s in otel.spans.get_finished_spans() if s.name == "notification.deliver"]
    assert [s.attributes["notification.outcome"] for s in spans] == ["failed", "delivered"]
    assert [s.attributes["notification.attempt"] for s in spans] == [1, 2]
    assert {s.attributes["notification.id"] for s in spans} == {entry.id}
    assert spans[0].status.status_code is StatusCode.ERROR
    assert spans[0].attributes["http.response.status_code"] == 503
    assert "HTTP 503" in (spans[0].status.description or "")
    by_outcome = {p.attributes["outcome"]: int(p.value) for p in otel.points("notifications.tries")}
    assert by_outcome == {"failed": 1, "delivered": 1}
    assert all(
        p.attributes["notification.channel"] == "ops" for p in otel.points("notifications.tries")
    )
    mine = [
        p
        for p in otel.points("notifications.pending")
        if p.attributes["dispatcher"] == dispatcher.name
    ]
    assert [p.value for p in mine] == [0]  # nothing left undelivered at its last pass
