"""The fault matrix, over any ledger URL: kill a worker at each point, retry in fresh processes.

`assert_cell(url, point, reconciler, workdir)` runs one cell of the matrix many times
against the ledger at `url` and raises AssertionError (naming the seed) if any run ends
anywhere but where `EXPECTED` says. Any backend that `backend_from_url` can open joins the
matrix by calling it; tests/process/test_fault_matrix.py does so for SQLite and the file-lock
backend, and the PostgreSQL and Redis tests can do the same with their URLs.

One run, on its own key:

1. a victim process claims the key and stops at `point`; the test SIGKILLs it there after a
   random delay (sometimes while a first retry is already waiting on its lease);
2. retry 1, a fresh process, runs the same charge (with or without a reconciler that asks
   the fake provider) and reports what it saw; the ledger and the provider are checked;
3. retry 2, another fresh process, must see the same thing again (nothing re-runs);
4. an UNCERTAIN record is resolved the way an operator would, from what the provider shows
   (`happened` with the provider's receipt, or `absent`); a settled one must refuse it;
5. retry 3 must then replay the provider's receipt or run the charge once.

Every run ends COMMITTED with exactly one charge at the provider, and every value any
process returned is that charge's receipt.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crewai_idempotent import Ledger, Record, ResolutionRefused, Status, backend_from_url
from tests.support.faults import launch
from tests.support.faults.provider import Provider
from tests.support.faults.worker import POINTS, Spec

# Ledgers on local files; server backends pass their own URLs to `assert_cell`.
LOCAL_URLS: dict[str, Callable[[Path], str]] = {
    "sqlite": lambda folder: f"sqlite:///{folder.absolute() / 'ledger.db'}",
    "sqlite-claims": lambda folder: (
        f"sqlite:///{folder.absolute() / 'ledger.db'}?synchronous=CLAIMS"
    ),
    "filelock": lambda folder: f"file://{folder.absolute() / 'ledger'}",
}

RUNS = 20
SOAK_RUNS = 200
LEASE_S = 0.5
_TRUE = ("1", "true", "yes", "on")


def runs_per_cell() -> int:
    """20 runs per cell; 200 with CREWAI_IDEMPOTENT_SOAK=1; CREWAI_IDEMPOTENT_FAULT_RUNS=N wins."""
    explicit = os.environ.get("CREWAI_IDEMPOTENT_FAULT_RUNS")
    if explicit:
        return int(explicit)
    if os.environ.get("CREWAI_IDEMPOTENT_SOAK", "").strip().lower() in _TRUE:
        return SOAK_RUNS
    return RUNS


@dataclass(frozen=True)
class Expected:
    """Where a cell must end. Histories are "kind/token" in order."""

    first_retry: str  # what retry 1 gets: "uncertain" (OutcomeUncertain), "replayed" or "ran"
    status: Status  # the record after retry 1
    effects: int  # charges at the provider after retry 1
    history: tuple[str, ...]  # after retry 1
    reconcile_calls: tuple[str, ...]  # the verdicts retry 1's reconciler gave
    operator: str | None  # UNCERTAIN: what the provider tells the operator to resolve
    final_history: tuple[str, ...]  # after the operator and retry 3

    @property
    def final_effects(self) -> int:
        return 1


_UNSEEN = ("claim/1", "uncertain/1")
EXPECTED: dict[tuple[str, bool], Expected] = {
    ("after_claim", False): Expected(
        "uncertain", Status.UNCERTAIN, 0, _UNSEEN, (), "absent",
        (*_UNSEEN, "resolve/1", "takeover/2", "commit/2"),
    ),
    ("before_effect", False): Expected(
        "uncertain", Status.UNCERTAIN, 0, _UNSEEN, (), "absent",
        (*_UNSEEN, "resolve/1", "takeover/2", "commit/2"),
    ),
    ("after_effect", False): Expected(
        "uncertain", Status.UNCERTAIN, 1, _UNSEEN, (), "happened", (*_UNSEEN, "resolve/1"),
    ),
    ("after_commit", False): Expected(
        "replayed", Status.COMMITTED, 1, ("claim/1", "commit/1"), (), None,
        ("claim/1", "commit/1"),
    ),
    ("after_claim", True): Expected(
        "ran", Status.COMMITTED, 1, ("claim/1", "takeover/2", "commit/2"), ("Absent",), None,
        ("claim/1", "takeover/2", "commit/2"),
    ),
    ("before_effect", True): Expected(
        "ran", Status.COMMITTED, 1, ("claim/1", "takeover/2", "commit/2"), ("Absent",), None,
        ("claim/1", "takeover/2", "commit/2"),
    ),
    ("after_effect", True): Expected(
        "replayed", Status.COMMITTED, 1, ("claim/1", "reconcile/1"), ("Found",), None,
        ("claim/1", "reconcile/1"),
    ),
    ("after_commit", True): Expected(
        "replayed", Status.COMMITTED, 1, ("claim/1", "commit/1"), (), None,
        ("claim/1", "commit/1"),
    ),
}  # fmt: skip
CELLS = list(EXPECTED)
assert {point for point, _ in CELLS} == set(POINTS)


@dataclass(frozen=True)
class Plan:
    """The randomised timing of one run."""

    index: int
    key: str
    how: str  # launcher for every process of the run: "exec" or "fork"
    kill_delay: float  # seconds between the victim reaching its point and SIGKILL
    retry_early: bool  # retry 1 starts before the kill and waits on the victim's claim
    retry_delay: float  # otherwise, seconds between the kill and retry 1


@dataclass
class CellReport:
    url: str
    point: str
    reconciler: bool
    seed: str
    runs: int
    seconds: float = 0.0
    early_retries: int = 0
    problems: list[str] = field(default_factory=list)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _history(record: Record) -> tuple[str, ...]:
    return tuple(f"{event.kind}/{event.token}" for event in record.history)


def _pid(label: str) -> int:
    return int(label.split(":")[-2])


class _Cell:
    def __init__(
        self, url: str, point: str, reconciler: bool, workdir: Path, lease_s: float
    ) -> None:
        self.url, self.point, self.reconciler = url, point, reconciler
        self.workdir, self.lease_s = workdir, lease_s
        self.expected = EXPECTED[(point, reconciler)]
        self.provider = Provider.create(workdir / "provider.jsonl")
        self.ledger = Ledger(backend_from_url(url))

    def spec(self, plan: Plan, role: str, **changes: Any) -> Spec:
        folder = self.workdir / f"run-{plan.index:04d}"
        return Spec(
            ledger=self.url,
            provider=str(self.provider.path),
            key=plan.key,
            report=str(folder / f"{role}.json"),
            reconcile=self.reconciler,
            lease_s=self.lease_s,
            wait_s=60.0,
            **changes,
        )

    def start(
        self, plan: Plan, role: str, started: list[launch.Proc], **changes: Any
    ) -> launch.Proc:
        spec = self.spec(plan, role, **changes)
        proc = launch.start(spec, plan.how, self.workdir / f"run-{plan.index:04d}" / f"{role}.log")
        started.append(proc)
        return proc

    def record(self, key: str) -> Record:
        record = self.ledger.get(key)
        _expect(record is not None, f"{key}: no record in the ledger")
        assert record is not None
        return record

    def effects(self, key: str, most: int) -> list[str]:
        receipts = self.provider.receipts(key)
        _expect(len(receipts) <= most, f"{key}: {len(receipts)} charges at the provider")
        return receipts

    def run(self, plan: Plan) -> None:
        (self.workdir / f"run-{plan.index:04d}").mkdir()
        started: list[launch.Proc] = []
        try:
            self._run(plan, started)
        finally:
            for proc in started:
                if proc.poll() is None:
                    proc.kill()

    def _run(self, plan: Plan, started: list[launch.Proc]) -> None:
        key, want = plan.key, self.expected
        marker = str(self.workdir / f"run-{plan.index:04d}" / "victim.at")
        victim = self.start(plan, "victim", started, pause_at=self.point, marker=marker)
        reached = launch.wait_for_marker(victim)
        _expect(reached["point"] == self.point, f"victim stopped at {reached['point']}")
        first = self.start(plan, "retry1", started) if plan.retry_early else None
        time.sleep(plan.kill_delay)
        code = victim.kill()
        _expect(code == -signal.SIGKILL, f"victim exited {code}, not by SIGKILL")
        if first is None:
            time.sleep(plan.retry_delay)
            first = self.start(plan, "retry1", started)

        # Retry 1: where the cell says it ends.
        seen = launch.finish(first)
        record = self.record(key)
        receipts = self.effects(key, most=1)
        self._check_report("retry 1", seen, want.first_retry, receipts)
        _expect(record.status is want.status, f"after retry 1: {record.status}, not {want.status}")
        _expect(len(receipts) == want.effects, f"after retry 1: {len(receipts)} charges")
        _expect(_history(record) == want.history, f"after retry 1: history {_history(record)}")
        _expect(
            tuple(seen["reconcile_calls"]) == want.reconcile_calls,
            f"retry 1 reconciler said {seen['reconcile_calls']}, not {want.reconcile_calls}",
        )
        _expect(not record.needs_operator and not record.evidence, "one execution flagged as two")
        _expect(_pid(record.history[0].by) == victim.pid, "the claim is not the victim's")
        if want.first_retry == "ran":
            _expect(_pid(record.history[-1].by) == first.pid, "the commit is not retry 1's")

        # Retry 2: a fresh process sees the same thing; nothing re-runs.
        again = launch.finish(self.start(plan, "retry2", started))
        self._check_report("retry 2", again, want.first_retry, receipts, rerun=False)
        after = self.record(key)
        _expect(after == record, f"retry 2 changed the record: {_history(after)}")
        _expect(self.effects(key, most=1) == receipts, "retry 2 charged")

        # The operator: resolve from what the provider shows; a settled record refuses.
        if want.operator is None:
            try:
                self.ledger.resolve(key, absent=True, by="fault-matrix", reason="must refuse")
            except ResolutionRefused:
                pass
            else:
                raise AssertionError(f"resolving a {record.status} record was not refused")
            _expect(self.record(key) == record, "a refused resolution changed the record")
        else:
            verdict = "happened" if receipts else "absent"
            _expect(verdict == want.operator, f"the provider says {verdict}")
            if receipts:
                self.ledger.resolve(
                    key, result=receipts[0], by="fault-matrix", reason="provider has the charge"
                )
            else:
                self.ledger.resolve(key, absent=True, by="fault-matrix", reason="no charge")
            last = launch.finish(self.start(plan, "retry3", started))
            self._check_report("retry 3", last, "replayed" if receipts else "ran", None)

        final = self.record(key)
        receipts = self.effects(key, most=1)
        _expect(len(receipts) == 1, f"{len(receipts)} charges in the end")
        _expect(final.status is Status.COMMITTED, f"ends {final.status}")
        _expect(final.value() == receipts[0], "the stored receipt is not the provider's")
        _expect(_history(final) == want.final_history, f"final history {_history(final)}")

    def _check_report(
        self,
        who: str,
        seen: dict[str, Any],
        outcome: str,
        receipts: list[str] | None,
        rerun: bool = True,
    ) -> None:
        if outcome == "uncertain":
            _expect(
                seen["outcome"] == "error" and seen["error_type"] == "OutcomeUncertain",
                f"{who}: {seen.get('error_type') or seen['outcome']}, not OutcomeUncertain",
            )
            return
        if outcome == "ran" and not rerun:
            outcome = "replayed"  # a later fresh process replays what retry 1 ran
        _expect(seen["outcome"] == outcome, f"{who}: {seen['outcome']} ({seen.get('error')})")
        current = receipts if receipts is not None else self.provider.receipts(seen["key"])
        _expect(
            current == [seen["value"]], f"{who} returned {seen['value']!r}; provider: {current}"
        )


def plans(prefix: str, runs: int, rng: random.Random, lease_s: float) -> list[Plan]:
    launcher = os.environ.get("CREWAI_IDEMPOTENT_FAULT_LAUNCHER")
    return [
        Plan(
            index=i,
            key=f"{prefix}-{i:04d}",
            # The first run of every cell goes through `python -m tests.support.faults.worker`.
            how=launcher or ("exec" if i == 0 else "fork"),
            kill_delay=rng.uniform(0.0, 0.6 * lease_s),
            retry_early=rng.random() < 0.25,
            retry_delay=rng.uniform(0.0, 1.5 * lease_s),
        )
        for i in range(runs)
    ]


def run_cell(
    url: str,
    point: str,
    reconciler: bool,
    workdir: Path,
    *,
    runs: int | None = None,
    lease_s: float = LEASE_S,
    seed: str | None = None,
    concurrency: int = 20,
    on_progress: Callable[[int], None] | None = None,
) -> CellReport:
    """Run one cell `runs` times (keys run concurrently); return what went wrong, if anything.

    `workdir` must be a fresh folder (the provider's effect file and each run's reports and
    logs go there); keys are unique per call, so a shared server ledger can be reused.
    """
    runs = runs_per_cell() if runs is None else runs
    base = seed or os.environ.get("CREWAI_IDEMPOTENT_FAULT_SEED") or secrets.token_hex(4)
    seed = f"{base}:{point}:{int(reconciler)}"
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    cell = _Cell(url, point, reconciler, workdir, lease_s)
    prefix = f"fm-{secrets.token_hex(4)}-{point}-{'rec' if reconciler else 'bare'}"
    report = CellReport(url, point, reconciler, seed, runs)
    todo = plans(prefix, runs, rng, lease_s)
    report.early_retries = sum(plan.retry_early for plan in todo)

    def attempt(plan: Plan) -> str | None:
        try:
            cell.run(plan)
        except AssertionError as exc:
            timing = f"kill after {plan.kill_delay:.3f} s, " + (
                "retry before the kill"
                if plan.retry_early
                else f"retry {plan.retry_delay:.3f} s after"
            )
            return f"run {plan.index} ({plan.key}, {plan.how}, {timing}): {exc}"
        finally:
            if on_progress:
                on_progress(plan.index)
        return None

    began = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(concurrency, runs))) as pool:
            report.problems = [problem for problem in pool.map(attempt, todo) if problem]
    finally:
        cell.ledger.close()
    report.seconds = time.monotonic() - began
    return report


def assert_cell(
    url: str, point: str, reconciler: bool, workdir: Path, **options: Any
) -> CellReport:
    """`run_cell`, failing with every problem (and the seed that reproduces the timings)."""
    report = run_cell(url, point, reconciler, workdir, **options)
    if report.problems:
        shown = "\n".join(report.problems[:10])
        raise AssertionError(
            f"{len(report.problems)} of {report.runs} runs of {point} "
            f"{'with' if reconciler else 'without'} a reconciler went wrong on {url} "
            f"(CREWAI_IDEMPOTENT_FAULT_SEED={report.seed.split(':')[0]} repeats the timings):\n"
            f"{shown}"
        )
    return report


def assert_batch_killed(url: str, workdir: Path, *, copies: int, lease_s: float = 1.0) -> None:
    """One worker process holds `copies` keys of every cell at once, each stopped at its
    point; it is SIGKILLed at a random moment once all are there (sometimes while its lease
    keeper renews them); one fresh process retries every key concurrently. Each key must
    end where `EXPECTED` says retry 1 leaves its cell, with no key ever charged twice."""
    workdir.mkdir(parents=True, exist_ok=True)
    provider = Provider.create(workdir / "provider.jsonl")
    prefix = f"batch-{secrets.token_hex(4)}"
    cells = {
        f"{prefix}-{point}-{'rec' if rec else 'bare'}-{n}": (point, rec)
        for point, rec in CELLS
        for n in range(copies)
    }

    def spec(role: str, plan: dict[str, dict[str, Any]], **changes: Any) -> Spec:
        path = workdir / f"{role}.plan.json"
        path.write_text(json.dumps(plan), "utf-8")
        return Spec(
            ledger=url, provider=str(provider.path), key=role, plan=str(path),
            report=str(workdir / f"{role}.json"), lease_s=lease_s, **changes,
        )  # fmt: skip

    victim = launch.start(
        spec("victim", {key: {"pause_at": point} for key, (point, _) in cells.items()},
             marker=str(workdir / "victim.at")),
        "exec", workdir / "victim.log",
    )  # fmt: skip
    try:
        reached = launch.wait_for_marker(victim)
        _expect(sorted(reached["keys"]) == sorted(cells), "not every key reached its point")
        time.sleep(random.uniform(0, lease_s / 2))
        code = victim.kill()
        _expect(code == -signal.SIGKILL, f"victim exited {code}, not by SIGKILL")
    finally:
        if victim.poll() is None:
            victim.kill()
    retry = launch.start(
        spec("retry", {key: {"reconcile": rec} for key, (_, rec) in cells.items()},
             wait_s=lease_s * 10 + 5),
        "exec", workdir / "retry.log",
    )  # fmt: skip
    seen = launch.finish(retry, timeout=120)
    ledger = Ledger(backend_from_url(url))
    problems = []
    try:
        for key, cell in cells.items():
            want, got = EXPECTED[cell], seen[key]
            record = ledger.get(key)
            receipts = provider.receipts(key)
            outcome = got["outcome"] if got["outcome"] != "error" else got["error_type"]
            expected = {"uncertain": "OutcomeUncertain"}.get(want.first_retry, want.first_retry)
            found = (outcome, record and record.status, len(receipts))
            if found != (expected, want.status, want.effects):
                problems.append(f"{cell}: expected {(expected, want.status, want.effects)}, "
                                f"got {found}: {got.get('error')}")  # fmt: skip
            elif record is not None and _history(record) != want.history:
                problems.append(f"{cell}: history {_history(record)}")
            elif tuple(got["reconcile_calls"]) != want.reconcile_calls:
                problems.append(f"{cell}: the reconciler said {got['reconcile_calls']}")
            elif outcome in ("ran", "replayed") and got["value"] != receipts[0]:
                problems.append(f"{cell}: returned {got['value']!r}, the provider has {receipts}")
    finally:
        ledger.close()
    assert not problems, "\n".join(problems)
