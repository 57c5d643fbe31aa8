"""What a sweeper pass and the uncertain gauge ask the store for: the UNCERTAIN and the
PENDING records by status, oldest update first, bounded by the pass's start, streamed a
few dozen at a time (so a record the pass writes is not met again), and a count of the
UNCERTAIN ones by select; never a scan of the ledger. Seen through a `Spy` over the store;
the stream is a `JsonStore`, which pages its selects from a cursor as the stores do."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from crewai_idempotent import InMemoryCacheBackend, Ledger, Order, Select, Status
from crewai_idempotent.reconciliation import Progress, Result, Sweeper
from tests.cli.spying import JsonStore, Spy
from tests.support.reconcile import stale_claim, uncertain, wait_for


def _sweeper(ledger: Ledger, **options: Any) -> Sweeper:
    options.setdefault("channels", [])
    return Sweeper(ledger, entry_points=False, trust=["tests"], **options)


def _candidates(spy: Spy) -> list[Select]:
    return [q for q in spy.selects if q.order is Order.OLDEST]


@pytest.mark.parametrize("on_loop", [False, True], ids=["sweep", "asweep"])
def test_a_pass_selects_the_open_records_by_status_oldest_update_first(on_loop: bool) -> None:
    spy = Spy(InMemoryCacheBackend())
    ledger = Ledger(spy, wait_s=0)
    for i in range(30):
        ledger.run(f"done:{i}", lambda: "ok")
    stale_claim(spy, "pay:stale")  # last written a minute ago: the oldest
    for key in ("pay:c", "pay:b", "pay:a"):  # written in this order, the reverse of the keys'
        uncertain(ledger, key, {"answer": "unknown"})
    stale_claim(spy, "pay:live", lapsed_s=-600)  # its owner renews it: not looked at
    spy.forget()
    sweeper = _sweeper(ledger, dry_run=True, concurrency=1)
    before = time.time()
    report = asyncio.run(sweeper.asweep()) if on_loop else sweeper.sweep()
    assert [r.key for r in report.results] == ["pay:stale", "pay:c", "pay:b", "pay:a"]
    queries = _candidates(spy)
    assert [(q.status, q.order) for q in queries] == [
        (Status.UNCERTAIN, Order.OLDEST), (Status.PENDING, Order.OLDEST),
    ]  # fmt: skip
    for query in queries:
        assert query.updated_before is not None and before <= query.updated_before <= time.time()
        assert query == Select(status=query.status, order=Order.OLDEST,
                               updated_before=query.updated_before)  # fmt: skip
    assert Select(status=Status.UNCERTAIN) in spy.selects  # what stays open, counted
    assert report.open_uncertain == 3
    assert spy.scans == []  # never the ledger: the 30 committed records are not read
    assert sum(spy.taken) == 3 + 2 + 3


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_pass_meets_each_record_once_though_it_writes_them_as_it_goes(
    concurrency: int,
) -> None:
    """Unknown answers write each record (moving it to the end of the order by update),
    and the store's stream is read a few dozen at a time while the pass writes: each
    record is still looked at once, in one pass."""
    store = JsonStore()
    ledger = Ledger(store, wait_s=0)
    keys = [f"pay:{i:03d}" for i in range(150)]
    for key in keys:
        uncertain(ledger, key, {"answer": "unknown"})
    report = _sweeper(ledger, concurrency=concurrency).sweep()
    assert sorted(r.key for r in report.results) == keys
    assert report.counts()["unknown"] == 150 and report.open_uncertain == 150
    again = _sweeper(ledger, concurrency=concurrency, backoff_s=0).sweep()
    assert sorted(r.key for r in again.results) == keys  # the next pass meets them again


def test_a_pass_of_given_keys_reads_those_keys_alone() -> None:
    spy = Spy(InMemoryCacheBackend())
    ledger = Ledger(spy, wait_s=0)
    for key in ("pay:1", "pay:2", "pay:3"):
        uncertain(ledger, key, {"answer": "unknown"})
    spy.forget()
    report = _sweeper(ledger, dry_run=True, keys=["pay:3", "pay:1", "pay:9"]).sweep()
    assert [r.key for r in report.results] == ["pay:1", "pay:3"]
    assert _candidates(spy) == [] and spy.scans == []


def test_a_progress_display_hears_the_total_before_the_first_record() -> None:
    ledger = Ledger(InMemoryCacheBackend(), wait_s=0)
    for key in ("pay:1", "pay:2"):
        uncertain(ledger, key, {"answer": "unknown"})
    heard: list[Any] = []

    class Heard(Progress):
        def started(self, total: int) -> None:
            heard.append(("started", total))

        def done(self, result: Result) -> None:
            heard.append(("done", result.key))

    _sweeper(ledger, dry_run=True, concurrency=1).sweep(Heard())
    assert heard == [("started", 2), ("done", "pay:1"), ("done", "pay:2")]


def test_the_uncertain_gauge_counts_by_select() -> None:
    from crewai_idempotent import otel

    spy = Spy(InMemoryCacheBackend())
    ledger = Ledger(spy, wait_s=0)
    for i in range(20):
        ledger.run(f"done:{i}", lambda: "ok")
    uncertain(ledger, "pay:1", {"answer": "unknown"})
    spy.forget()
    otel.watch_uncertain(ledger, interval_s=3600)
    try:
        wait_for(lambda: bool(spy.selects), "the gauge's first count")
    finally:
        otel.stop_watching()
    assert spy.selects == [Select(status=Status.UNCERTAIN)] and spy.scans == []
    assert spy.taken == [1]
