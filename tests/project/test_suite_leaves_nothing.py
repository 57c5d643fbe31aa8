"""The test suite removes what it makes in the temp folder: a test session runs here in
a child process whose temp folder starts empty, and it must be empty again at the end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# What the suite's tests do that leaves files behind unless the suite removes them: a
# ledger outage (spooled to the session's spool folder, tests/conftest.py) and a crewai
# SQLite store (crewai keeps a lock file in the temp folder for each one it opens), in the
# test's process and in a child it starts.
SESSION = """
pytest_plugins = ["tests.support.crewai.fixtures"]


def test_an_outage_is_spooled():
    import os

    from crewai_idempotent import InMemoryCacheBackend
    from crewai_idempotent.notifications import _incidents

    _incidents.noted(InMemoryCacheBackend(), OSError("the ledger is down"))
    assert list(os.scandir(os.environ[_incidents.SPOOL_ENV]))


def test_crewai_keeps_a_store(isolated_crewai, tmp_path):
    from crewai.memory.storage.kickoff_task_outputs_storage import (
        KickoffTaskOutputsSQLiteStorage,
    )

    KickoffTaskOutputsSQLiteStorage(str(tmp_path / "outputs.db"))


def test_a_child_process_keeps_a_store(isolated_crewai, tmp_path):
    import subprocess
    import sys

    from tests.support.crewai.fixtures import subprocess_env

    code = (
        "import sys; "
        "from crewai.memory.storage.kickoff_task_outputs_storage import "
        "KickoffTaskOutputsSQLiteStorage as Store; "
        "Store(sys.argv[1])"
    )
    child = [sys.executable, "-c", code, str(tmp_path / "child.db")]
    subprocess.run(child, env=subprocess_env(), check=True, timeout=300)
"""


def test_a_test_session_leaves_nothing_in_the_temp_folder(tmp_path: Path) -> None:
    temp, tests = tmp_path / "temp", tmp_path / "session"
    temp.mkdir()
    tests.mkdir()
    (tests / "test_session.py").write_text(SESSION)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CREWAI_IDEM"))}
    env.update(TMPDIR=str(temp), PYTHONPATH=str(REPO))
    pytest = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider"]
    where = ["--rootdir", str(tests), "--basetemp", str(tmp_path / "b")]
    done = subprocess.run(
        [*pytest, "-n", "0", "-q", *where, str(tests / "test_session.py")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout
    assert sorted(os.listdir(temp)) == []
