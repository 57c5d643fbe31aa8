"""The sweeper in one process, on every backend: what it settles and how, what it leaves
alone, how it backs off, where it finds reconcilers, and what a reconciler that raises,
hangs or returns garbage leaves behind. Bodies are counted at the fake provider; records
are read back through the store."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from crewai_idempotent import (
    CacheBackend,
    Found,
    InMemoryCacheBackend,
    Ledger,
    LedgerUnavailable,
    OutcomeUncertain,
    Record,
    SQLiteCacheBackend,
    Status,
)
from crewai_idempotent.ledger._backend import url_of
from crewai_idempotent.notifications import Dispatcher, Entry, Message, Outbox, _incidents
from crewai_idempotent.reconciliation import Alert, Sweeper, _registry, register, unregister
from crewai_idempotent.reconciliation._sweeper import unknown_answers
from tests.support.clock import ClockedBackend, ManualClock
from tests.support.faults.provider import Provider
from tests.support.notify import Receiver
from tests.support.reconcile import ASKED_ENV, asked, stale_claim, uncertain, wait_for


class Collected:
    """An alert channel that keeps what it is sent."""

    def __init__(self) -> None:
        self.alerts: list[Alert] = []

    def send(self, alert: Alert) -> None:
        self.alerts.append(alert)


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider.create(tmp_path / "effects.jsonl")


@pytest.fixture
def asked_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "asked.jsonl"
    Provider.create(path)
    monkeypatch.setenv(ASKED_ENV, str(path))
    return path


@pytest.fixture
def sweeper_of() -> Iterator[Callable[..., Sweeper]]:
    made: list[Sweeper] = []

    def make(ledger: Ledger, **options: Any) -> Sweeper:
        options.setdefault("channels", [])
        options.setdefault("entry_points", False)
        options.setdefault("trust", ["tests"])
        sweeper = Sweeper(ledger, **options)
        made.append(sweeper)
        return sweeper

    yield make
    for sweeper in made:
        sweeper.close()


def _body(provider: Provider, key: str) -> Callable[[], str]:
    return lambda: provider.charge(key)


def test_found_absent_unknown_settle_and_the_next_call_follows(
    backend: CacheBackend, provider: Provider, sweeper_of: Callable[..., Sweeper]
) -> None:
    ledger = Ledger(backend, wait_s=0)
    for key, said in (("pay:found", "found"), ("pay:absent", "absent"), ("pay:unknown", "unknown")):
        uncertain(ledger, key, {"answer": said})
    report = sweeper_of(ledger).sweep()
    outcomes = {r.key: r.outcome for r in report.results}
    assert outcomes == {"pay:found": "found", "pay:absent": "absent", "pay:unknown": "unknown"}
    assert report.open_uncertain == 1

    found, absent, unknown = (backend.get(k) for k in ("pay:found", "pay:absent", "pay:unknown"))
    assert found is not None and absent is not None and unknown is not None
    assert (found.status, found.value(), found.token) == (Status.COMMITTED, "receipt-pay:found", 1)
    assert found.history[-1].kind == "reconcile" and found.history[-1].by.startswith("sweeper ")
    assert found.call is None and found.reconciling is None  # settled: the arguments are gone
    assert (absent.status, absent.history[-1].kind) == (Status.FAILED, "absent")
    assert (unknown.status, unknown.history[-1].kind) == (Status.UNCERTAIN, "unknown")
    assert "the provider cannot tell yet" in unknown.history[-1].note
    assert unknown.error == "the tool reported an unknown outcome: the provider did not answer"
    assert unknown.call is not None  # still open: kept for the next ask

    # The next call of each key: the receipt replayed, the absent one run once, the unknown
    # one stopped. No body ran for the first and the last.
    assert ledger.run("pay:found", _body(provider, "pay:found"), fingerprint="fp") == (
        "receipt-pay:found"
    )
    ledger.run("pay:absent", _body(provider, "pay:absent"), fingerprint="fp")
    with pytest.raises(OutcomeUncertain):
        ledger.run("pay:unknown", _body(provider, "pay:unknown"), fingerprint="fp")
    assert [e["key"] for e in provider.effects()] == ["pay:absent"]


def test_a_stale_claim_is_settled_and_its_owner_named(
    backend: CacheBackend, sweeper_of: Callable[..., Sweeper]
) -> None:
    ledger = Ledger(backend)
    for key, said in (("c:found", "found"), ("c:absent", "absent"), ("c:unknown", "unknown")):
        stale_claim(backend, key, {"answer": said})
    report = sweeper_of(ledger).sweep()
    assert {r.key: r.outcome for r in report.results} == {
        "c:found": "found", "c:absent": "absent", "c:unknown": "unknown",
    }  # fmt: skip
    found, absent, unknown = (backend.get(k) for k in ("c:found", "c:absent", "c:unknown"))
    assert found is not None and found.status is Status.COMMITTED
    assert "lease expired" in found.history[-1].note
    assert absent is not None and absent.status is Status.FAILED
    assert unknown is not None and unknown.status is Status.UNCERTAIN
    assert unknown.error is not None and "gone-host:4242:dead0001" in unknown.error
    assert "the provider cannot tell yet" in unknown.error
    for record in (found, absent, unknown):
        assert record.token == 1 and record.lease_expires_at is None


def test_an_owner_renewing_its_lease_keeps_it(
    backend: CacheBackend, sweeper_of: Callable[..., Sweeper], asked_file: Path
) -> None:
    ledger = Ledger(backend, lease_s=0.6)
    started, release = threading.Event(), threading.Event()

    def body() -> str:
        started.set()
        assert release.wait(60)
        return "the owner's receipt"

    options = ledger._call_options(None, None, None, "tests.support.reconcile:answer", None)
    outcome: list[Any] = []
    owner = threading.Thread(
        target=lambda: outcome.append(ledger._execute("live", body, options.of_call("fp", {})))
    )
    owner.start()
    assert started.wait(60)
    sweeper = sweeper_of(ledger)
    claim = backend.get("live")
    assert claim is not None
    # Sweep until the owner has renewed its lease twice during the sweeps.
    while (current := backend.get("live")) is not None and current.revision < claim.revision + 2:
        report = sweeper.sweep()
        assert [r.key for r in report.results] == []  # a live owner's claim is not even read
    release.set()
    owner.join(60)
    record = backend.get("live")
    assert record is not None and record.status is Status.COMMITTED
    assert record.value() == "the owner's receipt" and outcome[0].value == "the owner's receipt"
    assert [e.kind for e in record.history] == ["claim", "commit"]
    assert asked(asked_file) == []


def test_the_decision_leaves_a_live_claim_alone_even_when_asked_about_it(
    backend: CacheBackend,
) -> None:
    """`_sweep` itself (not just the pass's choice of records) refuses a live lease, a
    record needing an operator, another sweeper's mark and a settled record."""
    ledger = Ledger(backend)
    now = backend.now()
    live = stale_claim(backend, "k:live", lapsed_s=-300)  # its lease runs for 5 more minutes
    operator = uncertain(ledger, "k:operator")
    flagged = operator.evolve(None, needs_operator=True)
    assert backend.replace(operator, flagged)
    marked = uncertain(ledger, "k:marked")
    assert backend.replace(marked, marked.evolve(None, reconciling=("sweeper other", now + 300)))
    asked_about: list[str] = []

    def pick(record: Record) -> Any:
        asked_about.append(record.key)
        return "not asked"

    for key in ("k:live", "k:operator", "k:marked", "k:none"):
        swept = ledger._drive(ledger._sweep(key, pick, "sweeper me", 60))
        assert swept.outcome == "skipped", (key, swept)
    assert asked_about == []
    assert backend.get("k:live") == live
    # A mark that lapsed (its sweeper died) no longer holds the record back.
    lapsed = backend.get("k:marked")
    assert lapsed is not None
    assert backend.replace(lapsed, lapsed.evolve(None, reconciling=("sweeper other", now - 1)))
    swept = ledger._drive(ledger._sweep("k:marked", pick, "sweeper me", 60))
    assert (swept.outcome, asked_about) == ("left", ["k:marked"])


def test_a_needs_operator_record_is_reported_and_never_asked(
    backend: CacheBackend, sweeper_of: Callable[..., Sweeper], asked_file: Path
) -> None:
    ledger = Ledger(backend)
    record = uncertain(ledger, "k:two")
    assert backend.replace(record, record.evolve(None, needs_operator=True))
    report = sweeper_of(ledger).sweep()
    ((result,),) = [report.results]
    assert (result.outcome, result.reason) == (
        "skipped", "two executions may have happened: only resolve settles it",
    )  # fmt: skip
    assert asked(asked_file) == []


@pytest.mark.parametrize("backend_kind", ["memory", "sqlite"])
def test_unknown_backs_off_doubling_across_sweepers(
    backend: CacheBackend, sweeper_of: Callable[..., Sweeper], asked_file: Path
) -> None:
    clock = ManualClock()
    moved = ClockedBackend(backend, clock)
    ledger = Ledger(moved, clock=clock)
    uncertain(ledger, "k:later", {"answer": "unknown"})
    first, second = (sweeper_of(ledger, backoff_s=60, max_backoff_s=150) for _ in range(2))
    assert [r.outcome for r in first.sweep().results] == ["unknown"]
    # Another sweeper (another host, say) reads the same history and waits too.
    (left,) = second.sweep().results
    assert left.outcome == "left" and "backing off" in left.reason
    clock.advance(61)
    assert [r.outcome for r in second.sweep().results] == ["unknown"]
    clock.advance(61)  # the second wait is 120 s
    assert [r.outcome for r in first.sweep().results] == ["left"]
    clock.advance(60)
    assert [r.outcome for r in first.sweep().results] == ["unknown"]
    clock.advance(151)  # capped at max_backoff_s
    assert [r.outcome for r in first.sweep().results] == ["unknown"]
    record = backend.get("k:later")
    assert record is not None and unknown_answers(record)[0] == 4
    assert len(asked(asked_file)) == 4


@pytest.mark.parametrize("backend_kind", ["memory", "sqlite", "filelock"])
@pytest.mark.parametrize(
    ("said", "reason"),
    [
        ("raise", "reconciler raised ConnectionError: the provider is down"),
        ("garbage", "reconciler returned 42, not Found(result), Absent or Unknown"),
    ],
)
def test_a_reconciler_that_raises_or_returns_garbage_leaves_it_uncertain(
    backend: CacheBackend,
    sweeper_of: Callable[..., Sweeper],
    provider: Provider,
    said: str,
    reason: str,
) -> None:
    ledger = Ledger(backend, wait_s=0)
    uncertain(ledger, "k:bad", {"answer": said})
    stale_claim(backend, "k:bad-stale", {"answer": said})
    report = sweeper_of(ledger).sweep()
    assert sorted((r.key, r.outcome, r.reason) for r in report.results) == [
        ("k:bad", "unknown", reason), ("k:bad-stale", "unknown", reason),
    ]  # fmt: skip
    for key in ("k:bad", "k:bad-stale"):
        record = backend.get(key)
        assert record is not None and record.status is Status.UNCERTAIN
        assert record.history[-1].kind == "unknown" and reason in record.history[-1].note
        with pytest.raises(OutcomeUncertain):
            ledger.run(key, _body(provider, key), fingerprint="fp")
    assert provider.effects() == []


@pytest.mark.parametrize("backend_kind", ["memory", "sqlite"])
def test_a_reconciler_that_hangs_is_unknown_at_its_timeout_and_its_late_answer_ignored(
    backend: CacheBackend,
    sweeper_of: Callable[..., Sweeper],
    provider: Provider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock()
    ledger = Ledger(backend, clock=clock, wait_s=0)
    asking, release = threading.Event(), threading.Event()

    def hangs(key: str, args: Any) -> Any:
        asking.set()
        release.wait(60)
        return Found("too late")

    caplog.set_level(logging.INFO, "crewai_idempotent")

    uncertain(ledger, "hung:1", tool="hung")
    sweeper = sweeper_of(ledger, reconcilers={"hung": hangs}, timeout_s=30)
    # The ledger's clock is moved past the timeout once the reconciler is being asked,
    # and again until the sweep returns: a single move could land before the driver reads
    # the clock for its deadline, and the wait would then last 30 s of real time.
    swept = threading.Event()

    def move() -> None:
        asking.wait(60)
        while not swept.is_set():
            clock.advance(31)
            swept.wait(0.01)

    mover = threading.Thread(target=move)
    mover.start()
    try:
        (result,) = sweeper.sweep().results
    finally:
        swept.set()
        mover.join()
    assert result.outcome == "unknown"
    assert "did not answer within reconcile_timeout_s=30 s" in result.reason
    release.set()
    record = backend.get("hung:1")
    assert record is not None and record.status is Status.UNCERTAIN
    with pytest.raises(OutcomeUncertain):
        ledger.run("hung:1", _body(provider, "hung:1"), fingerprint="fp")
    assert provider.effects() == []
    ignored = "a reconciler answered after its caller stopped waiting; ignored"
    wait_for(lambda: ignored in caplog.text, "the late answer")
    after = backend.get("hung:1")
    assert after is not None and after.status is Status.UNCERTAIN  # the late Found changed nothing


def test_on_the_loop_a_hung_reconciler_holds_no_lane_and_is_unknown(
    sweeper_of: Callable[..., Sweeper], provider: Provider
) -> None:
    backend = InMemoryCacheBackend()
    ledger = Ledger(backend, wait_s=0)
    release = threading.Event()

    def hangs(key: str, args: Any) -> Any:
        release.wait(60)
        return Found("too late")

    async def hangs_async(key: str, args: Any) -> Any:
        await asyncio.Event().wait()  # never set: cancelled at the timeout

    uncertain(ledger, "hung:sync", tool="hung")
    uncertain(ledger, "hung:async", tool="hung_async")
    # The async driver bounds the ask with asyncio's own timer: a short one, no assertion
    # on how long anything took.
    sweeper = sweeper_of(
        ledger, reconcilers={"hung": hangs, "hung_async": hangs_async}, timeout_s=0.2
    )
    try:
        report = asyncio.run(sweeper.asweep())
    finally:
        release.set()
    assert sorted((r.key, r.outcome) for r in report.results) == [
        ("hung:async", "unknown"), ("hung:sync", "unknown"),
    ]  # fmt: skip
    for result in report.results:
        assert "did not answer within reconcile_timeout_s=0.2 s" in result.reason
        with pytest.raises(OutcomeUncertain):
            ledger.run(result.key, _body(provider, result.key), fingerprint="fp")
    assert provider.effects() == []


def test_a_dry_run_asks_nothing_and_writes_nothing(
    backend: CacheBackend, sweeper_of: Callable[..., Sweeper], asked_file: Path
) -> None:
    ledger = Ledger(backend)
    before = [uncertain(ledger, "k:1"), stale_claim(backend, "k:2"), uncertain(ledger, "x:3")]
    before[2] = _without_path(backend, before[2])
    report = sweeper_of(ledger, dry_run=True, trust=["tests"]).sweep()
    assert sorted((r.key, r.outcome) for r in report.results) == [
        ("k:1", "due"), ("k:2", "due"), ("x:3", "left"),
    ]  # fmt: skip
    assert [backend.get(r.key) for r in before] == before
    assert asked(asked_file) == []
    assert "would ask about 3 record(s)" in report.summary()


def _without_path(backend: CacheBackend, record: Record) -> Record:
    """The record as a tool without a reconciler, or with a lambda, leaves it."""
    bare = record.evolve(None, call={"args": (record.call or {}).get("args"), "ttl": None})
    assert backend.replace(record, bare)
    return bare


# -- where reconcilers are found ------------------------------------------------------------


@pytest.mark.parametrize("backend_kind", ["memory"])
def test_reconcilers_are_found_by_tool_name_and_by_trusted_path_only(
    backend: CacheBackend,
    sweeper_of: Callable[..., Sweeper],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ledger = Ledger(backend)
    anonymous = lambda key, args: Found("?")  # noqa: E731 - a reconciler with no path
    uncertain(ledger, "given:1", reconcile=anonymous, tool="given")
    uncertain(ledger, "registered_tool:1", reconcile=anonymous)  # the tool, by key prefix
    uncertain(ledger, "function_registered:1", reconcile=anonymous)
    uncertain(ledger, "by_path:1", tool="by_path")
    uncertain(ledger, "exec:1", reconcile="builtins:exec", tool="evil")
    stale_claim(backend, "entry:1", reconciler=None, tool="from_entry_point")

    class Point:
        name, value = "from_entry_point", "tests.support.reconcile:answer"

    monkeypatch.setattr(_registry.importlib.metadata, "entry_points", lambda group: [Point()])
    register("function_registered", lambda key, args: Found(f"fn-{key}"))
    try:
        sweeper = sweeper_of(
            ledger,
            reconcilers={"given": lambda key, args: Found(f"given-{key}")},
            # registers registered_tool (@reconciles), and is trusted for by_path's path
            imports=["tests.support.reconcile"],
            trust=[],
            entry_points=True,
        )
        report = sweeper.sweep()
    finally:
        unregister("function_registered")
    results = {r.key: r for r in report.results}
    assert {k: r.outcome for k, r in results.items()} == {
        "given:1": "found", "registered_tool:1": "found", "function_registered:1": "found",
        "by_path:1": "found", "exec:1": "left", "entry:1": "found",
    }  # fmt: skip
    assert results["exec:1"].reason.startswith("its tool names the reconciler builtins:exec")
    assert "--import builtins" in results["exec:1"].reason
    values = {k: backend.get(k).value() for k in results if k != "exec:1"}  # type: ignore[union-attr]
    assert values == {
        "given:1": "given-given:1", "registered_tool:1": "registered-registered_tool:1",
        "function_registered:1": "fn-function_registered:1", "by_path:1": "receipt-by_path:1",
        "entry:1": "receipt-entry:1",
    }  # fmt: skip
    exec_record = backend.get("exec:1")
    assert exec_record is not None and exec_record.status is Status.UNCERTAIN


@pytest.mark.parametrize("backend_kind", ["memory"])
def test_an_untrusted_path_is_never_imported(
    backend: CacheBackend, sweeper_of: Callable[..., Sweeper]
) -> None:
    ledger = Ledger(backend)
    uncertain(ledger, "outside:1", reconcile="tests.support.reconcile:explode", tool="outside")
    uncertain(ledger, "ghost:1", reconcile="tests.support.reconcile:answer", tool="ghost")
    record = backend.get("ghost:1")
    assert record is not None
    ghost = record.evolve(None, call={**(record.call or {}), "reconciler": "no_such_mod:f"})
    assert backend.replace(record, ghost)
    report = sweeper_of(ledger, trust=["crewai_idempotent"]).sweep()
    results = {r.key: r for r in report.results}
    assert results["outside:1"].outcome == "left"
    assert "--import tests.support.reconcile" in results["outside:1"].reason
    report = sweeper_of(ledger, trust=["no_such_mod"]).sweep()
    ghosted = {r.key: r for r in report.results}["ghost:1"]
    assert ghosted.outcome == "left" and "cannot import the reconciler no_such_mod:f" in (
        ghosted.reason
    )


def test_a_sweeper_without_a_tool_name_uses_the_fallback(
    sweeper_of: Callable[..., Sweeper],
) -> None:
    backend = InMemoryCacheBackend()
    ledger = Ledger(backend)
    uncertain(ledger, "plainkey", reconcile=lambda k, a: Found("?"))
    report = sweeper_of(ledger, reconcilers={"*": lambda key, args: Found("any")}).sweep()
    assert [(r.key, r.outcome) for r in report.results] == [("plainkey", "found")]


def _claimed_by_an_older_release(backend: CacheBackend, key: str) -> Record:
    """An UNCERTAIN record as the previous release stored it for a tool without a
    reconciler: the document has no "call" at all, so it names no tool."""
    now = backend.now()
    owner = ["old-host", 4242, "old00001"]
    doc = {
        "v": 1, "key": key, "status": "UNCERTAIN", "fingerprint": "fp", "token": 1,
        "revision": 2, "owner": owner, "attempts": 1, "created_at": now - 60,
        "updated_at": now - 50, "lease_expires_at": None, "expires_at": None, "result": None,
        "error": "the tool reported an unknown outcome: lost", "needs_operator": False,
        "evidence": [],
        "history": [
            [now - 60, "claim", 1, "old-host:4242:old00001", ""],
            [now - 50, "uncertain", 1, "old-host:4242:old00001", "lost"],
        ],
    }  # fmt: skip
    record = Record.from_json(json.dumps(doc))
    assert record.call is None
    assert backend.insert(record) is None
    return record


def test_an_older_claim_without_a_tool_name_is_left_with_what_to_register(
    sweeper_of: Callable[..., Sweeper],
) -> None:
    backend = InMemoryCacheBackend()
    ledger = Ledger(backend)
    _claimed_by_an_older_release(backend, "charge:o-7")
    _claimed_by_an_older_release(backend, "plainkey")
    register("charge_card", lambda key, args: Found("by name"))
    try:
        results = {r.key: r for r in sweeper_of(ledger).sweep().results}
    finally:
        unregister("charge_card")
    assert {k: (r.outcome, r.tool) for k, r in results.items()} == {
        "charge:o-7": ("left", "charge"), "plainkey": ("left", None),
    }  # fmt: skip
    assert results["charge:o-7"].reason == (
        "no reconciler for tool 'charge' in this sweeper: its claim does not record the "
        "tool's name (a claim by an older release, or made without crewAI), so 'charge' is "
        "its key's prefix: register one for 'charge' (--import MODULE, the "
        "'crewai_idempotent.reconcilers' entry points) or name it by import path on the tool"
    )
    assert results["plainkey"].reason.startswith(
        "no reconciler for this key in this sweeper: its claim does not record the tool's name"
    )
    assert "reconcilers={'*': ...}" in results["plainkey"].reason
    # What the message says to do settles it: a reconciler for the key's prefix.
    report = sweeper_of(ledger, reconcilers={"charge": lambda key, args: Found("by prefix")})
    assert [(r.key, r.outcome) for r in report.sweep().results if r.key != "plainkey"] == [
        ("charge:o-7", "found")
    ]
    settled = backend.get("charge:o-7")
    assert settled is not None and settled.value() == "by prefix"


@pytest.mark.parametrize("backend_kind", ["memory"])
def test_tool_narrows_by_the_recorded_name_or_the_key_prefix(
    backend: CacheBackend, sweeper_of: Callable[..., Sweeper]
) -> None:
    ledger = Ledger(backend)
    uncertain(ledger, "charge:o-1", tool="charge_card")  # the name its claim records
    _claimed_by_an_older_release(backend, "charge:o-2")  # the key's prefix only
    uncertain(ledger, "mail:m-1", tool="send_mail")
    for tools in (["charge_card"], ["charge"]):
        report = sweeper_of(ledger, tools=tools, dry_run=True).sweep()
        expected = ["charge:o-1"] if tools == ["charge_card"] else ["charge:o-1", "charge:o-2"]
        assert sorted(r.key for r in report.results) == expected, tools


def test_an_async_reconciler_serves_both_drivers(sweeper_of: Callable[..., Sweeper]) -> None:
    backend = InMemoryCacheBackend()
    ledger = Ledger(backend)

    where: list[str] = []

    async def find(key: str, args: Any) -> Any:
        await asyncio.sleep(0)
        where.append(threading.current_thread().name)
        return Found(f"async-{key}")

    for key in ("a:1", "a:2"):
        uncertain(ledger, key, tool="a")
    first = sweeper_of(ledger, keys=["a:1"], reconcilers={"a": find})
    assert [r.outcome for r in first.sweep().results] == ["found"]
    sweeper = sweeper_of(ledger, keys=["a:2"], reconcilers={"a": find})
    assert [r.outcome for r in asyncio.run(sweeper.asweep()).results] == ["found"]
    assert [backend.get(k).value() for k in ("a:1", "a:2")] == ["async-a:1", "async-a:2"]  # type: ignore[union-attr]
    # Run to its end on a thread of its own by the sync pass, awaited on the loop (here, in
    # the main thread) by the async one.
    assert where == ["crewai-idempotent-reconcile", threading.main_thread().name]


# -- the async pass, the background watch ------------------------------------------------------


def test_asweep_settles_as_sweep_does(
    backend: CacheBackend, sweeper_of: Callable[..., Sweeper]
) -> None:
    ledger = Ledger(backend)
    for n in range(6):
        uncertain(ledger, f"k:{n}", {"answer": ("found", "absent", "unknown")[n % 3]})
    stale_claim(backend, "k:stale", {"answer": "found"})
    report = asyncio.run(sweeper_of(ledger, concurrency=3).asweep())
    assert report.counts()["found"] == 3 and report.counts()["absent"] == 2
    assert report.counts()["unknown"] == 2 and report.open_uncertain == 2
    statuses = {r.key: r.status for r in backend.scan()}
    assert statuses["k:stale"] is Status.COMMITTED and statuses["k:1"] is Status.FAILED


@pytest.mark.parametrize("backend_kind", ["memory", "sqlite"])
def test_start_sweeps_in_the_background_until_stopped(
    backend: CacheBackend, sweeper_of: Callable[..., Sweeper]
) -> None:
    ledger = Ledger(backend)
    watching = sweeper_of(ledger).start(interval_s=0.01)
    try:
        uncertain(ledger, "bg:1")
        wait_for(lambda: backend.get("bg:1").status is Status.COMMITTED, "the background sweep")  # type: ignore[union-attr]
    finally:
        watching.stop(60)
    assert not watching.running and watching.reports


def test_awatch_runs_its_passes_on_the_loop(sweeper_of: Callable[..., Sweeper]) -> None:
    backend = InMemoryCacheBackend()
    ledger = Ledger(backend)
    uncertain(ledger, "aw:1")
    reports: list[Any] = []
    asyncio.run(sweeper_of(ledger).awatch(0, passes=2, on_report=reports.append))
    assert [r.counts()["found"] for r in reports] == [1, 0]


# -- alerts --------------------------------------------------------------------------------------


def test_alerts_for_records_open_too_long_and_reconcilers_that_keep_saying_unknown(
    sweeper_of: Callable[..., Sweeper], caplog: pytest.LogCaptureFixture
) -> None:
    from crewai_idempotent.reconciliation import LogAlerts

    backend = InMemoryCacheBackend()
    ledger = Ledger(backend)
    uncertain(ledger, "slow:1", {"answer": "unknown"})
    collected = Collected()
    sweeper = sweeper_of(
        ledger, backoff_s=0, alert_after_s=0, alert_unknowns=2, channels=[collected, LogAlerts()]
    )
    with caplog.at_level(logging.WARNING, "crewai_idempotent.reconciliation"):
        for _ in range(3):
            sweeper.sweep()
    kinds = [a.kind for a in collected.alerts]
    # Each condition said once (alert_every_s), though three passes saw it.
    assert kinds == ["uncertain_too_long", "verifier_unknown"]
    aging, unknowns = collected.alerts
    assert (
        aging.key == "slow:1"
        and aging.record is not None
        and aging.id == "uncertain_too_long:slow:1:1"
    )
    assert unknowns.unknowns == 2 and "the provider cannot tell yet" in unknowns.reason
    logged = [
        r.getMessage() for r in caplog.records if r.name == "crewai_idempotent.reconciliation"
    ]
    assert any(m.startswith("uncertain_too_long: 'slow:1' in memory://") for m in logged)
    assert any(m.startswith("verifier_unknown: 'slow:1'") for m in logged)


class _Unreachable(InMemoryCacheBackend):
    down = True

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        if self.down:
            raise ConnectionError("connection refused")
        return super().scan(status)


def test_a_ledger_the_sweeper_cannot_read_is_an_alert_and_the_watch_goes_on(
    sweeper_of: Callable[..., Sweeper],
) -> None:
    backend = _Unreachable()
    ledger = Ledger(backend)
    collected = Collected()

    class Broken:
        def send(self, alert: Alert) -> None:
            raise RuntimeError("this channel is broken")

    sweeper = sweeper_of(ledger, channels=[Broken(), collected])
    reports: list[Any] = []
    sweeper.watch(0, passes=2, on_report=reports.append)
    assert [r.error for r in reports] == ["memory://: ConnectionError: connection refused"] * 2
    assert [a.kind for a in collected.alerts] == ["ledger_unreachable"]  # said once
    backend.down = False
    uncertain(ledger, "back:1")
    sweeper.watch(0, passes=1, on_report=reports.append)
    assert reports[-1].error is None and reports[-1].counts()["found"] == 1
    backend.down = True
    sweeper.sweep()  # a new outage is said again
    assert [a.kind for a in collected.alerts] == ["ledger_unreachable"] * 2


class _Named(ClockedBackend):
    """A moved clock that still names its store's URL, as the alerts and entries show it."""

    @property
    def url(self) -> str:
        return url_of(self.backend)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    started = Receiver().start()
    yield started
    started.stop()


def _alert_entries(backend: CacheBackend) -> list[Entry]:
    return [e for e in Outbox(backend).entries() if e.type.startswith("alert.")]


def test_an_old_record_a_reconciler_keeps_calling_unknown_is_one_outbox_entry_per_condition(
    backend: CacheBackend,
    backend_url: str,
    sweeper_of: Callable[..., Sweeper],
    receiver: Receiver,
) -> None:
    clock = ManualClock()
    moved = _Named(backend, clock)
    ledger = Ledger(moved, clock=clock)
    uncertain(ledger, "pay:late", {"answer": "unknown"}, tool="charge_card")
    # Two sweepers with the default channels (the log, OpenTelemetry, the outbox), saying
    # every condition on every pass (alert_every_s=0): only the outbox keeps them to one.
    options: dict[str, Any] = {"backoff_s": 0, "alert_after_s": 3600, "alert_unknowns": 2}
    first, second = (
        sweeper_of(ledger, channels=None, alert_every_s=0, **options) for _ in range(2)
    )
    assert [(r.outcome, r.tool) for r in first.sweep().results] == [("unknown", "charge_card")]
    assert _alert_entries(moved) == []  # young, and one Unknown: nothing for a person yet
    clock.advance(2 * 3600)
    said = [a.kind for sweeper in (first, second, first) for a in sweeper.sweep().alerts]
    assert said == ["uncertain_too_long", "verifier_unknown"] * 3
    entries = _alert_entries(moved)
    assert sorted(e.type for e in entries) == ["alert.uncertain_too_long", "alert.verifier_unknown"]
    aging = next(e for e in entries if e.type == "alert.uncertain_too_long")
    fields = aging.data["fields"]
    assert aging.subject == "pay:late" and aging.state == "due"
    assert (fields["key"], fields["tool"], fields["status"]) == (
        "pay:late",
        "charge_card",
        "UNCERTAIN",
    )
    assert fields["age_s"] >= 2 * 3600 and fields["alert_id"] == "uncertain_too_long:pay:late:1"
    assert fields["unknowns"] == 2  # what the first pass that said it had seen
    assert re.match(
        r"UNCERTAIN for \d+ s \(threshold 3600 s\): the provider cannot", fields["reason"]
    )
    assert aging.data["title"].startswith("UNCERTAIN too long: charge_card for 2 h")
    assert fields["ledger"] == url_of(backend)
    password = urlsplit(backend_url).password
    if password:  # a server's URL: its password never reaches an entry
        assert password not in json.dumps(aging.data) and "***" in fields["ledger"]

    # What a person reads: the sweeper's title, the facts by name, the commands.
    from crewai_idempotent.notifications._slack import payload

    message = Message.of(aging, moved)
    facts = dict(message.facts())
    assert (facts["Key"], facts["Tool"], facts["Status"]) == (
        "pay:late",
        "charge_card",
        "UNCERTAIN",
    )
    assert facts["Open for"].startswith("2 h") and facts["Unknown answers"] == "2 in a row"
    assert message.text == fields["reason"] and set(message.commands()) == {"show", "resolve"}
    slack = payload(message)
    assert slack["text"] == f"crewai-idempotent: Open too long: a person must check ({aging.id})"
    assert slack["blocks"][0]["text"]["text"] == aging.data["title"]

    # A dispatcher delivers each once, signed; a receiver verifies with the library.
    done = Dispatcher(moved, [receiver.webhook()]).run_once()
    assert done.failed == 0
    got = {
        r["json"]["type"]: r for r in receiver.received if r["json"]["type"].startswith("alert.")
    }
    assert sorted(got) == ["alert.uncertain_too_long", "alert.verifier_unknown"]
    assert all(r["verified"] is True for r in got.values()), [r["error"] for r in got.values()]
    body = got["alert.verifier_unknown"]["json"]
    assert body["id"] == next(e.id for e in entries if e.type == "alert.verifier_unknown")
    assert body["subject"] == "pay:late" and "answering Unknown" in body["title"]
    assert body["data"]["fields"]["unknowns"] >= 2
    assert "resolve pay:late --happened|--absent" in body["commands"]["resolve"]
    # Delivered: further passes write nothing new, and nothing is sent again.
    first.sweep()
    second.sweep()
    assert len(_alert_entries(moved)) == 2
    assert Dispatcher(moved, [receiver.webhook()]).run_once().sent == 0
    assert len([r for r in receiver.received if r["json"]["type"].startswith("alert.")]) == 2


def test_an_alert_entry_never_carries_the_ledger_s_password(
    postgres_server: Any, sweeper_of: Callable[..., Sweeper]
) -> None:
    from crewai_idempotent import backend_from_url

    url = postgres_server.fresh_url().replace("postgres@", "postgres:pw-s3cret-42@", 1)
    backend = backend_from_url(url)
    try:
        ledger = Ledger(backend)
        uncertain(ledger, "pw:1", {"answer": "unknown"})
        sweeper_of(ledger, channels=None, alert_after_s=0).sweep()
        (entry,) = _alert_entries(backend)
        assert "pw-s3cret-42" not in json.dumps(entry.data)
        assert entry.data["fields"]["ledger"].startswith("postgresql://postgres:***@")
    finally:
        backend.close()


def test_on_the_loop_alerts_are_sent_off_it_and_reach_the_outbox(
    sweeper_of: Callable[..., Sweeper],
) -> None:
    from crewai_idempotent.reconciliation import OutboxAlerts

    backend = InMemoryCacheBackend()
    ledger = Ledger(backend)
    uncertain(ledger, "aw:old", {"answer": "unknown"})
    threads: list[int] = []

    class Where:
        def send(self, alert: Alert) -> None:
            threads.append(threading.get_ident())

    sweeper = sweeper_of(ledger, alert_after_s=0, channels=[Where(), OutboxAlerts(backend)])

    async def run() -> tuple[int, Any]:
        return threading.get_ident(), await sweeper.asweep()

    loop_thread, report = asyncio.run(run())
    assert [a.kind for a in report.alerts] == ["uncertain_too_long"]
    assert threads and loop_thread not in threads  # a store write never holds up the loop
    assert [e.type for e in _alert_entries(backend)] == ["alert.uncertain_too_long"]


def test_a_ledger_the_sweepers_cannot_read_is_one_entry_once_it_answers(
    backend: CacheBackend,
    sweeper_of: Callable[..., Sweeper],
    receiver: Receiver,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.notifications.test_ledger_errors import _Outage

    spool = tmp_path / "spool"
    monkeypatch.setenv(_incidents.SPOOL_ENV, str(spool))
    store = _Outage(backend)
    ledger = Ledger(store)
    uncertain(ledger, "back:1")
    first, second = (sweeper_of(ledger, channels=None) for _ in range(2))
    store.down = True
    reports = [sweeper.sweep() for sweeper in (first, second, first)]
    assert all(r.error is not None and "down" in r.error for r in reports)
    assert [len(r.alerts) for r in reports] == [1, 1, 0]  # each sweeper said it once
    # The outbox cannot hold it yet: the ledger's incident on this host does, alert and all
    # (a sweeper that dies now leaves it to the next dispatcher on the host).
    (spooled,) = spool.glob("*/*.json")
    kept = json.loads(spooled.read_text())
    assert kept["alert_id"] == f"ledger_unreachable:{url_of(store)}"
    assert kept["alert"].startswith("the sweeper cannot read the ledger")

    store.down = False
    assert first.sweep().counts()["found"] == 1

    def said() -> list[Entry]:
        return [e for e in Outbox(store).entries() if e.type == "ledger.unavailable"]

    wait_for(said, "the outage was never put in the outbox")
    second.sweep()
    (entry,) = said()
    assert entry.data["alert_id"] == f"ledger_unreachable:{url_of(store)}"
    assert entry.data["alert"].startswith("the sweeper cannot read the ledger")
    assert entry.data["count"] >= 3 and entry.data["ledger"] == url_of(store)
    wait_for(lambda: not list(spool.glob("*/*.json")), "the spool file stayed")

    Dispatcher(store, [receiver.webhook()]).run_once()
    got = [r for r in receiver.received if r["json"]["type"] == "ledger.unavailable"]
    assert [(r["id"], r["verified"]) for r in got] == [(entry.id, True)]
    assert got[0]["json"]["data"]["alert"] == entry.data["alert"]


def test_a_sweeper_that_died_in_an_outage_is_said_by_the_next_dispatcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, receiver: Receiver
) -> None:
    spool = tmp_path / "spool"
    monkeypatch.setenv(_incidents.SPOOL_ENV, str(spool))
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path)
    script = (
        "import os, sys\n"
        "from crewai_idempotent import SQLiteCacheBackend\n"
        "from crewai_idempotent.reconciliation import Sweeper\n"
        "from tests.notifications.test_ledger_errors import _Outage\n"
        "store = _Outage(SQLiteCacheBackend(sys.argv[1]))\n"
        "store.down = True\n"
        "report = Sweeper(store, entry_points=False).sweep()\n"
        "assert report.error is not None and len(report.alerts) == 1, report\n"
        "os._exit(0)  # gone before the ledger answered\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", script, str(path)], env=env, timeout=120)
    assert done.returncode == 0
    assert len(list(spool.glob("*/*.json"))) == 1
    Dispatcher(backend, [receiver.webhook()]).run_once()
    (got,) = receiver.received
    assert got["verified"] is True and got["json"]["type"] == "ledger.unavailable"
    data = got["json"]["data"]
    assert data["alert_id"] == f"ledger_unreachable:{url_of(backend)}"
    assert (
        data["alert"].startswith("the sweeper cannot read the ledger")
        and data["process"] != os.getpid()
    )
    assert not list(spool.glob("*/*.json"))
    assert [e.type for e in Outbox(backend).entries()] == ["ledger.unavailable"]


def test_alerts_and_outcomes_reach_opentelemetry_and_the_open_uncertain_gauge(
    sweeper_of: Callable[..., Sweeper], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from crewai_idempotent import _otel
    from crewai_idempotent.reconciliation import LogAlerts

    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    reader = InMemoryMetricReader()
    _otel.instrument(None, MeterProvider(metric_readers=[reader]))
    try:
        backend = InMemoryCacheBackend()
        ledger = Ledger(backend)
        for key, said in (("m:1", "found"), ("m:2", "unknown"), ("m:3", "unknown")):
            uncertain(ledger, key, {"answer": said})
        sweeper_of(ledger, alert_after_s=0, channels=[LogAlerts()]).sweep()
        points = _points(reader)
    finally:
        _otel.uninstrument()
    swept = {p.attributes["outcome"]: p.value for p in points["idempotency.reconcile.records"]}
    assert swept == {"found": 1, "unknown": 2}
    alerts = points["idempotency.reconcile.alerts"]
    assert [(p.attributes["kind"], p.value) for p in alerts] == [("uncertain_too_long", 2)]
    # The gauge keeps the last count of every backend this process's sweepers reported
    # (other tests' among them); this ledger's is the in-memory one.
    (gauge,) = [
        p for p in points["idempotency.uncertain.open"] if p.attributes["backend"] == "inmemory"
    ]
    assert (gauge.value, gauge.attributes) == (2, {"backend": "inmemory"})


def _points(reader: Any) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


# -- settings --------------------------------------------------------------------------------------


def test_bad_settings_are_refused_where_they_are_given() -> None:
    ledger = Ledger(InMemoryCacheBackend())
    with pytest.raises(ValueError, match="timeout_s must be greater than 0"):
        Sweeper(ledger, timeout_s=0, entry_points=False)
    with pytest.raises(ValueError, match="concurrency must be 1 or more"):
        Sweeper(ledger, concurrency=0, entry_points=False)
    with pytest.raises(TypeError, match=r"reconcilers\['x'\]: a reconciler is a callable"):
        Sweeper(ledger, reconcilers={"x": 3}, entry_points=False)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"an import path is 'package\.module:function'"):
        Sweeper(ledger, reconcilers={"x": "not a path"}, entry_points=False)
    with pytest.raises(ModuleNotFoundError):
        Sweeper(ledger, imports=["no_such_module_here"], entry_points=False)
    with pytest.raises(ValueError, match="no module named 'no_such_mod'"):
        ledger.run("k", lambda: 1, reconcile="no_such_mod:find")
    with pytest.raises(ValueError, match="has no 'nope'"):
        ledger.run("k", lambda: 1, reconcile="tests.support.reconcile:nope")


def test_the_ledger_error_of_one_record_does_not_stop_the_pass(
    sweeper_of: Callable[..., Sweeper],
) -> None:
    class Flaky(InMemoryCacheBackend):
        def replace(self, current: Record, new: Record) -> bool:
            if current.key == "flaky:1" and new.reconciling is not None:
                raise LedgerUnavailable("the disk is full")
            return super().replace(current, new)

    backend = Flaky()
    ledger = Ledger(backend)
    for key in ("flaky:1", "fine:1"):
        uncertain(ledger, key)
    report = sweeper_of(ledger, concurrency=1).sweep()
    results = {r.key: r for r in report.results}
    assert (results["fine:1"].outcome, results["flaky:1"].outcome) == ("found", "error")
    assert "the disk is full" in results["flaky:1"].reason
    flaky = backend.get("flaky:1")
    assert flaky is not None and flaky.status is Status.UNCERTAIN


def test_unknown_answers_count_only_the_current_operation() -> None:
    backend = InMemoryCacheBackend()
    ledger = Ledger(backend)
    uncertain(ledger, "u:1", {"answer": "unknown"})
    sweeper = Sweeper(ledger, backoff_s=0, channels=[], entry_points=False, trust=["tests"])
    sweeper.sweep()
    sweeper.sweep()
    record = backend.get("u:1")
    assert record is not None and unknown_answers(record)[0] == 2
    # A new operation under the key (a new token) starts the count again.
    retried = record.evolve(None, status=Status.UNCERTAIN, token=record.token + 1)
    assert unknown_answers(retried)[0] == 0
