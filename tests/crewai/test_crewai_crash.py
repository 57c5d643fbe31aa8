"""A crewai kickoff killed (SIGKILL, a real process) after its tool charged and before the
ledger recorded it, then re-run in a fresh process: without a reconciler the kickoff stops
with OutcomeUncertain; with one it returns the receipt the provider has. One charge each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import SQLiteCacheBackend, Status
from crewai_idempotent.notifications import Outbox
from tests.support.crewai.fixtures import PYTHON, REPO, subprocess_env
from tests.support.crewai.provider import FakeProvider

LEASE_S = 2.0
STARTUP_TIMEOUT = 300  # importing crewai takes several seconds on a slow machine

# Per path: invoice "a" is re-run without, then with, a reconciler; invoice "b" goes
# straight to the reconciler while its claim is still the dead worker's PENDING.
PATHS = {"react": False, "native": True}


def _spawn(spec: dict[str, Any], ledger: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PYTHON, "-m", "tests.support.crewai.run_payment", json.dumps(spec)],
        cwd=REPO,
        env=subprocess_env(
            CREWAI_IDEMPOTENCY_URL=f"sqlite:///{ledger}", XDG_DATA_HOME=str(ledger.parent / "xdg")
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run(path: str, invoice: str, tmp: Path, **extra: Any) -> dict[str, Any]:
    return {
        "native": PATHS[path],
        "provider": str(tmp / "charges.jsonl"),
        "invoice": f"inv-{path}-{invoice}",
        "key": "pay:{invoice}",
        "lease_s": LEASE_S,
        "wait_s": 15,
        "reject": 1,
        **extra,
    }


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("crash")
    ledger = tmp / "ledger.db"
    held = [
        _run(path, invoice, tmp, hold=str(tmp / f"held-{path}-{invoice}"))
        for path in PATHS
        for invoice in ("a", "b")
    ]
    worker = _spawn({"runs": held}, ledger)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not all(Path(r["hold"]).exists() for r in held):
            assert worker.poll() is None, worker.stderr.read()[-3000:] if worker.stderr else ""
            assert time.monotonic() < deadline, "the worker never reached its tool calls"
            time.sleep(0.1)
        with SQLiteCacheBackend(ledger) as backend:
            before = {r.key: r.status for r in backend.scan()}
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(30)
    assert worker.returncode == -signal.SIGKILL

    rerun = [
        run
        for path in PATHS
        for run in (
            _run(path, "a", tmp),  # no reconciler
            _run(path, "a", tmp, reconcile=True),
            _run(path, "b", tmp, reconcile=True),
        )
    ]
    fresh = _spawn({"runs": rerun}, ledger)
    out, err = fresh.communicate(timeout=STARTUP_TIMEOUT)
    assert fresh.returncode == 0, err[-3000:]
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    receipts = {
        Path(r["hold"]).name.removeprefix("held-"): Path(r["hold"]).read_text() for r in held
    }
    return {
        "tmp": tmp,
        "ledger": ledger,
        "before": before,
        "results": lines[1:],
        "receipts": receipts,
    }


@pytest.mark.slow
def test_the_worker_died_holding_its_claims(crashed: dict[str, Any]) -> None:
    assert crashed["before"] == {
        f"pay:inv-{path}-{invoice}": Status.PENDING for path in PATHS for invoice in ("a", "b")
    }


@pytest.mark.parametrize("path", list(PATHS))
def test_rerun_without_reconciler_halts_with_outcome_uncertain(
    crashed: dict[str, Any], path: str
) -> None:
    result = crashed["results"][list(PATHS).index(path) * 3]
    assert result["error"] == "OutcomeUncertain"
    assert f"pay:inv-{path}-a" in result["message"]
    assert "stopped renewing its lease" in result["message"]
    assert result["attempts"] == 1  # stopped at once: no agent or guardrail retry


@pytest.mark.parametrize("path", list(PATHS))
def test_rerun_with_reconciler_returns_the_receipt(crashed: dict[str, Any], path: str) -> None:
    base = list(PATHS).index(path) * 3
    after_uncertain, after_stale = crashed["results"][base + 1], crashed["results"][base + 2]
    assert after_uncertain.get("raw") == crashed["receipts"][f"{path}-a"], after_uncertain
    assert after_stale.get("raw") == crashed["receipts"][f"{path}-b"], after_stale


def test_at_most_one_charge_per_invoice(crashed: dict[str, Any]) -> None:
    charges = FakeProvider(crashed["tmp"] / "charges.jsonl")
    invoices = [e["invoice"] for e in charges.effects()]
    assert sorted(invoices) == sorted(f"inv-{p}-{i}" for p in PATHS for i in ("a", "b"))
    with SQLiteCacheBackend(crashed["ledger"]) as backend:
        records = {r.key: r for r in backend.scan() if not r.key.startswith("crewai-idempotent/")}
        told = [(e.type, e.subject) for e in Outbox(backend).entries()]
    # A person was told of the "a" invoices: uncertain (no reconciler), then resolved by
    # the reconciler; the "b" ones were reconciled from a stale claim, never uncertain.
    assert sorted(told) == sorted(
        (kind, f"pay:inv-{p}-a") for p in PATHS for kind in ("record.uncertain", "record.resolved")
    )
    assert {r.status for r in records.values()} == {Status.COMMITTED}
    for key, record in records.items():
        kinds = [e.kind for e in record.history]
        assert kinds[0] == "claim" and "reconcile" in kinds, (key, kinds)
        assert "commit" not in kinds  # nothing ever re-ran the body
