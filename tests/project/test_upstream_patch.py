"""The upstream patch (patches/) applies to crewai 1.15.30 and its own tests pass."""

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
