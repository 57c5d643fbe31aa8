"""The fault matrix: a worker SIGKILLed at each point, retried by fresh processes.

A worker charges a fake provider (one fsynced line per charge, outside the ledger) under a
guarded key, and is killed with SIGKILL at one of four points:

1. ``after_claim``: the claim landed, the body has not started;
2. ``before_effect``: inside the body, before the charge;
3. ``after_effect``: the charge happened, the commit was not written;
4. ``after_commit``: the commit landed, the call has not returned.

Fresh processes then retry the same key (lease 0.5 s, so the dead worker's claim goes stale
quickly), with a reconciler that asks the provider whether the charge for the key exists,
or without one (the default ``on_stale="uncertain"``). Retry 1 must see, and leave, exactly
("rec": the retrying processes have a reconciler; history: "kind/token" per event):

| point         | rec | retry 1 gets     | ledger    | charges | history                     |
|---------------|-----|------------------|-----------|---------|-----------------------------|
| after_claim   | no  | OutcomeUncertain | UNCERTAIN | 0       | claim/1 uncertain/1         |
| before_effect | no  | OutcomeUncertain | UNCERTAIN | 0       | claim/1 uncertain/1         |
| after_effect  | no  | OutcomeUncertain | UNCERTAIN | 1       | claim/1 uncertain/1         |
| after_commit  | no  | replayed         | COMMITTED | 1       | claim/1 commit/1            |
| after_claim   | yes | ran              | COMMITTED | 1       | claim/1 takeover/2 commit/2 |
| before_effect | yes | ran              | COMMITTED | 1       | claim/1 takeover/2 commit/2 |
| after_effect  | yes | replayed         | COMMITTED | 1       | claim/1 reconcile/1         |
| after_commit  | yes | replayed         | COMMITTED | 1       | claim/1 commit/1            |

and after the operator step and retry 3, every cell is COMMITTED with exactly 1 charge:

| point         | rec | operator resolves | final history                                     |
|---------------|-----|-------------------|---------------------------------------------------|
| after_claim   | no  | absent            | claim/1 uncertain/1 resolve/1 takeover/2 commit/2 |
| before_effect | no  | absent            | claim/1 uncertain/1 resolve/1 takeover/2 commit/2 |
| after_effect  | no  | happened          | claim/1 uncertain/1 resolve/1                     |
| after_commit  | no  | (refused)         | claim/1 commit/1                                  |
| after_claim   | yes | (refused)         | claim/1 takeover/2 commit/2                       |
| before_effect | yes | (refused)         | claim/1 takeover/2 commit/2                       |
| after_effect  | yes | (refused)         | claim/1 reconcile/1                               |
| after_commit  | yes | (refused)         | claim/1 commit/1                                  |

The fencing token grows only when a new worker takes the claim over. With a reconciler,
points 1 and 2 are re-run exactly once (the provider says Absent: the dead worker never
charged) and point 3 is committed with the provider's own receipt (Found). Without one,
nothing re-runs: the record is UNCERTAIN until someone looks at the provider.

Then, for every run: a second fresh process sees the same outcome and changes nothing; an
UNCERTAIN record is resolved the way docs/recovery.md tells an operator to (``happened``
with the provider's receipt if the provider has the charge, else ``absent``) and a third
fresh process replays that receipt or charges once; a settled record refuses resolution.
Across the whole matrix: never two charges for one key; never a re-run of an operation
whose outcome is unknown (a charge is only ever made after the provider said Absent or an
operator resolved ``absent``); every run ends COMMITTED with exactly one charge, and every
value any process returned is that charge's receipt.

Each cell runs 20 times per backend, keys concurrently, with random timing: the delay
between the worker reaching its point and the SIGKILL (sometimes landing while its lease
keeper is renewing), whether retry 1 starts before the kill (and waits on the live lease)
or after it, and how long after (before or after the lease lapses).
``CREWAI_IDEMPOTENT_SOAK=1`` runs 200 per cell, ``CREWAI_IDEMPOTENT_FAULT_RUNS=N`` runs N,
and ``CREWAI_IDEMPOTENT_FAULT_SEED`` repeats the timings of a failure. Other backends join
with `tests.support.faults.matrix.assert_cell(url, point, reconciler, workdir)`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.faults.matrix import CELLS, EXPECTED, LOCAL_URLS, assert_cell
from tests.support.faults.worker import POINTS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", list(LOCAL_URLS))
@pytest.mark.parametrize(
    ("point", "reconciler"),
    CELLS,
    ids=[f"{point}-{'reconciler' if reconciler else 'bare'}" for point, reconciler in CELLS],
)
def test_fault_matrix(backend: str, point: str, reconciler: bool, tmp_path: Path) -> None:
    url = LOCAL_URLS[backend](tmp_path)
    assert_cell(url, point, reconciler, tmp_path / "cell")


def test_docstring_tables_are_the_expected_table() -> None:
    """The tables above are what the matrix asserts, not a second opinion that can drift."""
    assert __doc__
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in __doc__.splitlines()
        if line.startswith("| ") and line[2:].split()[0] in POINTS
    ]
    first = [row for row in rows if len(row) == 6]
    then = [row for row in rows if len(row) == 4]
    assert len(first) == len(then) == len(EXPECTED)
    for point, rec, retry, status, charges, history in first:
        want = EXPECTED[(point, rec == "yes")]
        assert retry == {"uncertain": "OutcomeUncertain"}.get(want.first_retry, want.first_retry)
        assert status == want.status.value
        assert int(charges) == want.effects
        assert tuple(history.split()) == want.history
    for point, rec, operator, final in then:
        want = EXPECTED[(point, rec == "yes")]
        assert operator == (want.operator or "(refused)")
        assert tuple(final.split()) == want.final_history
        assert want.final_effects == 1
