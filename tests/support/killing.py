"""Killing a worker at the point a test waits for: the moment it is held there (a file it
writes), never a guess at how long it takes to get there."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable

#: Importing crewai takes several seconds on a slow machine, and the suite runs in parallel.
STARTUP_TIMEOUT = 300.0


def sigkill_once(
    worker: subprocess.Popen[str], ready: Callable[[], bool], what: str,
    timeout: float = STARTUP_TIMEOUT,
) -> None:  # fmt: skip
    """SIGKILL `worker` once `ready()` says it is where the test wants it, and reap it.
    Fails with its stderr if it exits before, and with `what` it never reached if
    `timeout` passes first (a hang, not a time bound); a worker left running is killed."""
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert worker.poll() is None, worker.stderr.read()[-3000:] if worker.stderr else ""
            assert time.monotonic() < deadline, f"the worker never reached {what}"
            time.sleep(0.05)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(30)
    assert worker.returncode == -signal.SIGKILL
