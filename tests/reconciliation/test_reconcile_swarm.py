"""Four sweepers, four processes, started at once on 200 UNCERTAIN records, while an owner
in a fifth process renews its lease: every record is asked once and settled once (one
settling event in its history, written by one sweeper), nothing is run again under any
key, and the owner keeps its claim and commits it. On every backend several processes
share: SQLite, the file lock, PostgreSQL, Redis."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from crewai_idempotent import Ledger, Status, backend_from_url
from tests.support.crewai.fixtures import PYTHON, REPO, subprocess_env
from tests.support.faults.provider import Provider
from tests.support.reconcile import ASKED_ENV, asked, uncertain, wait_for

RECORDS = 200
SWEEPERS = 4
pytestmark = pytest.mark.slow


def _start(role: str, url: str, folder: Path, asked_file: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PYTHON, "-m", "tests.support.reconcile_swarm_worker", role, url, str(folder)],
        cwd=REPO, env=subprocess_env(**{ASKED_ENV: str(asked_file)}),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.parametrize("backend_kind", ["sqlite", "filelock", "postgres", "redis"])
def test_four_sweepers_settle_each_record_once_and_leave_the_live_owner_alone(
    backend_kind: str, backend_url: str, tmp_path: Path
) -> None:
    asked_file = tmp_path / "asked.jsonl"
    Provider.create(asked_file)
    ledger = Ledger(backend_from_url(backend_url))
    processes: list[subprocess.Popen[str]] = []
    try:
        answers = {f"swarm:{n:03}": ("found", "absent")[n % 4 == 0] for n in range(RECORDS)}
        for key, said in answers.items():
            uncertain(ledger, key, {"answer": said})
        owner = _start("owner", backend_url, tmp_path, asked_file)
        processes.append(owner)
        wait_for(lambda: (tmp_path / "owning").exists(), "the owner's claim", 300)
        claimed = ledger.get("owned:1")
        assert claimed is not None and claimed.status is Status.PENDING
        sweepers = [_start("sweeper", backend_url, tmp_path, asked_file) for _ in range(SWEEPERS)]
        processes.extend(sweepers)
        (tmp_path / "go").write_text("")

        wait_for(lambda: not ledger.records(Status.UNCERTAIN), "every record settled", 600)
        # The owner renews while the sweepers keep sweeping: three renewals at least.
        wait_for(
            lambda: ledger.get("owned:1").revision >= claimed.revision + 3,  # type: ignore[union-attr]
            "the owner's renewals",
            300,
        )
        (tmp_path / "stop").write_text("")
        outputs = []
        for sweeper in sweepers:
            out, err = sweeper.communicate(timeout=300)
            assert sweeper.returncode == 0, err[-3000:]
            outputs.append(json.loads(out.splitlines()[-1]))
        held = ledger.get("owned:1")
        assert held is not None and held.status is Status.PENDING and held.token == 1
        (tmp_path / "release").write_text("")
        out, err = owner.communicate(timeout=300)
        assert owner.returncode == 0, err[-3000:]
        assert json.loads(out) == {"value": "the owner's receipt", "replayed": False}
    finally:
        (tmp_path / "stop").write_text("")
        (tmp_path / "release").write_text("")
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(30)

    try:
        records = {r.key: r for r in ledger.records()}
    finally:
        ledger.close()
    # Every record settled as its reconciler said, by one settling event, token 1 still:
    # nothing claimed it again, nothing ran.
    sweepers_by = {o["by"] for o in outputs}
    for key, said in answers.items():
        record = records[key]
        assert record.status is (Status.COMMITTED if said == "found" else Status.FAILED), key
        kinds = [e.kind for e in record.history]
        assert kinds == ["claim", "uncertain", "reconcile" if said == "found" else "absent"], kinds
        assert record.history[-1].by in sweepers_by and record.token == 1
    wrote = Counter(
        key for output in outputs for key, outcome in output["wrote"] if outcome != "overtaken"
    )
    assert wrote == Counter(answers.keys()), "each record written by exactly one sweeper"
    assert all(
        outcome in ("found", "absent", "overtaken") for o in outputs for _, outcome in o["wrote"]
    )
    asks = Counter(effect["key"] for effect in asked(asked_file))
    assert asks == Counter(answers.keys()), "each record's reconciler asked exactly once"
    owned = records["owned:1"]
    assert owned.status is Status.COMMITTED and owned.value() == "the owner's receipt"
    assert [e.kind for e in owned.history] == ["claim", "commit"]
    assert "owned:1" not in asks
