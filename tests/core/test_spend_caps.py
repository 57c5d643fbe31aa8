"""Spend caps kept in the ledger: reservations made under the claim, settled by outcome.

Effects are counted at the fake provider (tests/support/faults/provider.py), never in log lines.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import random
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from crewai_idempotent import CacheBackend, Ledger, OutcomeUnknown, Status, backend_from_url
from crewai_idempotent._errors import OutcomeUncertain, SpendCapExceeded
from crewai_idempotent.gates._plan import Plan
from crewai_idempotent.gates._spend import (
    Money,
    SpendCap,
    SpendLedger,
    Where,
    format_money,
    windows,
)
from tests.support.faults.provider import Provider
from tests.support.forked_race import fork_together
from tests.support.stores import DURABLE_BACKENDS

ROUNDS = int(os.environ.get("CREWAI_IDEMPOTENT_SPEND_ROUNDS", "50"))
PROCESSES = 16


def _plan(key: str, amount: int, caps: list[SpendCap], currency: str = "EUR") -> Plan:
    return Plan(
        tool="pay",
        fingerprint=f"fp-{key}-{amount}",
        amount=Money(amount, currency),
        caps=[("pay", cap) for cap in caps],
        where=Where(kickoff="k1", crew="c1", task="t1"),
    )


def _pay(ledger: Ledger, provider: Provider, key: str, amount: int, caps: list[SpendCap]) -> Any:
    plan = _plan(key, amount, caps)
    return ledger.run(
        key,
        lambda: provider.charge(key),
        fingerprint=plan.fingerprint,
        stage=plan,
    )


def _time_out(ledger: Ledger, key: str, amount: int, caps: list[SpendCap]) -> None:
    """A call whose provider timed out: its outcome is unknown, its key left UNCERTAIN."""
    plan = _plan(key, amount, caps)

    def timed_out() -> str:
        raise OutcomeUnknown("provider timed out")

    with pytest.raises(OutcomeUnknown):
        ledger.run(key, timed_out, fingerprint=plan.fingerprint, stage=plan)


def _budget(backend: CacheBackend) -> tuple[int, int]:
    (budget,) = SpendLedger(backend).budgets()
    return budget.committed, budget.reserved


def test_calls_that_fit_run_and_the_next_is_refused_with_the_numbers(
    backend: CacheBackend, tmp_path: Path
) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger = Ledger(backend)
    cap = SpendCap(100, "EUR", per="kickoff")
    _pay(ledger, provider, "inv-1", 60, [cap])
    _pay(ledger, provider, "inv-2", 40, [cap])
    with pytest.raises(SpendCapExceeded) as refused:
        _pay(ledger, provider, "inv-3", 1, [cap])
    assert refused.value.limit == 100 and refused.value.spent == 100
    assert refused.value.amount == 1 and refused.value.cap.startswith("pay/kickoff-EUR/")
    assert "0.01 EUR on top of 1.00 EUR spent" in str(refused.value)
    assert "the limit of 1.00 EUR" in str(refused.value)
    assert [e["key"] for e in provider.effects()] == ["inv-1", "inv-2"]
    assert _budget(backend) == (100, 0)
    # The refused call's claim was released as FAILED: nothing ran, a later try may run.
    record = ledger.get("inv-3")
    assert record is not None and record.status is Status.FAILED


def test_a_replay_consumes_nothing(backend: CacheBackend, tmp_path: Path) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger = Ledger(backend)
    cap = SpendCap(100, "EUR")
    first = _pay(ledger, provider, "inv-1", 70, [cap])
    for _ in range(5):
        assert _pay(ledger, provider, "inv-1", 70, [cap]) == first
    assert _budget(backend) == (70, 0)
    assert len(provider.effects()) == 1


def test_a_failed_call_releases_its_reservation(backend: CacheBackend, tmp_path: Path) -> None:
    ledger = Ledger(backend)
    cap = SpendCap(100, "EUR")
    plan = _plan("inv-1", 80, [cap])

    def declined() -> str:
        raise ValueError("card declined")

    with pytest.raises(ValueError):
        ledger.run("inv-1", declined, fingerprint=plan.fingerprint, stage=plan)
    assert _budget(backend) == (0, 0)


def test_an_uncertain_call_keeps_its_reservation_until_resolved_absent(
    backend: CacheBackend, tmp_path: Path
) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger = Ledger(backend)
    cap = SpendCap(100, "EUR")
    _time_out(ledger, "inv-1", 80, [cap])
    assert _budget(backend) == (0, 80)
    with pytest.raises(SpendCapExceeded) as refused:
        _pay(ledger, provider, "inv-2", 30, [cap])
    assert refused.value.reserved == 80
    with pytest.raises(OutcomeUncertain):  # nothing runs under the key until it is resolved
        _pay(ledger, provider, "inv-1", 80, [cap])
    ledger.resolve("inv-1", absent=True, by="ops", reason="not at the provider")
    assert SpendLedger(backend).budgets()[0].reserved == 0  # shown settled at once
    _pay(ledger, provider, "inv-2", 30, [cap])
    assert [e["key"] for e in provider.effects()] == ["inv-2"]
    assert _budget(backend) == (30, 0)


def test_resolve_happened_counts_the_reservation_as_spent(
    backend: CacheBackend, tmp_path: Path
) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger = Ledger(backend)
    cap = SpendCap(100, "EUR")
    _time_out(ledger, "inv-1", 80, [cap])
    ledger.resolve("inv-1", result="ch_found", by="ops", reason="seen at the provider")
    with pytest.raises(SpendCapExceeded):
        _pay(ledger, provider, "inv-2", 30, [cap])
    assert _budget(backend) == (80, 0)
    assert provider.effects() == []


def test_several_caps_reserve_in_all_or_none(backend: CacheBackend, tmp_path: Path) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger = Ledger(backend)
    per_kickoff = SpendCap(200, "EUR", per="kickoff")
    per_day = SpendCap(250, "EUR", per="day")
    caps = [per_kickoff, per_day]
    _pay(ledger, provider, "inv-1", 150, caps)
    with pytest.raises(SpendCapExceeded) as refused:
        _pay(ledger, provider, "inv-2", 60, caps)  # fits the day (210), not the kickoff
    assert "kickoff-EUR" in refused.value.cap
    budgets = {b.cap: (b.committed, b.reserved) for b in SpendLedger(backend).budgets()}
    assert budgets == {"kickoff-EUR": (150, 0), "day-EUR": (150, 0)}
    # Another kickoff: a fresh kickoff window, the same day.
    plan = Plan("pay", "fp-x", Money(120, "EUR"), [("pay", c) for c in caps], Where(kickoff="k2"))
    with pytest.raises(SpendCapExceeded) as refused:
        ledger.run(
            "inv-3",
            lambda: provider.charge("inv-3"),
            fingerprint="fp-x",
            stage=plan,
        )
    assert "day-EUR" in refused.value.cap and refused.value.spent == 150
    assert [e["key"] for e in provider.effects()] == ["inv-1"]


def test_other_currencies_do_not_count(backend: CacheBackend, tmp_path: Path) -> None:
    provider = Provider.create(tmp_path / "effects")
    ledger = Ledger(backend)
    cap = SpendCap(100, "EUR")
    plan = Plan("pay", "fp-usd", Money(5000, "USD"), [("pay", cap)])
    ledger.run("usd-1", lambda: provider.charge("usd-1"), fingerprint="fp-usd", stage=plan)
    assert SpendLedger(backend).budgets() == []
    assert len(provider.effects()) == 1


@pytest.mark.parametrize(
    ("amount", "currency", "shown"),
    [
        (120_000, "EUR", "1,200.00 EUR"),
        (5, "USD", "0.05 USD"),
        (0, "EUR", "0.00 EUR"),
        (1_200, "JPY", "1,200 JPY"),
        (1_500, "KWD", "1.500 KWD"),
        (12_345, "CLF", "1.2345 CLF"),
        (123_456_789, "XAU", "123,456,789 XAU"),
    ],
)
def test_money_is_shown_in_major_units_with_the_currency_exponent(
    amount: int, currency: str, shown: str
) -> None:
    assert format_money(amount, currency) == shown
    assert str(Money(amount, currency)) == shown


def test_bad_amounts_and_caps_are_refused_clearly() -> None:
    with pytest.raises(TypeError, match="minor units"):
        Money(12.5, "EUR")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="minor units"):
        Money(True, "EUR")
    with pytest.raises(ValueError, match="0 or more"):
        Money(-1, "EUR")
    with pytest.raises(ValueError, match="ISO 4217"):
        Money(1, "euro")
    with pytest.raises(ValueError, match="per must be one of"):
        SpendCap(1, "EUR", per="week")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name"):
        SpendCap(1, "EUR", name="has space")


def test_windows_follow_the_call() -> None:
    caps = [("pay", SpendCap(1, "EUR", per=p)) for p in ("kickoff", "crew", "task", "day", "total")]
    found = {w.cap.per: w.window for w in windows(caps, Where("k", "c", "t"), 0.0)}
    assert found == {
        "kickoff": "kickoff-k",
        "crew": "crew-c",
        "task": "task-k-t",
        "day": "1970-01-01",
        "total": "total",
    }


# -- sixteen processes against one cap -------------------------------------------------


class _Round(NamedTuple):
    amounts: dict[str, int]  # one key per process, with the amount it asks to spend
    limit: int
    cap: str


def _rounds(count: int, seed: int) -> list[_Round]:
    rng = random.Random(seed)
    return [
        _Round(
            {f"r{round_}-k{i}": rng.randint(1, 9) for i in range(PROCESSES)},
            rng.randint(15, 45),  # some of the sixteen fit, some do not
            f"race-{round_}",
        )
        for round_ in range(count)
    ]


def _worker(url: str, rounds: list[_Round], me: int, folder: Path, barrier: Any, gate: int) -> None:
    """Play process `me` in every round; all sixteen start each round together."""
    ledger = Ledger(backend_from_url(url), wait_s=30.0)
    os.read(gate, 1)  # everyone is forked
    try:
        for number, round_ in enumerate(rounds):
            key = list(round_.amounts)[me]
            amount = round_.amounts[key]
            provider = Provider(folder / f"effects-{number}")
            barrier.wait(timeout=120)
            try:
                _pay(
                    ledger, provider, key, amount, [SpendCap(round_.limit, "EUR", name=round_.cap)]
                )
                verdict = "ran"
            except SpendCapExceeded:
                verdict = "refused"
            fd = os.open(folder / f"round-{number}", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, f"{key} {amount} {verdict}\n".encode())
            finally:
                os.close(fd)
    except BaseException:
        barrier.abort()  # the others stop at the next round instead of waiting it out
        raise
    ledger.close()


def _race(url: str, tmp_path: Path, rounds: list[_Round]) -> None:
    """Sixteen processes against one cap, round after round. They are forked once, not
    once per round (a fork of the test process costs more than a round), and every
    round starts in all of them at once: each round is a fresh race on a fresh cap."""
    for number in range(len(rounds)):
        Provider.create(tmp_path / f"effects-{number}")
    barrier = multiprocessing.get_context("fork").Barrier(PROCESSES)
    codes = fork_together(
        functools.partial(_worker, url, rounds, me, tmp_path, barrier) for me in range(PROCESSES)
    )
    failed = [code for code in codes if code != 0]
    assert not failed, f"{len(failed)} worker(s) failed; see stderr"
    backend = backend_from_url(url)
    try:
        budgets = SpendLedger(backend).budgets(settle=False)
    finally:
        backend.close()
    for number, round_ in enumerate(rounds):
        (budget,) = [b for b in budgets if b.cap == round_.cap]
        _check_round(tmp_path, number, round_, budget)


def _check_round(tmp_path: Path, number: int, round_: _Round, budget: Any) -> None:
    amounts, limit = round_.amounts, round_.limit
    verdicts = {}
    for line in (tmp_path / f"round-{number}").read_text().splitlines():
        key, _amount, verdict = line.split()
        verdicts[key] = verdict
    assert verdicts.keys() == amounts.keys()
    charged = [e["key"] for e in Provider(tmp_path / f"effects-{number}").effects()]
    assert len(charged) == len(set(charged)), "a call ran twice"
    ran = {k for k, v in verdicts.items() if v == "ran"}
    assert set(charged) == ran, "exactly the calls that were let through ran"
    total = sum(amounts[k] for k in charged)
    assert total <= limit, f"round {number}: {total} spent over the cap of {limit}"
    for key in amounts.keys() - ran:  # every refusal was needed: it did not fit at the end
        assert total + amounts[key] > limit, f"round {number}: {key} was refused but fit"
    assert (budget.committed, budget.reserved) == (total, 0)


@pytest.fixture(params=DURABLE_BACKENDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_sixteen_processes_against_one_cap_quick(backend_url: str, tmp_path: Path) -> None:
    _race(backend_url, tmp_path, _rounds(3, seed=11))


@pytest.mark.slow
def test_sixteen_processes_against_one_cap_every_round(backend_url: str, tmp_path: Path) -> None:
    _race(backend_url, tmp_path, _rounds(ROUNDS, seed=7))
