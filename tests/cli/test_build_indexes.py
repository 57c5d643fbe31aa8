"""`crewai-idempotent build-indexes`: doctor names it for a ledger an earlier version made
whose listing indexes are not complete, and the command doctor prints, pasted into a
shell, builds them and waits; on a complete ledger it says so and changes nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from crewai_idempotent import SQLiteCacheBackend, Status
from crewai_idempotent.cli import main
from tests.backends.test_sqlite_select import old_ledger, record
from tests.support.crewai.fixtures import subprocess_env


def test_doctor_names_the_command_that_builds_an_old_ledgers_indexes(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    old_ledger(path, [record(f"pay:{i}", Status.COMMITTED) for i in range(300)])
    # No background build: the command must do it (as on a ledger whose builder is away).
    url = f"sqlite:///{path}?background_indexing=false"
    doctor = CliRunner().invoke(main, ["--ledger", url, "doctor"], env={"COLUMNS": "400"})
    said = re.search(r"`(crewai-idempotent [^`]*build-indexes)`", doctor.output)
    assert said is not None, doctor.output
    env = subprocess_env()  # the shell finds the command where it is installed
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    built = subprocess.run(
        ["bash", "-c", said.group(1)], capture_output=True, text=True, env=env, cwd=tmp_path,
        timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert built.stdout.splitlines()[-1].endswith("are complete")
    backend = SQLiteCacheBackend(path, background_indexing=False)
    try:
        assert backend.indexes_ready()
    finally:
        backend.close()
    again = CliRunner().invoke(main, ["--ledger", url, "build-indexes"])
    assert again.exit_code == 0 and "are complete" in again.output
    rescan = CliRunner().invoke(main, ["--ledger", url, "build-indexes", "--rescan"])
    assert rescan.exit_code == 2 and "--rescan is for a Redis ledger" in rescan.output
