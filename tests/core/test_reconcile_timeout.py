"""A reconciler that never answers: the call ends after `reconcile_timeout_s` with
OutcomeUncertain, the body never runs, and the callers waiting on the key are released.

Nothing here measures time. The sync path waits for its reconciler on the ledger's clock,
which here is `Cue`: real time for everything else, but a wait for a reconciler ends when
the test says the timeout has passed, so a test can prove the call waited exactly
`reconcile_timeout_s` (the seconds it asked the clock for) and ended once they passed.
The reconciler itself blocks on an Event the test sets only after the call has returned:
its late answer must change nothing. The async path is bounded on the event loop's own
clock, with short timeouts; those tests assert what happened, never how long it took.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import (
    CacheBackend,
    Found,
    IdempotencyConfig,
    Ledger,
    OutcomeUncertain,
    Owner,
    Record,
    Status,
)
from crewai_idempotent.integration._config import ToolOptions, settings_for
from tests.support.faults.provider import Provider


class Cue:
    """A clock whose waits for a reconciler end when the test calls `expire()` (or the
    awaited event is set); monotonic time and sleeps are real."""

    def __init__(self) -> None:
        self.expired = threading.Event()
        self.asked: list[float] = []

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        self.asked.append(seconds)
        while not event.is_set():
            if self.expired.wait(0.002):
                return event.is_set()
        return True

    def expire(self) -> None:
        self.expired.set()


class Hanging:
    """A reconciler that does not answer until `release` is set, then says Found."""

    def __init__(self) -> None:
        self.asked, self.release, self.returned = (
            threading.Event(),
            threading.Event(),
            (threading.Event()),
        )
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, key: str, args: Any) -> Any:
        with self._lock:
            self.calls += 1
        self.asked.set()
        try:
            assert self.release.wait(60)
            return Found("the late answer")
        finally:
            self.returned.set()


class Peeks(CacheBackend):
    """`backend`, counting its peeks: each caller of a store that reads first peeks once,
    before it waits in the key's room."""

    def __init__(self, backend: CacheBackend) -> None:
        self.backend = backend
        self.read_first = backend.read_first
        self.host_clock = backend.host_clock
        self.reads: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _read(self, name: str) -> None:
        with self._lock:
            self.reads[name] += 1

    def now(self) -> float:
        return self.backend.now()

    def insert(self, record: Record) -> Record | None:
        return self.backend.insert(record)

    def replace(self, current: Record, new: Record) -> bool:
        return self.backend.replace(current, new)

    def get(self, key: str) -> Record | None:
        return self.backend.get(key)

    def peek(self, key: str) -> Any:
        self._read("peek")
        return self.backend.peek(key)

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        return self.backend.scan(status)

    def delete(self, current: Record) -> bool:
        return self.backend.delete(current)


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider.create(tmp_path / "charges.jsonl")


@pytest.fixture
def hanging() -> Iterator[Hanging]:
    reconciler = Hanging()
    yield reconciler
    reconciler.release.set()  # whatever a test asserted, no thread is left waiting


def _stale(backend: CacheBackend, key: str = "k") -> Record:
    """A claim whose owner died (its lease lapsed a minute ago)."""
    now = backend.now()
    record = Record(
        key=key, status=Status.PENDING, fingerprint="", token=1, revision=1,
        owner=Owner("dead-host", 4242, "dead"), attempts=1, created_at=now - 90,
        updated_at=now - 90, lease_expires_at=now - 60,
    )  # fmt: skip
    assert backend.insert(record) is None
    return record


def _settled(hanging: Hanging) -> None:
    """Let the reconciler answer, and wait until its thread is done with that answer."""
    hanging.release.set()
    assert hanging.returned.wait(30)
    for thread in threading.enumerate():
        if thread.name == "crewai-idempotent-reconcile":
            thread.join(30)


def test_a_reconciler_that_never_answers_ends_the_call_uncertain(
    backend: CacheBackend, provider: Provider, hanging: Hanging
) -> None:
    _stale(backend)
    cue = Cue()
    ledger = Ledger(backend, clock=cue, reconcile_timeout_s=45.0)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            ledger.run("k", lambda: provider.charge("k"), reconcile=hanging)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert hanging.asked.wait(30)
    cue.expire()  # 45 s pass on the ledger's clock
    caller.join(30)
    assert not caller.is_alive()
    [raised] = outcome
    assert isinstance(raised, OutcomeUncertain)
    assert "did not answer within reconcile_timeout_s=45 s" in raised.reason
    assert cue.asked == [45.0]  # it waited for its reconciler exactly that long
    assert provider.effects() == []
    after = ledger.get("k")
    assert after is not None and after.status is Status.UNCERTAIN

    _settled(hanging)  # the reconciler answers Found now: too late, and ignored
    assert ledger.get("k") == after
    assert provider.effects() == []
    assert hanging.calls == 1


