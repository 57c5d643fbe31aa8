"""synchronous=CLAIMS: one fsync per guarded call, and a commit lost before it was synced
leaves an UNCERTAIN record, never a second run.

Two real-process tests carry the argument of docs/backends.md ("Durability modes"):

* `strace` counts the syncs a worker makes: under CLAIMS exactly one per guarded call, made
  before the body starts, and none between the body and the next claim. So after a commit
  returns, the durable state is the one of the last claim's sync.
* a worker snapshots the ledger files from inside its body: the claim has just been synced
  and nothing has been written since, so the snapshot is exactly what the disk is sure to
  hold until the next sync. The worker commits and is killed (SIGKILL); "power loss" then
  puts the snapshot back (without the -shm index, which SQLite rebuilds from the WAL, as
  after a reboot). The next caller, once the dead owner's lease lapses, gets
  OutcomeUncertain and the fake provider counts one charge.

What they do not prove: that the disk honours fdatasync (no test on a running machine can
cut its power), and the snapshot is taken by the worker itself, so it is the synced state
by the sync count above, not by observation of the platter.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from crewai_idempotent import Ledger, OutcomeUncertain, SQLiteCacheBackend, Status

CALLS = 12

WORKER = textwrap.dedent(
    """
    import os, sys
    from crewai_idempotent import Ledger, SQLiteCacheBackend

    path, mode, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ledger = Ledger(SQLiteCacheBackend(path, synchronous=mode))
    ledger.run("warm-up", lambda: "opened")  # opens both connections before the count

    def body(i):
        os.write(2, b"BODY %d\\n" % i)
        return f"receipt-{i}"

    os.write(2, b"BEGIN\\n")
    for i in range(calls):
        os.write(2, b"CALL %d\\n" % i)
        ledger.run(f"charge:{i}", lambda i=i: body(i))
    os.write(2, b"END\\n")
    """
)


def _traced_events(tmp_path: Path, mode: str) -> list[str]:
    """The worker's syncs and markers, in order, between BEGIN and END."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    trace = tmp_path / f"trace-{mode}.txt"
    done = subprocess.run(
        ["strace", "-f", "-qq", "-e", "trace=fsync,fdatasync,write", "-o", str(trace),
         sys.executable, "-c", WORKER, str(tmp_path / f"{mode}.db"), mode, str(CALLS)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode != 0 and "ptrace" in done.stderr.lower():
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    events = []
    for line in trace.read_text().splitlines():
        marker = re.search(r'write\(2, "((?:BEGIN|END|CALL \d+|BODY \d+))\\n"', line)
        if marker:
            events.append(marker.group(1))
        elif re.search(r"\b(fsync|fdatasync)\(", line):
            events.append("SYNC")
    start, end = events.index("BEGIN"), events.index("END")
    return events[start + 1 : end]


def test_claims_mode_syncs_once_per_call_before_the_body(tmp_path: Path) -> None:
    events = _traced_events(tmp_path, "CLAIMS")
    assert events.count("SYNC") == CALLS, events
    for i in range(CALLS):
        call = events.index(f"CALL {i}")
        body = events.index(f"BODY {i}")
        after = events.index(f"CALL {i + 1}") if i + 1 < CALLS else len(events)
        # the claim is durable before the body starts; the commit syncs nothing
        assert events[call + 1 : body] == ["SYNC"], events[call:after]
        assert "SYNC" not in events[body:after], events[call:after]


def test_full_mode_syncs_claim_and_commit(tmp_path: Path) -> None:
    # The same count that shows CLAIMS saves a sync shows FULL paying two.
    events = _traced_events(tmp_path, "FULL")
    assert events.count("SYNC") == 2 * CALLS, events


POWER_CUT_WORKER = textwrap.dedent(
    """
    import os, shutil, sys
    from crewai_idempotent import Ledger, SQLiteCacheBackend

    path, snapshot, charges = sys.argv[1], sys.argv[2], sys.argv[3]
    ledger = Ledger(SQLiteCacheBackend(path, synchronous="CLAIMS"), lease_s=1.0)

    def charge():
        # The claim was synced before this body started and nothing was written since:
        # these copies are what the disk holds for sure until the next sync.
        for suffix in ("", "-wal"):
            shutil.copyfile(path + suffix, snapshot + suffix)
        with open(charges, "a") as f:
            f.write("charged\\n")
            f.flush()
            os.fsync(f.fileno())
        return "ch_1"

    assert ledger.run("order-42", charge) == "ch_1"
    print("committed", flush=True)
    sys.stdin.read()  # killed here, the commit written but not synced
    """
)


def test_commit_lost_before_its_sync_is_uncertain_and_never_rerun(tmp_path: Path) -> None:
    path, snapshot, charges = tmp_path / "ledger.db", tmp_path / "snapshot.db", tmp_path / "ch"
    worker = subprocess.Popen(
        [sys.executable, "-c", POWER_CUT_WORKER, str(path), str(snapshot), str(charges)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline() == "committed\n"
        # Without a power cut the commit is there (a crashed process loses nothing):
        with SQLiteCacheBackend(path) as live:
            committed = live.get("order-42")
            assert committed is not None and committed.status is Status.COMMITTED
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()

    # Power comes back with only what was synced: the files as of the claim's sync.
    for suffix in ("", "-wal"):
        shutil.copyfile(f"{snapshot}{suffix}", f"{path}{suffix}")
    Path(f"{path}-shm").unlink(missing_ok=True)

    ledger = Ledger(SQLiteCacheBackend(path, synchronous="CLAIMS"), wait_s=5.0, lease_s=1.0)
    try:
        restored = ledger.get("order-42")
        assert restored is not None and restored.status is Status.PENDING  # the commit is gone
        ran: list[str] = []
        with pytest.raises(OutcomeUncertain):
            # Waits out the dead owner's lease if it is still live, then refuses to guess.
            ledger.run("order-42", lambda: ran.append("again") or "ch_2")
        assert ran == []
        with pytest.raises(OutcomeUncertain):
            ledger.run("order-42", lambda: ran.append("again") or "ch_2")
        assert ran == []
        assert charges.read_text().splitlines() == ["charged"]
        final = ledger.get("order-42")
        assert final is not None and final.status is Status.UNCERTAIN
    finally:
        ledger.close()


def test_claims_is_accepted_by_name_and_url(tmp_path: Path) -> None:
    from crewai_idempotent import backend_from_url

    backend = backend_from_url(f"sqlite:///{tmp_path / 'l.db'}?synchronous=claims")
    assert isinstance(backend, SQLiteCacheBackend) and backend.synchronous == "CLAIMS"
    backend.close()
    with pytest.raises(ValueError, match="FULL, NORMAL, EXTRA or CLAIMS"):
        SQLiteCacheBackend(tmp_path / "m.db", synchronous="LAZY")


def test_claims_mode_keeps_the_ledger_in_one_file_for_both_connections(tmp_path: Path) -> None:
    # The claim connection and the commit connection are the same database: a record
    # claimed on one is committed through the other and read back from either.
    ledger = Ledger(SQLiteCacheBackend(tmp_path / "l.db", synchronous="CLAIMS"))
    assert ledger.run("k", lambda: {"n": 1}) == {"n": 1}
    assert ledger.run("k", lambda: {"n": 2}) == {"n": 1}
    record = ledger.get("k")
    assert record is not None and record.status is Status.COMMITTED and record.revision == 2
    ledger.close()
