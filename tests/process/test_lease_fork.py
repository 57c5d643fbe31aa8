"""The lease keeper does not cross fork(): a child never renews its parent's claims.

Real processes: an owner process claims a key, forks (from another thread, or from inside
the body itself), the child makes a claim of its own, and the owner is SIGKILLed. Its
claim must go stale, never written again after the kill (a child that renewed it would
keep it live for ever), although the child lives on, while the child's own claim keeps
being renewed; a healthy owner keeps its lease however many children it forks, and a
retrying worker never runs its body a second time. Renewals are counted by revision, not
waited for in time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import Ledger, OperationInProgress, Status, backend_from_url
from tests.support.faults.provider import Provider

LEASE_S = 1.0
REPO = Path(__file__).resolve().parents[2]

OWNER = textwrap.dedent(
    """
    import json, os, sys, threading, time
    from crewai_idempotent import Ledger, backend_from_url

    url, report, mode, lease_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])

    def say(**fields):
        with open(report, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **fields}) + "\\n")

    ledger = Ledger(backend_from_url(url), lease_s=lease_s, wait_s=0)
    claimed = threading.Event()

    def forever(name):
        def body():
            claimed.set()
            time.sleep(3600)
        return body

    def forks_inside():
        if os.fork() == 0:
            return "the child's copy of the body"  # its commit must be refused
        claimed.set()
        time.sleep(3600)

    def settle_forks_inside():
        parent = os.getpid()
        try:
            ledger.run("parent", forks_inside)
            outcome = "returned"
        except Exception as exc:
            outcome = type(exc).__name__
        if os.getpid() != parent:  # the child, back from the body and done with the ledger
            say(role="child", outcome=outcome)

    if mode == "body-forks":
        threading.Thread(target=settle_forks_inside, daemon=True).start()
        claimed.wait()
        say(role="parent")
        time.sleep(3600)

    threading.Thread(target=ledger.run, args=("parent", forever("parent")), daemon=True).start()
    claimed.wait()
    child = os.fork()
    if child:
        say(role="parent", child=child)
        time.sleep(3600)
    # The child: the parent's ledger object, or one of its own, makes its own claim.
    mine = ledger if mode == "inherited" else Ledger(backend_from_url(url), lease_s=lease_s)
    claimed.clear()
    threading.Thread(target=mine.run, args=("child", forever("child")), daemon=True).start()
    claimed.wait()
    say(role="child", renewing=list(mine.stats().held))
    time.sleep(3600)
    """
)


@pytest.fixture(params=["sqlite", "filelock"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Owner:
    def __init__(self, url: str, tmp: Path, mode: str) -> None:
        self.report = tmp / f"{mode}.jsonl"
        self.report.touch()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
        env.pop("CREWAI_IDEMPOTENCY_URL", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", OWNER, url, str(self.report), mode, str(LEASE_S)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / f"{mode}.log", "wb"),  # noqa: SIM115 - closed with the process
        )
        self.pids: set[int] = {self.proc.pid}

    def lines(self, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [json.loads(line) for line in self.report.read_text().splitlines()]
            if len(found) >= count:
                for line in found:
                    self.pids.add(line["pid"])
                    self.pids.update([line["child"]] if "child" in line else [])
                return found
            assert self.proc.poll() is None, self.proc.returncode
            time.sleep(0.02)
        raise AssertionError(f"no {count} report lines in {timeout} s")

    def close(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def owners(tmp_path: Path) -> Iterator[list[Owner]]:
    started: list[Owner] = []
    yield started
    for owner in started:
        owner.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stale_after_kill(ledger: Ledger, owner: Owner, key: str, hang_s: float = 60.0) -> None:
    """SIGKILL the owner; its claim on `key` goes stale without being written again (a
    child renewing it would keep it live, revision after revision)."""
    owner.proc.send_signal(signal.SIGKILL)
    owner.proc.wait(10)
    at_kill = ledger.get(key)
    assert at_kill is not None
    deadline = time.monotonic() + hang_s  # a guard against a claim kept live, not a bound
    while time.monotonic() < deadline:
        record = ledger.get(key)
        assert record is not None
        assert record.revision == at_kill.revision, f"renewed after its owner died: {record}"
        if ledger.is_stale(record):
            return
        time.sleep(0.02)
    raise AssertionError(f"the dead owner's claim on {key!r} stayed live")


def _renewed(ledger: Ledger, key: str, times: int, hang_s: float = 60.0) -> None:
    """Wait until the claim on `key` has been renewed `times` more times, live each time."""
    first = ledger.get(key)
    assert first is not None
    deadline = time.monotonic() + hang_s
    while time.monotonic() < deadline:
        record = ledger.get(key)
        assert record is not None and record.status is Status.PENDING
        assert not ledger.is_stale(record)
        if record.revision >= first.revision + times:
            return
        time.sleep(0.02)
    raise AssertionError(f"the claim on {key!r} was not renewed {times} times")


@pytest.mark.parametrize("mode", ["inherited", "new"])
def test_a_dead_parents_claim_goes_stale_while_its_child_lives(
    backend_url: str, tmp_path: Path, owners: list[Owner], mode: str
) -> None:
    owner = Owner(backend_url, tmp_path, mode)
    owners.append(owner)
    lines = owner.lines(2)
    child = next(line for line in lines if line["role"] == "child")
    # The child renews its own claim and nothing of its parent's.
    assert child["renewing"] == ["child"]
    ledger = Ledger(backend_from_url(backend_url))
    try:
        _stale_after_kill(ledger, owner, "parent")
        assert alive(child["pid"])
        _renewed(ledger, "child", 3)  # a lease's worth of renewals: the child renews it
    finally:
        ledger.close()


def test_a_child_forked_inside_the_body_cannot_settle_the_claim(
    backend_url: str, tmp_path: Path, owners: list[Owner]
) -> None:
    owner = Owner(backend_url, tmp_path, "body-forks")
    owners.append(owner)
    lines = owner.lines(2)  # the child has returned from the body and tried to settle
    assert [line["role"] for line in lines].count("child") == 1
    ledger = Ledger(backend_from_url(backend_url))
    try:
        record = ledger.get("parent")
        assert record is not None and record.status is Status.PENDING
        assert [event.kind for event in record.history] == ["claim"]
        assert record.owner is not None and record.owner.pid == owner.proc.pid
        _stale_after_kill(ledger, owner, "parent")
        record = ledger.get("parent")
        assert record is not None and [event.kind for event in record.history] == ["claim"]
    finally:
        ledger.close()


def test_a_forking_owner_keeps_its_lease_against_retrying_workers(
    backend_url: str, tmp_path: Path
) -> None:
    """A healthy owner forks children that claim keys of their own while a worker with
    on_stale="retry" keeps trying its key: the owner's lease never lapses."""
    provider = Provider.create(tmp_path / "charges.jsonl")
    ledger = Ledger(backend_from_url(backend_url), lease_s=LEASE_S / 2)
    inside = threading.Event()
    children: list[int] = []

    def owner_body() -> str:
        inside.set()
        receipt = provider.charge("k")
        for n in range(4):
            child = os.fork()
            if child == 0:  # pragma: no cover - the child process
                code = 0
                try:
                    ledger.run(f"child-{n}", lambda: time.sleep(LEASE_S) or "done")
                except BaseException:  # noqa: BLE001
                    code = 1
                os._exit(code)
            children.append(child)
            time.sleep(LEASE_S / 2)
        return receipt

    thread = threading.Thread(target=ledger.run, args=("k", owner_body))
    thread.start()
    assert inside.wait(10)
    retrier = Ledger(backend_from_url(backend_url), lease_s=LEASE_S / 2)
    refused = 0
    while thread.is_alive():
        try:
            retrier.run("k", lambda: provider.charge("k"), on_stale="retry", wait_s=0.05)
        except OperationInProgress:
            refused += 1
    thread.join()
    statuses = []
    for child in children:
        _, status = os.waitpid(child, 0)
        statuses.append(os.waitstatus_to_exitcode(status))
    record = ledger.get("k")
    ledger.close()
    retrier.close()
    assert statuses == [0, 0, 0, 0]
    assert len(provider.effects("k")) == 1
    assert record is not None and record.status is Status.COMMITTED
    assert [event.kind for event in record.history] == ["claim", "commit"]
    assert refused > 0
