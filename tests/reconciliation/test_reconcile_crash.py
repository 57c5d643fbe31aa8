"""A crewai worker SIGKILLed inside its Stripe tool, settled by a sweeper in another process.

Per backend (SQLite, the file lock, PostgreSQL, Redis): one worker runs two crews whose
tool charges through the real `stripe` client at the fake Stripe server, and is killed
(SIGKILL, a real process) in both: one after the charge and before the commit, one
before the charge. Once their leases lapse, `crewai-idempotent reconcile` in a process of
its own, told only to import the module whose verifier the tool names by path, finds the
first charge by its metadata and commits the real PaymentIntent id, and marks the second
absent. A fresh crew run then replays the first and charges the second: one charge each,
counted by the fake Stripe server. A tool that names no reconciler is settled the same way
by one registered for it by the tool's name in the module the sweeper imports.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("stripe")

from crewai_idempotent import Ledger, Status, backend_from_url
from tests.support.crewai.fixtures import PYTHON, REPO, subprocess_env
from tests.support.fake_stripe import FakeStripe
from tests.support.killing import STARTUP_TIMEOUT, sigkill_once
from tests.support.reconcile import wait_for

LEASE_S = 2.0
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeStripe]:
    server = FakeStripe()
    yield server
    server.close()


def _env(url: str, fake: FakeStripe, tmp: Path) -> dict[str, str]:
    return subprocess_env(
        CREWAI_IDEMPOTENCY_URL=url, FAKE_STRIPE_URL=fake.url, XDG_DATA_HOME=str(tmp / "xdg")
    )


def _crews(runs: list[dict[str, Any]], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PYTHON, "-m", "tests.support.crewai.run_stripe", json.dumps({"runs": runs})],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.parametrize("backend_kind", ["sqlite", "filelock", "postgres", "redis"])
def test_a_sweeper_in_another_process_settles_a_killed_workers_charges(
    backend_kind: str, backend_url: str, fake: FakeStripe, tmp_path: Path
) -> None:
    env = _env(backend_url, fake, tmp_path)
    run = {"amount": 500, "lease_s": LEASE_S}
    paid, unpaid = f"inv-{backend_kind}-paid", f"inv-{backend_kind}-unpaid"
    held = [
        {**run, "invoice": paid, "when": "after", "hold": str(tmp_path / "held-paid")},
        {**run, "invoice": unpaid, "when": "before", "hold": str(tmp_path / "held-unpaid")},
    ]
    worker = _crews(held, env)
    sigkill_once(worker, lambda: all(Path(r["hold"]).exists() for r in held), "its tool calls")
    intent = Path(held[0]["hold"]).read_text()
    keys = {paid: f"pay:{paid}", unpaid: f"pay:{unpaid}"}
    assert [c["id"] for c in fake.charged(keys[paid])] == [intent]
    assert fake.charged(keys[unpaid]) == []

    ledger = Ledger(backend_from_url(backend_url))
    try:
        for key in keys.values():
            record = ledger.get(key)
            assert record is not None and record.status is Status.PENDING
            assert record.call is not None and record.call["tool"] == "pay_invoice"
            assert record.call["reconciler"] == "tests.support.crewai.stripe_tools:verify_payment"
        # The sweeper acts on lapsed leases only; a hang guard, not a measurement.
        wait_for(
            lambda: all(ledger.is_stale(ledger.get(k)) for k in keys.values()),  # type: ignore[arg-type]
            "the dead worker's leases to lapse",
        )
        sweep = subprocess.run(
            [
                PYTHON, "-m", "crewai_idempotent.cli", "--ledger", backend_url, "reconcile",
                "--import", "tests.support.crewai.stripe_tools", "--no-entry-points", "--json",
            ],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=STARTUP_TIMEOUT,
        )  # fmt: skip
        assert sweep.returncode == 0, sweep.stderr
        report = json.loads(sweep.stdout)
        outcomes = {r["key"]: (r["outcome"], r["status"]) for r in report["results"]}
        assert outcomes == {
            keys[paid]: ("found", "COMMITTED"), keys[unpaid]: ("absent", "FAILED"),
        }, report  # fmt: skip
        committed = ledger.get(keys[paid])
        assert committed is not None and committed.value() == intent  # the real charge id

        rerun = _crews([{**run, "invoice": paid}, {**run, "invoice": unpaid}], env)
        out, err = rerun.communicate(timeout=STARTUP_TIMEOUT)
        assert rerun.returncode == 0, err[-3000:]
        results = {r["invoice"]: r for r in map(json.loads, out.splitlines())}
        assert results[paid].get("raw") == intent, results  # replayed, not charged again
        assert results[unpaid].get("raw", "").startswith("pi_"), results
        assert len(fake.charged(keys[paid])) == 1
        assert [c["id"] for c in fake.charged(keys[unpaid])] == [results[unpaid]["raw"]]
        histories = {k: [e.kind for e in ledger.get(k).history] for k in keys.values()}  # type: ignore[union-attr]
        assert histories == {
            keys[paid]: ["claim", "reconcile"],
            keys[unpaid]: ["claim", "absent", "takeover", "commit"],
        }
    finally:
        ledger.close()


def test_a_reconciler_registered_by_tool_name_settles_a_killed_workers_charge(
    fake: FakeStripe, tmp_path: Path
) -> None:
    # The tool `charge_card` names no reconciler and its key starts with `charge:`, not
    # with its name: the sweeper finds the one registered for `charge_card` because the
    # dead worker's claim recorded the tool's name (docs/recovery.md, "How the sweeper
    # finds a record's reconciler").
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = _env(url, fake, tmp_path)
    run = {"amount": 700, "lease_s": LEASE_S, "tool": "charge_card", "key": "charge:{invoice}"}
    run["reconcile"] = False
    hold = tmp_path / "held"
    worker = _crews([{**run, "invoice": "ord-1", "when": "after", "hold": str(hold)}], env)
    sigkill_once(worker, lambda: hold.exists() and bool(hold.read_text()), "its tool call")
    intent = hold.read_text()
    assert [c["id"] for c in fake.charged("charge:ord-1")] == [intent]

    ledger = Ledger(backend_from_url(url))
    try:
        record = ledger.get("charge:ord-1")
        assert record is not None and record.status is Status.PENDING
        assert record.call == {"tool": "charge_card", "ttl": None}  # no reconciler: no args
        wait_for(lambda: ledger.is_stale(ledger.get("charge:ord-1")), "the lease to lapse")  # type: ignore[arg-type]
        sweep = subprocess.run(
            [
                PYTHON, "-m", "crewai_idempotent.cli", "--ledger", url, "reconcile",
                "--import", "tests.support.crewai.stripe_by_name", "--no-entry-points", "--json",
            ],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=STARTUP_TIMEOUT,
        )  # fmt: skip
        assert sweep.returncode == 0, sweep.stderr
        (result,) = json.loads(sweep.stdout)["results"]
        assert (result["outcome"], result["status"], result["tool"]) == (
            "found", "COMMITTED", "charge_card",
        ), result  # fmt: skip
        committed = ledger.get("charge:ord-1")
        assert committed is not None and committed.value() == intent

        rerun = _crews([{**run, "invoice": "ord-1"}], env)
        out, err = rerun.communicate(timeout=STARTUP_TIMEOUT)
        assert rerun.returncode == 0, err[-3000:]
        (again,) = map(json.loads, out.splitlines())
        assert again.get("raw") == intent, again  # replayed, not charged again
        assert len(fake.charged("charge:ord-1")) == 1
    finally:
        ledger.close()
