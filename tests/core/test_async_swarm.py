"""A thousand concurrent async calls on one event loop, on every backend.

The bar from the async issue: callers of one key wait on the loop (not in threads), learn
of the owner's commit without each polling the store, and return as soon as it lands;
other work on the loop keeps running; distinct keys all run once. Effects are counted at
the fake provider, store calls at a counting wrapper, the loop's stalls in its thread's
CPU time: no bound here is a wall-clock one, which a loaded machine would break. (A
caller that learnt of the commit late would wait out its lease, an hour, which the hang
guard, minutes, catches; the guard is not a measurement.)
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import CacheBackend, Ledger, Record, Status
from tests.support.faults.provider import Provider

CALLERS = 1000
WAVE = 100
BODY_S = 0.05
# Waiters wait for the owner's lease or their wait_s: an hour, unless news of the commit
# ends the wait. A call still running after HANG_S learnt of the commit late (or never).
PATIENT = {"wait_s": 3600.0, "lease_s": 3600.0}
HANG_S = 120.0
TICK_S = 0.005
# The bound on how long the loop may be held up, in the loop thread's CPU time: in
# wall-clock time a loop thread descheduled on a loaded machine is late without anyone
# holding the loop. That no store call ever blocks the loop is checked directly (the
# threads they ran on).
STALL_S = 0.020


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider.create(tmp_path / "charges.jsonl")


class Counting(CacheBackend):
    """`backend`, counting the calls made to it and the threads they ran on."""

    def __init__(self, backend: CacheBackend) -> None:
        self.backend = backend
        self.calls: Counter[str] = Counter()
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self._lock:
            self.calls[name] += 1
            self.threads.add(threading.current_thread().name)

    def now(self) -> float:
        return self.backend.now()

    def now_blocks(self) -> bool:
        return self.backend.now_blocks()

    def insert(self, record: Record) -> Record | None:
        self._count("insert")
        return self.backend.insert(record)

    def replace(self, current: Record, new: Record) -> bool:
        self._count("replace")
        return self.backend.replace(current, new)

    def get(self, key: str) -> Record | None:
        self._count("get")
        return self.backend.get(key)

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        return self.backend.scan(status)

    def delete(self, current: Record) -> bool:
        return self.backend.delete(current)


class Ticker:
    """A task that wants the loop every TICK_S and remembers its longest wait beyond that,
    in wall-clock time and in the loop thread's CPU time (the work that held it up)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.worst_cpu = 0.0
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last, last_cpu = loop.time(), time.thread_time()
        while not self._stop.is_set():
            await asyncio.sleep(TICK_S)
            now, cpu = loop.time(), time.thread_time()
            self.worst = max(self.worst, now - last - TICK_S)
            self.worst_cpu = max(self.worst_cpu, cpu - last_cpu)
            last, last_cpu = now, cpu

    async def stop(self) -> tuple[float, float]:
        self._stop.set()
        await self._task
        return self.worst, self.worst_cpu


def _reads_at_commit(owner: Ledger, store: Counting) -> Counter[str]:
    """The store calls counted when `owner` committed "k" (filled in then)."""
    seen: Counter[str] = Counter()

    def listener(kind: str, record: Record) -> None:
        if kind == "commit" and record.key == "k":
            seen.update(store.calls)

    owner.add_listener(listener)
    return seen


async def _guarded(calls: list[Any]) -> list[Any]:
    """Every call's outcome; fails if one is still waiting after HANG_S (it did not learn
    of the commit that ended its wait)."""
    _, pending = await asyncio.wait(calls, timeout=HANG_S)
    assert not pending, f"{len(pending)} callers were still waiting {HANG_S} s on"
    return [call.result() for call in calls]


