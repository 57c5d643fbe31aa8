"""Spend-cap windows keep their state with every write (held while calls hold money in
them, else standing for a total or crew cap, settled for a kickoff's, task's or day's),
and `budgets()` reads the windows that count now: the held and standing ones by state, the
others written within a day, never every kickoff's window ever written (`every=True`
reads them all). Time is a clock the test moves."""

from __future__ import annotations

from typing import Any

import pytest

from crewai_idempotent import InMemoryCacheBackend, Money, Record, SpendCap, SpendLedger, Status
from crewai_idempotent.gates import _gatestore
from crewai_idempotent.gates._spend import Where, windows
from tests.cli.spying import Spy
from tests.support.clock import ClockedBackend, ManualClock

DAY = 86400.0
TOTAL = ("pay", SpendCap(10_000, "EUR", per="total"))
KICKOFF = ("pay", SpendCap(1_000, "EUR", per="kickoff"))


def _state(backend: Any, key: str) -> str | None:
    doc = _gatestore.read(backend, key)
    assert doc is not None
    return doc.get("state")


def test_each_write_keeps_the_windows_state() -> None:
    backend = InMemoryCacheBackend()
    spend = SpendLedger(backend)
    kickoff, total = windows([TOTAL, KICKOFF], Where(kickoff="k1"), backend.now())  # by key
    assert (total.cap.per, kickoff.cap.per) == ("total", "kickoff")
    spend.reserve("pay:1", 1, Money(100, "EUR"), [total, kickoff])
    assert _state(backend, total.key) == _state(backend, kickoff.key) == "held"
    spend.settle("pay:1", 1, [total, kickoff], spent=True)
    assert _state(backend, total.key) == "standing"
    assert _state(backend, kickoff.key) == "settled"


def test_budgets_reads_the_windows_that_count_now() -> None:
    clock = ManualClock()
    backend = Spy(ClockedBackend(InMemoryCacheBackend(), clock))
    spend = SpendLedger(backend)
    first = windows([TOTAL, KICKOFF], Where(kickoff="k1"), backend.now())
    spend.reserve("pay:1", 1, Money(100, "EUR"), first)
    spend.settle("pay:1", 1, first, spent=True)
    # An uncertain call keeps its money held in kickoff k2's window.
    held = windows([KICKOFF], Where(kickoff="k2"), backend.now())
    backend.insert(Record("pay:2", Status.UNCERTAIN, "fp", 1, 1, None, 1, 0.0, 0.0))
    spend.reserve("pay:2", 1, Money(50, "EUR"), held)
    clock.advance(2 * DAY)
    later = windows([TOTAL, KICKOFF], Where(kickoff="k3"), backend.now())
    spend.reserve("pay:3", 1, Money(10, "EUR"), later)
    spend.settle("pay:3", 1, later, spent=True)

    backend.forget()
    shown = {b.window: b for b in spend.budgets()}
    assert set(shown) == {"total", "kickoff-k2", "kickoff-k3"}  # not k1's, two days old
    assert shown["total"].committed == 110 and shown["kickoff-k2"].reserved == 50
    assert [q.state for q in backend.selects] == ["held", "standing", None]
    assert backend.selects[2].updated_from == pytest.approx(backend.now() - DAY, abs=5)
    assert backend.scans == []
    every = {b.window for b in spend.budgets(every=True)}
    assert every == {"total", "kickoff-k1", "kickoff-k2", "kickoff-k3"}
    assert {b.window for b in spend.budgets(recent_s=3 * DAY)} == every
    for bad in (-1, "1d", True):
        with pytest.raises(ValueError, match="recent_s"):
            spend.budgets(recent_s=bad)  # type: ignore[arg-type]


def test_a_window_an_earlier_version_wrote_gets_its_state_at_the_next_write() -> None:
    """The previous release writes windows without a state: one is shown while it is
    recent, and this version's next write of it (any call that counts in it) states it."""
    clock = ManualClock()
    backend = ClockedBackend(InMemoryCacheBackend(), clock)
    (total,) = windows([TOTAL], Where(), backend.now())
    spend = SpendLedger(backend)
    spend.reserve("pay:1", 1, Money(100, "EUR"), [total])
    spend.settle("pay:1", 1, [total], spent=True)

    def unstated(doc: dict[str, Any] | None, now: float) -> dict[str, Any]:
        assert doc is not None
        return {k: v for k, v in doc.items() if k != "state"}

    _gatestore.update(backend, total.key, unstated)
    assert _state(backend, total.key) is None
    assert [b.window for b in spend.budgets()] == ["total"]  # recent: shown
    clock.advance(2 * DAY)
    assert spend.budgets() == []  # old and unstated: `every=True` (spend --all) shows it
    assert [b.window for b in spend.budgets(every=True)] == ["total"]
    spend.reserve("pay:2", 1, Money(10, "EUR"), [total])
    assert _state(backend, total.key) == "held"