# Callers of a key meet in one room per process whatever the store; with a store that
# reads first each of them peeks once, which tells the test they are all waiting.
@pytest.mark.parametrize("backend_kind", ["memory", "sqlite", "filelock"], indirect=True)
def test_the_callers_waiting_for_that_answer_are_released_with_it(
    backend: CacheBackend, provider: Provider, hanging: Hanging
) -> None:
    """Eight callers of the key in one process: one asks the reconciler, the others wait
    for it; when it does not answer in time, all of them get OutcomeUncertain, and the
    reconciler is not asked again for each of them in turn."""
    store = Peeks(backend)
    _stale(backend)
    cue = Cue()
    ledger = Ledger(store, clock=cue, reconcile_timeout_s=45.0)
    raised: list[BaseException] = []
    lock = threading.Lock()

    def call() -> None:
        try:
            ledger.run("k", lambda: provider.charge("k"), reconcile=hanging)
        except BaseException as exc:  # noqa: BLE001
            with lock:
                raised.append(exc)

    callers = [threading.Thread(target=call) for _ in range(8)]
    for caller in callers:
        caller.start()
    assert hanging.asked.wait(30)
    _until(lambda: store.reads["peek"] >= 8)  # every caller has looked and is waiting
    cue.expire()
    for caller in callers:
        caller.join(30)
        assert not caller.is_alive()
    assert len(raised) == 8 and all(isinstance(e, OutcomeUncertain) for e in raised)
    assert all("reconcile_timeout_s=45" in str(e) for e in raised)
    assert hanging.calls == 1
    assert provider.effects() == []


def _until(done: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "not done in time"
        time.sleep(0.002)


# -- async -------------------------------------------------------------------------------


def test_an_async_reconciler_is_cancelled(backend: CacheBackend, provider: Provider) -> None:
    _stale(backend)
    ledger = Ledger(backend, reconcile_timeout_s=0.2)
    cancelled: list[bool] = []

    async def reconcile(key: str, args: Any) -> Any:
        try:
            await asyncio.Event().wait()  # never set
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def body() -> str:
        return provider.charge("k")

    with pytest.raises(OutcomeUncertain, match="did not answer within reconcile_timeout_s"):
        asyncio.run(ledger.arun("k", body, reconcile=reconcile))
    assert cancelled == [True]
    assert provider.effects() == []
    record = ledger.get("k")
    assert record is not None and record.status is Status.UNCERTAIN


def test_a_sync_reconciler_on_the_async_path_is_left_to_finish(
    backend: CacheBackend, provider: Provider, hanging: Hanging
) -> None:
    _stale(backend)
    ledger = Ledger(backend, reconcile_timeout_s=0.2)

    async def body() -> str:
        return provider.charge("k")

    with pytest.raises(OutcomeUncertain, match="did not answer"):
        asyncio.run(ledger.arun("k", body, reconcile=hanging))
    after = ledger.get("k")
    assert after is not None and after.status is Status.UNCERTAIN
    _settled(hanging)
    assert ledger.get("k") == after and provider.effects() == []


def test_a_hundred_waiting_tasks_are_released_with_the_owner(
    backend: CacheBackend, provider: Provider, hanging: Hanging
) -> None:
    """A hundred tasks of one key on one loop: the first to hold the key's room asks the
    reconciler; when it does not answer within the bound (the loop's own clock, a second
    here), every task ends with OutcomeUncertain and the reconciler was asked once."""
    _stale(backend)
    ledger = Ledger(backend, reconcile_timeout_s=1.0)

    async def body() -> str:
        return provider.charge("k")

    async def main() -> list[Any]:
        calls = [ledger.arun("k", body, reconcile=hanging) for _ in range(100)]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, OutcomeUncertain) for r in results), results[:3]
    assert hanging.calls == 1
    assert provider.effects() == []


# -- where the setting comes from --------------------------------------------------------


def test_the_setting_goes_tool_then_crew_then_process(backend: CacheBackend) -> None:
    from crewai_idempotent import configure

    previous = configure(backend=backend, reconcile_timeout_s=30.0)
    try:
        crew = IdempotencyConfig(reconcile_timeout_s=20.0)

        def timeout(tool: ToolOptions, crew: IdempotencyConfig | None) -> float | None:
            return settings_for("t", tool, crew).options.reconcile_timeout_s

        assert timeout(ToolOptions(reconcile_timeout_s=10.0), crew) == 10.0
        assert timeout(ToolOptions(), crew) == 20.0
        assert timeout(ToolOptions(), None) == 30.0
    finally:
        configure(previous)
    configure(backend=backend)
    try:  # set nowhere: the ledger's own
        unset = settings_for("t", ToolOptions(), None)
        assert unset.options.reconcile_timeout_s == unset.ledger.reconcile_timeout_s
    finally:
        configure(previous)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "soon", True])
def test_a_bad_timeout_is_refused_where_it_is_given(backend: CacheBackend, bad: Any) -> None:
    for make in (
        lambda: ToolOptions(reconcile_timeout_s=bad),
        lambda: IdempotencyConfig(reconcile_timeout_s=bad),
        lambda: Ledger(backend, reconcile_timeout_s=bad),
        lambda: Ledger(backend).run("k", lambda: 1, reconcile_timeout_s=bad),
    ):
        with pytest.raises((TypeError, ValueError), match="reconcile_timeout_s"):
            make()
    assert backend.get("k") is None
