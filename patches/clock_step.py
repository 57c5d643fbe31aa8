"""The patched core's ledger under a wall-clock step, in real processes (patches/verify.sh).

The owner (this process) claims a key on a SQLite ledger and holds it while its body
runs, its lease renewed by the keeper. A worker in another process, its wall clock
stepped by `faketime` (with FAKETIME_DONT_FAKE_MONOTONIC=1, which leaves CLOCK_MONOTONIC
and CLOCK_BOOTTIME alone, as an NTP step or `date -s` does), calls the same key with
on_stale="retry": judged by its own wall clock the owner's lease lapsed long ago, so a
ledger that judged leases that way would take the claim over and run the body a second
time. The worker must get OperationInProgress; the body runs once.

Usage (crewAI's patched source on PYTHONPATH): python patches/clock_step.py SCRATCH_DIR
Exits non-zero, saying why, on any failure. Imports nothing of crewai_idempotent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

STEPS = {"+1h": 3600.0, "+1d": 86400.0}
LEASE_S = 2.0  # renewed every lease_s / 3
WAIT_S = 5.0  # more than two lease periods of renewals


def _sleep_where_faketime_cannot() -> None:
    """Debian's libfaketime 0.9.10 with FAKETIME_DONT_FAKE_MONOTONIC breaks
    `clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`, which is Python 3.11's `time.sleep`:
    it raises EINVAL (wolfcw/libfaketime#426). A real clock step does no such thing, so
    the worker sleeps on an Event, which waits on the same monotonic clock through a call
    libfaketime leaves alone (as tests/support/faults/worker.py does)."""
    try:
        time.sleep(0.0001)
    except OSError:
        time.sleep = lambda seconds: threading.Event().wait(max(seconds, 0.0)) and None


def worker(ledger_path: str, runs_path: str, step: float, parent_wall: float) -> int:
    """The stepped worker: report what calling the held key did."""
    from crewai.tools.idempotency import Ledger, OperationInProgress, SQLiteIdempotencyBackend

    _sleep_where_faketime_cannot()

    ahead = time.time() - parent_wall
    if ahead < step - 600:  # the step did not take: the case would prove nothing
        print(json.dumps({"error": f"the wall clock is {ahead:.0f} s off, not {step:.0f}"}))
        return 2
    ledger = Ledger(SQLiteIdempotencyBackend(ledger_path), wait_s=WAIT_S)

    def body() -> str:
        with open(runs_path, "a", encoding="utf-8") as runs:
            runs.write("worker\n")
        return "second charge"

    try:
        outcome = ledger.execute("charge:inv-1", body, fingerprint="f", on_stale="retry")
    except OperationInProgress:
        print(json.dumps({"result": "in progress"}))
    else:
        print(json.dumps({"result": "ran" if not outcome.replayed else "replayed"}))
    finally:
        ledger.close()
    return 0


def run_case(scratch: Path, name: str, step: float, faketime: str) -> str | None:
    """One case; what went wrong, or None."""
    from crewai.tools.idempotency import Ledger, SQLiteIdempotencyBackend

    folder = scratch / f"clock-step-{name}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    ledger_path, runs_path = folder / "ledger.db", folder / "runs"
    owner = Ledger(SQLiteIdempotencyBackend(ledger_path), lease_s=LEASE_S)
    started, release = threading.Event(), threading.Event()

    def body() -> str:
        with open(runs_path, "a", encoding="utf-8") as runs:
            runs.write("owner\n")
        started.set()
        release.wait(120)  # the provider call in flight while the worker asks
        return "charge"

    holder = threading.Thread(
        target=owner.execute, args=("charge:inv-1", body), kwargs={"fingerprint": "f"}
    )
    holder.start()
    try:
        if not started.wait(30):
            return "the owner's body never started"
        command = [
            faketime, "-f", f"{step:+.0f}",
            sys.executable, __file__, "--worker",
            str(ledger_path), str(runs_path), str(step), repr(time.time()),
        ]  # fmt: skip
        env = {**os.environ, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)
    finally:
        release.set()
        holder.join(60)
    lines = done.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if lines else {"error": done.stderr[-2000:]}
    record = owner.backend.get("charge:inv-1")
    owner.close()
    runs = runs_path.read_text(encoding="utf-8").split()
    if "error" in report:
        return f"the worker failed: {report['error']}"
    if runs != ["owner"] or report["result"] != "in progress":
        return f"the body ran {runs}; the stepped worker's call {report['result']}"
    if record is None or record.status.value != "COMMITTED":
        return f"the owner's commit is missing: {record}"
    return None


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        return worker(argv[1], argv[2], float(argv[3]), float(argv[4]))
    faketime = shutil.which("faketime")
    if faketime is None:
        print("clock_step.py: faketime not found (Debian's faketime package)", file=sys.stderr)
        return 1
    failed = 0
    for name, step in STEPS.items():
        problem = run_case(Path(argv[0]), name, step, faketime)
        print(f"{'FAIL' if problem else 'pass'}  a worker whose wall clock is {name}: "
              f"{problem or 'OperationInProgress, the body ran once'}")  # fmt: skip
        failed += problem is not None
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
