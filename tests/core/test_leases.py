"""Leases, fencing, uncertain outcomes, resolution and history.

The lease and fencing tests use real worker processes (tests/support/faults/worker.py) stopped
with SIGSTOP/SIGCONT or paused at a named point, charging the fake provider whose effect
file is the ground truth. The classification, resolution and history tests run in-process
over every backend.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from crewai_idempotent import (
    CacheBackend,
    FileLockCacheBackend,
    Found,
    Ledger,
    LedgerUnavailable,
    OperationInProgress,
    OutcomeUncertain,
    OutcomeUnknown,
    Record,
    ResolutionRefused,
    SQLiteCacheBackend,
    Status,
    backend_from_url,
)
from tests.support.clock import ClockedBackend, ManualClock
from tests.support.faults import launch
from tests.support.faults.matrix import LOCAL_URLS
from tests.support.faults.provider import Provider
from tests.support.faults.worker import Spec

LEASE_S = 0.3


def kinds(record: Record) -> list[str]:
    return [f"{event.kind}/{event.token}" for event in record.history]


def pid_of(label: str) -> int:
    return int(label.split(":")[-2])


class World:
    """One ledger URL, one provider, and worker processes started against them."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.url, self.tmp = url, tmp
        self.provider = Provider.create(tmp / "provider.jsonl")
        self.ledger = Ledger(backend_from_url(url))
        self.procs: list[launch.Proc] = []

    def spec(self, role: str, key: str, *, started: bool = False, **changes: Any) -> Spec:
        options: dict[str, Any] = {"lease_s": LEASE_S, "wait_s": 30.0, **changes}
        if started:
            options["started"] = str(self.tmp / f"{role}.started")
        return Spec(
            ledger=self.url,
            provider=str(self.provider.path),
            key=key,
            report=str(self.tmp / f"{role}.json"),
            marker=str(self.tmp / f"{role}.at"),
            **options,
        )

    def start(self, role: str, key: str, *, started: bool = False, **changes: Any) -> launch.Proc:
        spec = self.spec(role, key, started=started, **changes)
        proc = launch.start(spec, "exec", self.tmp / f"{role}.log")
        self.procs.append(proc)
        return proc

    def record(self, key: str) -> Record:
        record = self.ledger.get(key)
        assert record is not None
        return record

    def wait_renewed(self, key: str, after: Record, timeout: float = 30.0) -> Record:
        """The record once its owner renewed the lease again (its revision grew)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = self.record(key)
            if record.revision > after.revision:
                return record
            time.sleep(0.005)
        raise AssertionError(f"the lease on {key!r} was not renewed within {timeout} s")

    def wait_stale(self, key: str, timeout: float = 30.0) -> Record:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = self.record(key)
            if self.ledger.is_stale(record):
                return record
            time.sleep(0.01)
        raise AssertionError(f"the lease on {key!r} did not lapse in {timeout} s")

    def stop(self, proc: launch.Proc) -> None:
        """SIGSTOP `proc` at a moment when it holds no ledger lock.

        A process stopped in the middle of a ledger write keeps the write lock (SQLite's,
        or the key's flock) and everyone else waits for it until their busy timeout; that
        is real, but it is not what these tests are about. A probe write with a short
        timeout tells the two cases apart; if it times out, let the process go and stop it
        again a moment later.
        """
        probe = _probe_backend(self.url)
        try:
            for _ in range(50):
                proc.signal(signal.SIGSTOP)
                launch.wait_stopped(proc.pid)
                current = probe.get(proc.spec.key)
                assert current is not None
                try:
                    probe.replace(current, current)  # rewrites nothing; needs the write lock
                    return
                except LedgerUnavailable:
                    proc.signal(signal.SIGCONT)
                    time.sleep(0.02)
            raise AssertionError("the worker was holding a ledger lock every time it stopped")
        finally:
            probe.close()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.signal(signal.SIGCONT)
                proc.kill()
        self.ledger.close()


def _probe_backend(url: str) -> CacheBackend:
    path = Path(urlsplit(url).path)
    if url.startswith("sqlite:"):
        return SQLiteCacheBackend(path, busy_timeout_s=0.1)
    return FileLockCacheBackend(path, lock_timeout_s=0.1)


@pytest.fixture(params=list(LOCAL_URLS))
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[World]:
    built = World(LOCAL_URLS[request.param](tmp_path), tmp_path)
    yield built
    built.close()


def test_long_tool_keeps_its_claim_against_concurrent_workers(world: World) -> None:
    """A body that runs for many lease periods renews its lease; other processes, even with
    on_stale="retry", see it in progress and never start a second copy.

    Real processes keep real time, so the test waits for what it needs to see (renewals,
    counted by the record's revision), never for a length of time."""
    key = "long-tool"
    release = world.tmp / "release-a"
    a = world.start("a", key, pause_at="before_effect", release=str(release))
    launch.wait_for_marker(a)
    claimed = world.record(key)

    # Seven renewals, each a lease_s/3 after the last by the owner's own stamps: more than
    # two lease periods, so a lease that was not renewed would have lapsed twice over.
    leases = [claimed]
    for _ in range(7):
        record = world.wait_renewed(key, leases[-1])
        assert record.status is Status.PENDING and record.token == 1
        assert not world.ledger.is_stale(record)
        leases.append(record)
    expiries = [r.lease_expires_at or 0.0 for r in leases]
    assert expiries == sorted(expiries)
    assert leases[-1].updated_at > (claimed.lease_expires_at or 0.0) + LEASE_S

    impatient = launch.finish(world.start("b", key, on_stale="retry", wait_s=LEASE_S / 2))
    assert impatient["outcome"] == "error"
    assert impatient["error_type"] == "OperationInProgress"
    assert impatient["started"] > leases[-1].updated_at  # after the first lease lapsed
    patient = world.start("c", key, on_stale="retry", wait_s=60.0, started=True)
    launch.wait_for_file(patient, patient.spec.started)
    seen = world.record(key)
    for _ in range(7):  # two more lease periods while it waits
        seen = world.wait_renewed(key, seen)
    assert patient.poll() is None  # still waiting on the live claim
    assert world.provider.effects() == []
    assert world.record(key).token == 1

    release.touch()
    ran = launch.finish(a)
    replayed = launch.finish(patient)
    [charge] = world.provider.effects(key)
    assert ran["outcome"] == "ran" and ran["value"] == charge["receipt"]
    assert charge["pid"] == a.pid
    assert replayed["outcome"] == "replayed" and replayed["value"] == charge["receipt"]
    record = world.record(key)
    assert record.status is Status.COMMITTED
    assert kinds(record) == ["claim/1", "commit/1"]


def test_the_keeper_renews_on_the_ledgers_clock(backend: CacheBackend, provider: Provider) -> None:
    """The same promise in one process, with time moved instead of waited for: the keeper
    keeps its schedule on the ledger's clock, so each lease_s/3 the test moves it brings
    one renewal, and a claim held for three lease periods is never stale. (On real time
    its first renewal would be 200 s away.)"""
    clock = ManualClock()
    store = ClockedBackend(backend, clock)
    lease_s = 600.0
    owner = Ledger(store, lease_s=lease_s, clock=clock)
    inside, leave = threading.Event(), threading.Event()

    def body() -> str:
        inside.set()
        assert leave.wait(60)
        return provider.charge("k")

    worker = threading.Thread(target=owner.run, args=("k", body))
    worker.start()
    try:
        assert inside.wait(30)
        claimed = backend.get("k")
        assert claimed is not None
        seen = claimed
        for _ in range(9):
            clock.advance(lease_s / 3)
            seen = _renewed(backend, seen)
            assert not owner.is_stale(seen)
        assert clock.offset > 2 * lease_s and seen.token == 1
        # Another worker in this process, with on_stale="retry", whose wait_s passes at
        # once on a clock of its own (on the owner's it would outrun the keeper thread):
        # it finds the claim live and never takes it over.
        waiter = Ledger(store, wait_s=2 * lease_s, clock=ManualClock())
        with pytest.raises(OperationInProgress):
            waiter.run("k", lambda: provider.charge("k"), on_stale="retry")
        assert provider.effects() == []
    finally:
        leave.set()
        worker.join(60)
    record = backend.get("k")
    assert record is not None and kinds(record) == ["claim/1", "commit/1"]
    assert len(provider.effects("k")) == 1


def _renewed(backend: CacheBackend, after: Record, timeout: float = 30.0) -> Record:
    """The record once the owner's keeper has written it again (a renewal)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = backend.get(after.key)
        assert record is not None
        if record.revision > after.revision:
            return record
        time.sleep(0.002)
    raise AssertionError(f"the lease on {after.key!r} was not renewed within {timeout} s")


def test_sigstopped_worker_cannot_commit_over_the_new_owner(world: World) -> None:
    """A worker frozen past its lease is taken over (on_stale="retry"); when it wakes and
    finishes, its commit is refused by the fencing token, its receipt is kept as evidence
    and the record is UNCERTAIN with needs_operator: the provider was charged twice."""
    key = "frozen-worker"
    release = world.tmp / "release-a"
    a = world.start("a", key, pause_at="before_effect", release=str(release))
    launch.wait_for_marker(a)
    world.stop(a)
    world.wait_stale(key)

    taker = world.start("b", key, on_stale="retry")
    took = launch.finish(taker)
    assert took["outcome"] == "ran"
    after_takeover = world.record(key)
    assert after_takeover.status is Status.COMMITTED and after_takeover.token == 2

    release.touch()
    a.signal(signal.SIGCONT)
    late = launch.finish(a)
    assert late["outcome"] == "error" and late["error_type"] == "OutcomeUncertain"
    assert late["needs_operator"] is True

    # Exactly what the provider shows: B's charge, then A's late one.
    charges = world.provider.effects(key)
    assert [(c["pid"], c["receipt"]) for c in charges] == [
        (taker.pid, took["value"]),
        (a.pid, charges[1]["receipt"]),
    ]
    record = world.record(key)
    assert record.status is Status.UNCERTAIN and record.needs_operator
    assert record.token == 2
    assert record.value() == took["value"]  # the new owner's receipt is still on the record
    [evidence] = record.evidence
    assert evidence["token"] == 1 and pid_of(evidence["owner"]) == a.pid
    assert evidence["outcome"] == "commit"
    assert evidence["result"] == {"t": "json", "v": charges[1]["receipt"]}
    assert kinds(record) == ["claim/1", "takeover/2", "commit/2", "fenced/2"]
    assert [pid_of(e.by) for e in record.history] == [a.pid, taker.pid, taker.pid, a.pid]
    assert "two executions may have happened" in record.history[-1].note
    times = [e.at for e in record.history]
    assert times == sorted(times)

    # Nothing settles it but a person: not a retry, not even one with a reconciler.
    again = launch.finish(world.start("c", key, reconcile=True))
    assert again["error_type"] == "OutcomeUncertain" and again["reconcile_calls"] == []
    assert len(world.provider.effects(key)) == 2
    resolved = world.ledger.resolve(
        key, result=took["value"], by="ops", reason=f"refunded {charges[1]['receipt']}"
    )
    assert resolved.status is Status.COMMITTED and not resolved.needs_operator
    assert resolved.evidence == record.evidence  # the evidence stays for the audit trail
    final = launch.finish(world.start("d", key))
    assert final["outcome"] == "replayed" and final["value"] == took["value"]
    assert len(world.provider.effects(key)) == 2


def test_resolving_absent_while_the_owner_is_only_frozen_is_caught(world: World) -> None:
    """Why the runbook says: make sure the owner is dead before resolving absent. A frozen
    owner wakes up after the key was resolved and re-run; fencing catches its commit."""
    key = "frozen-then-resolved"
    release = world.tmp / "release-a"
    a = world.start("a", key, pause_at="before_effect", release=str(release))
    launch.wait_for_marker(a)
    world.stop(a)
    world.wait_stale(key)

    halted = launch.finish(world.start("b", key))
    assert halted["error_type"] == "OutcomeUncertain"
    assert world.provider.effects(key) == []  # so an operator concludes "absent"
    world.ledger.resolve(key, absent=True, by="ops", reason="no charge at the provider")
    rerun = launch.finish(world.start("c", key))
    assert rerun["outcome"] == "ran"

    release.touch()
    a.signal(signal.SIGCONT)
    late = launch.finish(a)
    assert late["error_type"] == "OutcomeUncertain" and late["needs_operator"] is True
    assert len(world.provider.effects(key)) == 2
    record = world.record(key)
    assert record.status is Status.UNCERTAIN and record.needs_operator
    assert kinds(record) == [
        "claim/1", "uncertain/1", "resolve/1", "takeover/2", "commit/2", "fenced/2"
    ]  # fmt: skip


def test_late_commit_of_the_reconciled_execution_keeps_the_record_committed(
    world: World,
) -> None:
    key = "found-then-late"
    release = world.tmp / "release-a"
    a = world.start("a", key, pause_at="after_effect", release=str(release))
    launch.wait_for_marker(a)
    world.stop(a)
    world.wait_stale(key)
    found = launch.finish(world.start("b", key, reconcile=True))
    assert found["outcome"] == "replayed" and found["reconcile_calls"] == ["Found"]

    release.touch()
    a.signal(signal.SIGCONT)
    launch.finish(a)
    [charge] = world.provider.effects(key)  # one execution, whatever the ledger says
    assert found["value"] == charge["receipt"]
    record = world.record(key)
    assert (record.status, record.needs_operator) == (Status.COMMITTED, False)


def test_resolving_a_claim_refused_while_live_allowed_once_stale(world: World) -> None:
    key = "killed-in-body"
    a = world.start("a", key, pause_at="before_effect")
    launch.wait_for_marker(a)
    with pytest.raises(ResolutionRefused, match="live lease"):
        world.ledger.resolve(key, absent=True, by="ops", reason="too early: it is running")
    assert a.kill() == -signal.SIGKILL
    world.wait_stale(key)
    resolved = world.ledger.resolve(key, absent=True, by="ops", reason="pid gone, no charge")
    assert resolved.status is Status.FAILED
    ran = launch.finish(world.start("b", key))
    assert ran["outcome"] == "ran"
    assert len(world.provider.effects(key)) == 1
    assert kinds(world.record(key)) == ["claim/1", "resolve/1", "takeover/2", "commit/2"]


# -- in-process: what counts as uncertain --------------------------------------------------


@pytest.fixture
def ledger(backend: CacheBackend) -> Ledger:
    return Ledger(backend, lease_s=5.0, wait_s=0.0)


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider.create(tmp_path / "charges.jsonl")


def _charging(provider: Provider, key: str, then: BaseException | None = None) -> Callable[[], str]:
    def body() -> str:
        receipt = provider.charge(key)
        if then is not None:
            raise then
        return receipt

    return body


@pytest.mark.parametrize(
    "signal_",
    [
        OutcomeUnknown("provider timed out after accepting the request"),
        TimeoutError("read timed out"),
        KeyboardInterrupt(),
    ],
    ids=["OutcomeUnknown", "TimeoutError", "KeyboardInterrupt"],
)
def test_an_interrupted_body_is_uncertain_not_failed(
    ledger: Ledger, provider: Provider, signal_: BaseException
) -> None:
    with pytest.raises(type(signal_)):
        ledger.run("k", _charging(provider, "k", then=signal_))
    record = ledger.get("k")
    assert record is not None and record.status is Status.UNCERTAIN
    assert not record.needs_operator  # one execution; a reconciler may still settle it
    assert kinds(record) == ["claim/1", "uncertain/1"]
    with pytest.raises(OutcomeUncertain) as caught:
        ledger.run("k", _charging(provider, "k"))
    assert caught.value.record == record
    assert len(provider.effects("k")) == 1


def test_a_plain_exception_is_failed_and_runs_again(ledger: Ledger, provider: Provider) -> None:
    def broken() -> str:
        raise ValueError("card declined before charging")

    with pytest.raises(ValueError):
        ledger.run("k", broken)
    assert ledger.get("k").status is Status.FAILED  # type: ignore[union-attr]
    assert ledger.run("k", _charging(provider, "k")) == provider.receipts("k")[0]
    assert kinds(ledger.get("k")) == ["claim/1", "fail/1", "takeover/2", "commit/2"]  # type: ignore[arg-type]


def test_an_uncertain_record_is_settled_by_a_reconciler(ledger: Ledger, provider: Provider) -> None:
    with pytest.raises(OutcomeUnknown):
        ledger.run("k", _charging(provider, "k", then=OutcomeUnknown("timeout")))
    [receipt] = provider.receipts("k")
    value = ledger.run("k", _charging(provider, "k"), reconcile=lambda k, a: Found(receipt))
    assert value == receipt and len(provider.effects("k")) == 1
    assert kinds(ledger.get("k")) == ["claim/1", "uncertain/1", "reconcile/1"]  # type: ignore[arg-type]


def test_async_cancellation_mid_body_is_uncertain(ledger: Ledger, provider: Provider) -> None:
    started = asyncio.Event()

    async def body() -> str:
        provider.charge("k")
        started.set()
        await asyncio.sleep(60)
        return "never"

    async def main() -> None:
        task = asyncio.create_task(ledger.arun("k", body))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    record = ledger.get("k")
    assert record is not None and record.status is Status.UNCERTAIN
    assert "does not prove" in (record.error or "")
    with pytest.raises(OutcomeUncertain):
        ledger.run("k", _charging(provider, "k"))
    assert len(provider.effects("k")) == 1


def test_a_tool_timeout_is_uncertain(ledger: Ledger, provider: Provider) -> None:
    async def slow() -> str:
        provider.charge("k")
        await asyncio.sleep(60)
        return "never"

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(ledger.arun("k", slow), timeout=0.2)

    asyncio.run(main())
    record = ledger.get("k")
    assert record is not None and record.status is Status.UNCERTAIN
    with pytest.raises(OutcomeUncertain):
        asyncio.run(ledger.arun("k", slow))
    assert len(provider.effects("k")) == 1


class _SlowClaims(CacheBackend):
    """`backend`, with each claim (insert) held until `release` is set: the claim is in
    flight on a worker thread while the caller is cancelled."""

    def __init__(self, backend: CacheBackend) -> None:
        self.backend = backend
        self.inserting, self.release = threading.Event(), threading.Event()

    def insert(self, record: Record) -> Record | None:
        self.inserting.set()
        assert self.release.wait(10)
        return self.backend.insert(record)

    def replace(self, current: Record, new: Record) -> bool:
        return self.backend.replace(current, new)

    def get(self, key: str) -> Record | None:
        return self.backend.get(key)

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        return self.backend.scan(status)

    def delete(self, current: Record) -> bool:
        return self.backend.delete(current)


def test_cancelled_before_the_body_started_is_failed(
    backend: CacheBackend, provider: Provider
) -> None:
    slow = _SlowClaims(backend)
    ledger = Ledger(slow)

    async def body() -> str:
        return provider.charge("k")

    async def main() -> None:
        task = asyncio.create_task(ledger.arun("k", body))
        while not slow.inserting.is_set():
            await asyncio.sleep(0.005)
        task.cancel()  # while the claim is on its way to the store
        with pytest.raises(asyncio.CancelledError):
            await task
        slow.release.set()  # now it lands, with nobody left to run the body
        for _ in range(500):
            record = backend.get("k")
            if record is not None and record.status is not Status.PENDING:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert provider.effects("k") == []
    record = backend.get("k")
    assert record is not None and record.status is Status.FAILED
    assert "cancelled before the body started" in (record.error or "")
    assert ledger.run("k", _charging(provider, "k")) == provider.receipts("k")[0]


# -- resolution ----------------------------------------------------------------------------


def _uncertain(ledger: Ledger, provider: Provider, key: str) -> Record:
    with pytest.raises(OutcomeUnknown):
        ledger.run(key, _charging(provider, key, then=OutcomeUnknown("no response")))
    record = ledger.get(key)
    assert record is not None and record.status is Status.UNCERTAIN
    return record


def test_resolve_happened_replays_the_given_result(ledger: Ledger, provider: Provider) -> None:
    _uncertain(ledger, provider, "k")
    [receipt] = provider.receipts("k")
    resolved = ledger.resolve("k", result={"id": receipt}, by="alice", reason="in dashboard")
    assert resolved.status is Status.COMMITTED and resolved.value() == {"id": receipt}
    event = resolved.history[-1]
    assert (event.kind, event.token, event.by) == ("resolve", 1, "alice")
    assert event.note == "happened: in dashboard"
    outcome = ledger.execute("k", _charging(provider, "k"))
    assert outcome.replayed and outcome.value == {"id": receipt}
    assert len(provider.effects("k")) == 1


def test_resolve_absent_lets_the_next_attempt_run_once(ledger: Ledger, provider: Provider) -> None:
    _uncertain(ledger, provider, "k")
    resolved = ledger.resolve("k", absent=True, reason="not in dashboard")
    assert resolved.status is Status.FAILED
    assert resolved.history[-1].by.endswith("@" + resolved.history[0].by.split(":")[0])
    first = ledger.execute("k", _charging(provider, "k"))
    second = ledger.execute("k", _charging(provider, "k"))
    assert not first.replayed and second.replayed and second.value == first.value
    # The body had charged before its OutcomeUnknown: "absent" was the wrong answer, and
    # the ledger cannot know that. The provider is the only source of truth.
    assert len(provider.effects("k")) == 2


def test_resolution_is_refused_unless_uncertain_or_stale(
    ledger: Ledger, provider: Provider
) -> None:
    with pytest.raises(ResolutionRefused, match="no record"):
        ledger.resolve("missing", absent=True)
    ledger.run("done", _charging(provider, "done"))
    with pytest.raises(ValueError):
        ledger.run("failed", _raise(ValueError("declined")))
    for key in ("done", "failed"):
        before = ledger.get(key)
        with pytest.raises(ResolutionRefused, match="only UNCERTAIN"):
            ledger.resolve(key, result="x", reason="no")
        with pytest.raises(ResolutionRefused):
            ledger.resolve(key, absent=True, reason="no")
        assert ledger.get(key) == before

    inside, leave = threading.Event(), threading.Event()

    def running() -> str:
        inside.set()
        leave.wait(10)
        return "ok"

    worker = threading.Thread(target=ledger.run, args=("busy", running))
    worker.start()
    try:
        assert inside.wait(10)
        with pytest.raises(ResolutionRefused, match="live lease"):
            ledger.resolve("busy", absent=True, reason="it is running")
    finally:
        leave.set()
        worker.join()
    assert ledger.get("busy").status is Status.COMMITTED  # type: ignore[union-attr]

    _uncertain(ledger, provider, "u")
    with pytest.raises(ValueError, match="exactly one"):
        ledger.resolve("u")
    with pytest.raises(ValueError, match="exactly one"):
        ledger.resolve("u", result="x", absent=True)


def _raise(exc: Exception) -> Callable[[], Any]:
    def body() -> Any:
        raise exc

    return body


# -- history -------------------------------------------------------------------------------


def test_history_tells_what_happened(ledger: Ledger, provider: Provider) -> None:
    began = ledger.backend.now()
    with pytest.raises(ValueError):
        ledger.run("k", _raise(ValueError("declined")))  # claim/1, fail/1
    with pytest.raises(OutcomeUnknown):  # takeover/2, uncertain/2
        ledger.run("k", _charging(provider, "k", then=OutcomeUnknown("no response")))
    ledger.resolve("k", absent=True, by="bob", reason="provider has nothing")  # resolve/2
    receipt = ledger.run("k", _charging(provider, "k"))  # takeover/3, commit/3
    ended = ledger.backend.now()

    record = ledger.get("k")
    assert record is not None
    assert kinds(record) == [
        "claim/1", "fail/1", "takeover/2", "uncertain/2", "resolve/2", "takeover/3", "commit/3",
    ]  # fmt: skip
    times = [event.at for event in record.history]
    assert times == sorted(times) and began <= times[0] and times[-1] <= ended
    me = str(os.getpid())
    owners = [event.by for event in record.history]
    assert all(owner.split(":")[1] == me for i, owner in enumerate(owners) if i != 4)
    assert owners[4] == "bob" and record.history[4].note == "absent: provider has nothing"
    # Each claim is a different owner id even within one process.
    assert len({owners[0], owners[2], owners[5]}) == 3
    assert record.history[1].note == "ValueError: declined"
    assert "unknown outcome" in record.history[3].note
    assert record.value() == receipt and record.attempts == 3
    assert json.loads(record.to_json())["history"][-1][1] == "commit"
