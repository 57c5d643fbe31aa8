"""Beside the previous release (commit 61b49de, what runs during a rolling upgrade): it
reads records that carry a chain (it ignores the keys it does not know) and writes them
back without one; `verify` says so of each such record, `--since` the end of the rollout
accepts them, and the next write of this release chains them again, saying from where."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from crewai_idempotent import Ledger, SQLiteCacheBackend
from crewai_idempotent.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
PREVIOUS = "61b49de"

OLDER_WORKER = """
import crewai_idempotent, sys
assert crewai_idempotent.__file__.startswith(sys.argv[2]), crewai_idempotent.__file__
from crewai_idempotent import Ledger, SQLiteCacheBackend
ledger = Ledger(SQLiteCacheBackend(sys.argv[1]))
print(ledger.run("new:committed", lambda: "never"))  # a replay: read, nothing written
def boom():
    raise ValueError("declined again")
try:
    ledger.run("new:failed", boom)  # a takeover and a failure: written back
except ValueError:
    pass
print(ledger.run("old:made", lambda: "old"))
"""


@pytest.fixture
def previous(tmp_path: Path) -> Path:
    """The previous release's package, as it was at its commit."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and this repository's history")
    done = subprocess.run(
        [git, "-C", str(ROOT), "archive", PREVIOUS, "crewai_idempotent"],
        capture_output=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"commit {PREVIOUS} is not in this clone: {done.stderr.decode()[:200]}")
    folder = tmp_path / "previous"
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
        archive.extractall(folder, filter="data")
    return folder


def test_the_previous_release_reads_chained_records_and_verify_names_what_it_rewrote(
    previous: Path, tmp_path: Path
) -> None:
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    ledger = Ledger(SQLiteCacheBackend(path))
    ledger.run("new:committed", lambda: "new")

    def boom() -> None:
        raise ValueError("declined")

    with pytest.raises(ValueError):
        ledger.run("new:failed", boom)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(previous)
    older = subprocess.run(
        [sys.executable, "-c", OLDER_WORKER, str(path), str(previous)],
        cwd=previous, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert older.returncode == 0, older.stderr
    assert older.stdout.split() == ["new", "old"]
    time.sleep(0.01)
    rolled_out = repr(time.time())

    runner = CliRunner()
    result = runner.invoke(cli, ["--ledger", url, "verify"])
    assert result.exit_code == 1
    assert "'new:failed': unchained: its 4 event(s) carry no chain" in result.output
    assert "'old:made': unchained: its 2 event(s) carry no chain" in result.output
    assert "new:committed" not in result.output
    assert runner.invoke(cli, ["--ledger", url, "verify", "--since", rolled_out]).exit_code == 0

    assert ledger.run("new:failed", lambda: "third time") == "third time"
    record = ledger.get("new:failed")
    assert record is not None and record.chain_from is not None and record.chain_from[0] == 4
    result = runner.invoke(cli, ["--ledger", url, "verify", "new:failed"])
    assert result.exit_code == 1 and "its events before #5 carry no chain" in result.output
    assert runner.invoke(cli, ["--ledger", url, "verify", "--since", rolled_out]).exit_code == 0
    ledger.close()
