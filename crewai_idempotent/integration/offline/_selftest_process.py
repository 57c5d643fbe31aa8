"""The self-test (`_selftest`) in a fresh interpreter: starting it, and reading what it says.

The parent's end of the line protocol whose other end is `_selftest.main`: the child
prints `MARK` and a JSON object per line, first the crewai version and the checks that
apply, then one result per check as it finishes. The doctor (`doctor --self-test`) and a
release verifying itself (`_verify`'s runner) start the self-test here.

Beneath the integration: it names the self-test by its module, never imports it (the
self-test installs the integration, whose release gate starts this), so the gate, its
runner and the doctor load nothing of the checks and no crewai.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from .._compat import ALLOW_UNTESTED_ENV
from .._ledgers import URL_ENV
from ._scripted import OFFLINE as _OFFLINE

SELFTEST = "crewai_idempotent.integration.offline._selftest"
OFFLINE = {**_OFFLINE, "CREWAI_TESTING": "true", "OPENAI_API_KEY": "sk-self-test-not-used"}
MARK = "crewai-idempotent-self-test: "


def run_in_subprocess(
    timeout_s: float = 600.0,
    *,
    on_plan: Callable[[str, list[str]], None] | None = None,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[str, list[dict[str, Any]], str]:
    """Run every check in a fresh interpreter, the full guard installed whatever the
    crewai release (that is the point): (crewai version, results, its stderr tail).

    `on_plan(version, labels)` is called once the interpreter knows which checks apply, and
    `on_result(result)` as each check finishes, so a caller can show progress.
    `subprocess.TimeoutExpired` if it runs past `timeout_s` (it is killed then)."""
    env = {**os.environ, **OFFLINE, ALLOW_UNTESTED_ENV: "1"}
    env.pop(URL_ENV, None)
    # The checks decide nothing a person signs: the deployment's trusted keys are not theirs.
    env.pop("CREWAI_IDEMPOTENCY_TRUSTED_KEYS", None)
    env.pop("CREWAI_IDEMPOTENCY_ACCEPT_UNSIGNED_GRANTS_UNTIL", None)
    command = [sys.executable, "-m", SELFTEST]
    version = "unknown"
    results: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="crewai-idempotent-self-test-") as home,
        tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as errors,
    ):
        env["XDG_DATA_HOME"] = home  # crewai's storage folder: nothing of the user's is touched
        process = subprocess.Popen(
            command,
            env=env,
            cwd=home,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errors,  # a file, not a pipe: nobody reads it until the end
            text=True,
            encoding="utf-8",
            errors="replace",
        )
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            process.kill()

        timer = threading.Timer(timeout_s, expire)
        timer.daemon = True
        timer.start()
        try:
            assert process.stdout is not None
            for line in process.stdout:
                if not line.startswith(MARK):
                    continue
                record = json.loads(line.removeprefix(MARK))
                if "crewai" in record:
                    version = record["crewai"]
                    if on_plan is not None:
                        on_plan(version, list(record.get("checks", [])))
                else:
                    results.append(record)
                    if on_result is not None:
                        on_result(record)
            process.wait()
        finally:
            timer.cancel()
            if process.poll() is None:  # interrupted (^C) or a callback raised
                process.kill()
                process.wait()
        if expired.is_set():
            raise subprocess.TimeoutExpired(command, timeout_s)
        errors.seek(0)
        tail = errors.read()[-2000:] if process.returncode else ""
    return version, results, tail