def test_a_thousand_callers_of_one_key_run_it_once(
    backend: CacheBackend, provider: Provider
) -> None:
    store = Counting(backend)
    ledger = Ledger(store, **PATIENT)
    at_commit = _reads_at_commit(ledger, store)
    arrived = 0

    async def charge() -> str:
        await asyncio.sleep(BODY_S)
        while arrived < CALLERS:  # the whole crowd is there before the commit
            await asyncio.sleep(0.001)
        return provider.charge("k")

    async def call() -> Any:
        nonlocal arrived
        arrived += 1
        return await ledger.aexecute("k", charge)

    async def warm() -> str:
        return "warm"

    async def main() -> tuple[list[Any], tuple[float, float]]:
        # A warm ledger, as a server's is after its first requests: its threads and its
        # connections exist (starting a thread waits for it to start).
        await asyncio.gather(*(ledger.arun(f"warm-up-{n}", warm) for n in range(8)))
        store.calls.clear()
        ticker = Ticker()
        await asyncio.sleep(0.05)  # the ticker is running before the crowd arrives
        # The crowd arrives within a few turns of the loop, all well inside the body's
        # 50 ms: every call is concurrent with every other. (A thousand tasks started in
        # one turn would hold the loop for their thousand first steps, whatever they do.)
        calls = []
        for _ in range(CALLERS // WAVE):
            calls += [asyncio.create_task(call()) for _ in range(WAVE)]
            await asyncio.sleep(0)
        results = await _guarded(calls)
        return results, await ticker.stop()

    # The stall measured is the ledger's hold on the loop. A full garbage collection of
    # the test process's heap (crewai and pytest loaded) can take longer than the bound
    # on its own, whatever runs on the loop; servers freeze their start-up heap the same
    # way (gc.freeze) to keep those pauses short.
    gc.collect()
    gc.freeze()
    try:
        results, (stall, stall_cpu) = asyncio.run(main())
    finally:
        gc.unfreeze()
    ledger.close()

    [receipt] = provider.receipts("k")
    assert [o.value for o in results] == [receipt] * CALLERS
    assert sum(not o.replayed for o in results) == 1
    held_up = f"the loop was held up for {stall * 1000:.1f} ms ({stall_cpu * 1000:.1f} ms CPU)"
    assert stall_cpu <= STALL_S, held_up
    # One caller claimed and the others learnt of the commit in this process: the crowd
    # did not ask the store one by one, before the commit (one poller, backing off to
    # 0.2 s, would need forty seconds to read as often as each caller reading once) or
    # after it (the poller's next read at most, none of the others').
    assert store.calls["insert"] == 1
    assert store.calls["get"] < CALLERS // 5, store.calls
    assert store.calls["get"] - at_commit["get"] <= 2, (at_commit, store.calls)
    # The store was only ever called from the ledger's own lanes, never the loop's
    # default pool (and never the loop's own thread).
    assert all(name.startswith("crewai-idempotent-") for name in store.threads), store.threads
    assert ledger.stats().rooms == 0


def test_a_thousand_distinct_keys_each_run_once(backend: CacheBackend, provider: Provider) -> None:
    ledger = Ledger(backend)
    keys = [f"key-{n}" for n in range(CALLERS)]

    async def main() -> list[Any]:
        def body(key: str) -> Any:
            async def charge() -> str:
                await asyncio.sleep(BODY_S)
                return provider.charge(key)

            return charge

        return await asyncio.gather(*(ledger.aexecute(key, body(key)) for key in keys))

    outcomes = asyncio.run(main())
    again = asyncio.run(main())
    ledger.close()

    effects = Counter(effect["key"] for effect in provider.effects())
    assert effects == Counter(keys)  # each key ran exactly once
    assert not any(o.replayed for o in outcomes)
    assert all(o.replayed for o in again)
    assert [o.value for o in again] == [o.value for o in outcomes]


def _inside_its_body(owner: Ledger, provider: Provider) -> tuple[threading.Thread, threading.Event]:
    """`owner` claims "k" on a thread and stays inside the body until the event is set."""
    inside, release = threading.Event(), threading.Event()

    def slow() -> str:
        inside.set()
        assert release.wait(10)
        return provider.charge("k")

    thread = threading.Thread(target=owner.run, args=("k", slow))
    thread.start()
    assert inside.wait(10)
    return thread, release


def test_waiters_in_another_process_share_one_poller(
    backend: CacheBackend, provider: Provider
) -> None:
    # The owner is another ledger (as another process would be): its commit is not
    # announced here, so the waiters must learn it from the store, through one poller.
    owner = Ledger(backend)
    store = Counting(backend)
    waiters = Ledger(store, **PATIENT)
    at_commit = _reads_at_commit(owner, store)
    thread, release = _inside_its_body(owner, provider)

    async def charge() -> str:
        return provider.charge("k")

    async def main() -> list[Any]:
        crowd = [asyncio.create_task(waiters.aexecute("k", charge)) for _ in range(200)]
        await asyncio.sleep(0.5)
        release.set()
        return await _guarded(crowd)

    results = asyncio.run(main())
    thread.join(10)
    owner.close()
    waiters.close()

    [receipt] = provider.receipts("k")
    assert all(o.replayed and o.value == receipt for o in results)
    # One poller's reads (backing off to 0.2 s), not 200 pollers': fewer than a read per
    # four waiters before the commit (ten seconds of one poller), and after it only the
    # read that found it (each of 200 pollers would need its own).
    assert store.calls["insert"] == 1
    assert store.calls["get"] < 50, store.calls
    assert store.calls["get"] - at_commit["get"] <= 2, (at_commit, store.calls)


def test_a_cancelled_waiter_leaves_nothing_behind(
    backend: CacheBackend, provider: Provider
) -> None:
    ledger = Ledger(backend)

    async def main() -> None:
        inside, release = asyncio.Event(), asyncio.Event()

        async def slow() -> str:
            inside.set()
            await release.wait()
            return provider.charge("k")

        owner = asyncio.create_task(ledger.arun("k", slow))
        await inside.wait()
        waiters = [asyncio.create_task(ledger.arun("k", slow)) for _ in range(50)]
        await asyncio.sleep(0.1)
        for waiter in waiters:
            waiter.cancel()
        for waiter in waiters:
            with pytest.raises(asyncio.CancelledError):
                await waiter
        assert ledger.stats().rooms == 0
        record = ledger.get("k")
        assert record is not None and record.status is Status.PENDING  # still the owner's
        assert [event.kind for event in record.history] == ["claim"]
        release.set()
        assert await owner == provider.receipts("k")[0]

    asyncio.run(main())
    record = ledger.get("k")
    ledger.close()
    assert record is not None and record.status is Status.COMMITTED
    assert len(provider.effects("k")) == 1


class StuckClaims(Counting):
    """Claims of keys starting with "stuck" hang until `release` is set."""

    def __init__(self, backend: CacheBackend) -> None:
        super().__init__(backend)
        self.release = threading.Event()
        self.stuck = 0
        self.unstuck = 0  # stuck claims that have returned

    def insert(self, record: Record) -> Record | None:
        if record.key.startswith("stuck"):
            with self._lock:
                self.stuck += 1
            assert self.release.wait(60)
            with self._lock:
                self.unstuck += 1
        return super().insert(record)


def test_an_owners_commit_does_not_queue_behind_claims(
    backend: CacheBackend, provider: Provider
) -> None:
    store = StuckClaims(backend)
    ledger = Ledger(store)

    async def main() -> int:
        inside, finish = asyncio.Event(), asyncio.Event()

        async def owner_body() -> str:
            inside.set()
            await finish.wait()
            return provider.charge("k")

        async def other() -> str:
            return provider.charge("other")

        owner = asyncio.create_task(ledger.arun("k", owner_body))
        await inside.wait()
        # A crowd of claims that the store does not answer fills every claim thread.
        crowd = [asyncio.create_task(ledger.arun(f"stuck-{n}", other)) for n in range(20)]
        while store.stuck < 4:
            await asyncio.sleep(0.01)
        finish.set()
        try:
            receipt = await owner  # commits on its own lane meanwhile
            # Counted when the commit is back: had it queued behind the stuck claims, it
            # would have come back only once they did (when they gave up, a minute on).
            unstuck = store.unstuck
            assert receipt == provider.receipts("k")[0]
            record = await asyncio.get_running_loop().run_in_executor(None, backend.get, "k")
            assert record is not None and record.status is Status.COMMITTED
        finally:
            store.release.set()
        await asyncio.gather(*crowd)
        return unstuck

    unstuck_at_commit = asyncio.run(main())
    ledger.close()
    assert unstuck_at_commit == 0, "the commit came back only after the stuck claims did"
    assert len(provider.effects("other")) == 20


def test_threads_and_tasks_wait_in_one_room(backend: CacheBackend, provider: Provider) -> None:
    # Sync callers in threads and async callers on a loop, all waiting for an owner in
    # "another process" (another ledger): one poller between them, one effect.
    owner = Ledger(backend)
    store = Counting(backend)
    waiters = Ledger(store)
    owner_thread, release = _inside_its_body(owner, provider)
    replays: list[Any] = []

    def sync_waiter() -> None:
        replays.append(waiters.execute("k", lambda: provider.charge("k")))

    threads = [threading.Thread(target=sync_waiter) for _ in range(50)]
    for thread in threads:
        thread.start()

    async def charge() -> str:
        return provider.charge("k")

    async def main() -> list[Any]:
        crowd = asyncio.gather(*(waiters.aexecute("k", charge) for _ in range(100)))
        await asyncio.sleep(0.5)
        release.set()
        return await crowd

    replays += asyncio.run(main())
    for thread in [owner_thread, *threads]:
        thread.join(10)
    owner.close()
    waiters.close()

    [receipt] = provider.receipts("k")
    assert len(replays) == 150
    assert all(o.replayed and o.value == receipt for o in replays)
    assert store.calls["get"] <= 15, store.calls
    assert waiters.stats().rooms == 0
