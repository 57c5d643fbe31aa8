"""The upstream patch (patches/) applies to crewai 1.15.30, its own tests pass, the plugin's
ledger conformance suite passes on its store, and its ledger survives a worker's clock
step (patches/verify.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="verify.sh applies the patch with git")
@pytest.mark.skipif(shutil.which("faketime") is None, reason="verify.sh steps clocks with faketime")
def test_patch_applies_and_its_tests_pass() -> None:
    env = {**os.environ, "PYTHON": sys.executable, "CREWAI_IDEMPOTENT_AUTOLOAD": "0"}
    done = subprocess.run(
        ["bash", str(ROOT / "patches" / "verify.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "verify.sh: OK" in done.stdout
    # The clock-step case ran (a step cannot drop out of verify.sh unnoticed), for both steps.
    for step in ("+1h", "+1d"):
        line = f"pass  a worker whose wall clock is {step}: OperationInProgress, the body ran once"
        assert line in done.stdout, done.stdout[-4000:]
