"""Starting worker processes, waiting for them to reach a point, and killing them.

Two ways to start a worker, both real OS processes that die by a real SIGKILL:

* ``exec``: ``python -m tests.support.faults.worker …`` through `subprocess`, as a user would
  (optionally under a wrapper command: ``faketime`` to step its wall clock, ``unshare``
  to put it in a time namespace of its own);
* ``fork``: a child of a `multiprocessing` fork server that imported the worker once.
  Every child is a fresh process with its own ledger connection and lease keeper (nothing
  ledger-related exists in the server before the fork); only the interpreter start-up and
  imports are shared, which is what lets the matrix run hundreds of kills in seconds.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.support.faults.worker import Spec, child

ROOT = Path(__file__).resolve().parents[3]
LAUNCHERS = ("exec", "fork")

_forkserver = multiprocessing.get_context("forkserver")
# "__main__" too: otherwise every child re-runs the main script (for pytest, its import).
# The server backends' client libraries too (psycopg, redis-py), or every worker of a
# server matrix imports them again; a preload that cannot be imported is skipped.
_forkserver.set_forkserver_preload([
    "__main__", "tests.support.faults.worker",
    "crewai_idempotent.backends.postgres", "crewai_idempotent.backends.redis",
])  # fmt: skip
# multiprocessing is not thread-safe here: Process.start() polls every other child, and two
# threads reading one child's exit status makes one of them see 255. Serialise those calls.
_mp_lock = threading.Lock()


class Proc:
    """A started worker: its pid, its log, and a uniform wait/kill over both launchers."""

    def __init__(
        self,
        spec: Spec,
        how: str,
        log: Path,
        wrap: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.how = how
        self.log = log
        # A wrapper (faketime, unshare) runs the worker as its child: signals go to the
        # process group, and `pid` is the wrapper's (the worker's own is in its report).
        self._group = bool(wrap)
        self._popen: subprocess.Popen[bytes] | None = None
        self._process: Any = None
        if how == "exec":
            with open(log, "ab") as out:
                self._popen = subprocess.Popen(
                    [*wrap, sys.executable, "-m", "tests.support.faults.worker", *spec.argv()],
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                    start_new_session=self._group,
                )
            self.pid = self._popen.pid
        elif how == "fork":
            if wrap or env:
                raise ValueError("a wrapper command or environment needs the exec launcher")
            self._process = _forkserver.Process(target=child, args=(spec, str(log)), daemon=False)
            with _mp_lock:
                self._process.start()
            self.pid = self._process.pid
        else:
            raise ValueError(f"unknown launcher {how!r}; known: {', '.join(LAUNCHERS)}")

    def poll(self) -> int | None:
        if self._popen is not None:
            return self._popen.poll()
        with _mp_lock:
            return self._process.exitcode  # type: ignore[no-any-return]

    def wait(self, timeout: float) -> int:
        """The exit code (negative: killed by that signal); raises TimeoutError if alive."""
        if self._popen is not None:
            try:
                return self._popen.wait(timeout)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"worker {self.pid} still running after {timeout} s") from None
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.pid} still running after {timeout} s")
            time.sleep(0.005)
        return code

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # it already exited
            if self._group:
                os.killpg(self.pid, signum)
            else:
                os.kill(self.pid, signum)

    def kill(self) -> int:
        """SIGKILL and reap; returns the exit code."""
        self.signal(signal.SIGKILL)
        return self.wait(30)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text("utf-8", "replace")[-chars:]
        except OSError:
            return ""


def start(
    spec: Spec,
    how: str,
    log: Path,
    *,
    wrap: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Proc:
    """A worker running `spec`; with `exec`, under the command `wrap` and with `env` added."""
    return Proc(spec, how, log, wrap, env)


def wait_for_marker(proc: Proc, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until the worker wrote its marker (it reached its point); fail if it exited."""
    assert proc.spec.marker, "this worker has no marker"
    marker = Path(proc.spec.marker)
    deadline = time.monotonic() + timeout
    while True:
        if marker.exists():
            return json.loads(marker.read_text("utf-8"))  # type: ignore[no-any-return]
        code = proc.poll()
        if code is not None:
            raise AssertionError(
                f"worker {proc.pid} exited ({code}) before reaching its point:\n{proc.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"worker {proc.pid} did not reach its point in {timeout} s")
        time.sleep(0.005)


def wait_for_file(proc: Proc, path: str | None, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until the worker wrote `path` (e.g. its `started` file); fail if it exited."""
    assert path, "this worker writes no such file"
    written = Path(path)
    deadline = time.monotonic() + timeout
    while not written.exists():
        code = proc.poll()
        if code is not None:
            raise AssertionError(f"worker {proc.pid} exited ({code}) early:\n{proc.log_tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"worker {proc.pid} did not write {path} in {timeout} s")
        time.sleep(0.005)
    return json.loads(written.read_text("utf-8"))  # type: ignore[no-any-return]


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait until the kernel reports `pid` as stopped (after SIGSTOP)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            return
        time.sleep(0.002)
    raise AssertionError(f"process {pid} did not stop within {timeout} s")


def finish(proc: Proc, timeout: float = 60.0) -> dict[str, Any]:
    """Wait for a worker that should exit on its own; return its report."""
    try:
        code = proc.wait(timeout)
    except TimeoutError:
        proc.kill()
        raise AssertionError(
            f"worker {proc.pid} ({proc.spec.key}) hung for {timeout} s:\n{proc.log_tail()}"
        ) from None
    if code != 0:
        raise AssertionError(f"worker {proc.pid} exited {code}:\n{proc.log_tail()}")
    assert proc.spec.report
    return json.loads(Path(proc.spec.report).read_text("utf-8"))  # type: ignore[no-any-return]
