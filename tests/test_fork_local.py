"""fork() with the local backends (SQLite FULL and NORMAL, the file lock): real processes.

What Celery's prefork pool, `gunicorn --preload` and multiprocessing's `fork` start method
do to a ledger: a parent that already used it forks workers, then closes it or exits. The
child uses either the ledger object it inherited or a new one on the same file. Every
effect is counted at a fake provider: no key may be charged twice, and SQLite's
`integrity_check` must stay ok. The scenarios live in tests/fork_support.py, shared with
the server backends.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import (
    Ledger,
    LedgerUnavailable,
    OutcomeUncertain,
    SQLiteCacheBackend,
    backend_from_url,
)
from tests.conftest import backend_factory
from tests.faults.provider import Provider
from tests.fork_support import (
    ROOT,
    charge_keys,
    duplicates,
    inspect_until,
    killed_on_exit,
    run_scenario,
    stale_within,
    wait_for,
)
from tests.unprivileged import in_child

LOCAL = ["sqlite", "sqlite-normal", "filelock"]


@pytest.fixture(params=LOCAL)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def url(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    return str(backend_factory(kind, tmp_path, request).url)  # type: ignore[attr-defined]


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider.create(tmp_path / "effects.jsonl")


def assert_sound(kind: str, tmp_path: Path, provider: Provider) -> None:
    """No key charged twice, and an SQLite ledger that SQLite itself finds intact."""
    assert duplicates(provider) == {}
    if kind.startswith("sqlite"):
        conn = sqlite3.connect(tmp_path / "ledger.db")
        try:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        finally:
            conn.close()


def replay_all(url: str, provider: Provider, keys: list[str]) -> dict[str, Any]:
    """Charge `keys` again from a ledger opened afresh: every one must be a replay."""
    ledger = Ledger(backend_from_url(url))
    try:
        return charge_keys(ledger, provider, keys)
    finally:
        ledger.close()


@pytest.mark.parametrize("child", ["inherited", "new"])
def test_parent_and_forked_child_charge_the_same_keys(
    kind: str, url: str, tmp_path: Path, provider: Provider, child: str
) -> None:
    report = run_scenario("concurrent", url, tmp_path, child=child, keys=80)
    assert report["child_exit"] == 0, report["child"]
    parent, forked = report["parent"], report["child"]["value"]
    assert parent["errors"] == [] and forked["errors"] == []
    assert parent["ran"] + forked["ran"] == 80
    assert parent["replayed"] + forked["replayed"] == 80
    keys = [f"both-{i:03d}" for i in range(80)]
    assert replay_all(url, provider, keys) == {"ran": 0, "replayed": 80, "errors": []}
    assert len(provider.effects()) == 81  # the parent's warm-up key, then each key once
    assert_sound(kind, tmp_path, provider)


@pytest.mark.parametrize("child", ["inherited", "new"])
def test_parent_closes_while_its_forked_worker_runs(
    kind: str, url: str, tmp_path: Path, provider: Provider, child: str
) -> None:
    keys = [f"child-{i:03d}" for i in range(120)]
    report = run_scenario("parent_closes", url, tmp_path, child=child, keys=len(keys))
    assert report["child_exit"] == 0, report["child"]
    assert report["child"]["value"] == {"ran": len(keys), "replayed": 0, "errors": []}
    # What the worker committed is in the one ledger everybody shares.
    assert replay_all(url, provider, keys) == {"ran": 0, "replayed": len(keys), "errors": []}
    assert len(provider.effects()) == 1 + len(keys)
    assert_sound(kind, tmp_path, provider)


@pytest.mark.parametrize("child", ["inherited", "new"])
def test_parent_exits_while_its_forked_worker_runs(
    kind: str, url: str, tmp_path: Path, provider: Provider, child: str
) -> None:
    keys = [f"child-{i:03d}" for i in range(120)]
    report = run_scenario("parent_exits", url, tmp_path, child=child, keys=len(keys))
    child_report = Path(report["report"])
    with killed_on_exit(report["child_pid"]):
        inspect_until(url, child_report.exists)  # others open and close it meanwhile
        result = wait_for(child_report, timeout=120)
    assert result.get("value") == {"ran": len(keys), "replayed": 0, "errors": []}, result
    assert replay_all(url, provider, keys) == {"ran": 0, "replayed": len(keys), "errors": []}
    assert len(provider.effects()) == 1 + len(keys)
    assert_sound(kind, tmp_path, provider)


def test_fork_pool_and_fresh_processes_share_150_keys(
    kind: str, url: str, tmp_path: Path, provider: Provider
) -> None:
    report = run_scenario("pool", url, tmp_path, keys=150)
    tallies = [*report["pool"], *report["fresh"]]
    assert [t["errors"] for t in tallies] == [[]] * 6
    assert sum(t["ran"] for t in tallies) == 150
    assert all(t["ran"] + t["replayed"] == 150 for t in tallies)
    keys = [f"shared-{i:03d}" for i in range(150)]
    assert replay_all(url, provider, keys) == {"ran": 0, "replayed": 150, "errors": []}
    assert len(provider.effects()) == 151  # warm-up, then every shared key once
    assert_sound(kind, tmp_path, provider)


@pytest.mark.parametrize("child", ["inherited", "new"])
def test_owner_killed_after_forking_goes_stale(
    kind: str, url: str, tmp_path: Path, provider: Provider, child: str
) -> None:
    """The owner of a running claim forks a worker (which claims a key of its own) and is
    then SIGKILLed: the worker must not keep the dead owner's lease alive."""
    lease_s = 1.5
    owner = _start_owner(url, tmp_path, child, lease_s)
    marker = wait_for(tmp_path / "owner.json", timeout=60)
    with killed_on_exit(owner.pid, marker["child"]):
        os.kill(marker["owner"], signal.SIGKILL)
        killed_at = time.monotonic()
        owner.wait(timeout=30)
        stale, record = stale_within(url, "held", 2 * lease_s)
        assert stale, f"the dead owner's claim was still live {2 * lease_s} s later: {record}"
        assert time.monotonic() - killed_at <= 2 * lease_s + 1.0
        retry = Ledger(backend_from_url(url))
        with pytest.raises(OutcomeUncertain):
            retry.run("held", lambda: provider.charge("held"))
        retry.close()
        # The worker's own claim is unaffected: it finishes and commits once.
        result = wait_for(tmp_path / "child.json", timeout=30)
    assert result.get("value", "").startswith("ch_"), result
    assert [e["key"] for e in provider.effects()] == ["child-own"]
    assert_sound(kind, tmp_path, provider)


def _start_owner(url: str, tmp_path: Path, child: str, lease_s: float) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "tests.fork_support", "owner_killed", "--url", url,
            "--dir", str(tmp_path), "--child", child, "--lease-s", str(lease_s)]  # fmt: skip
    return subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


# -- refusals: where the only safe answer is no ------------------------------------------------


def test_fork_that_bypasses_the_hooks_is_refused_in_the_child(
    kind: str, url: str, tmp_path: Path, provider: Provider
) -> None:
    report = run_scenario("bypass", url, tmp_path)
    assert report["child_exit"] == 0
    child = report["child"]
    if kind.startswith("sqlite"):
        for mode in ("inherited", "new"):
            (error,) = child[mode]["errors"]
            assert "LedgerUnavailable" in error and "bypassed os.register_at_fork" in error
            assert "Open the ledger in the child after the fork" in error
        assert [e["key"] for e in provider.effects()] == ["warm-up", "parent-after"]
    else:
        # A file lock is taken on a descriptor opened for that call: the child's locks are
        # its own, so the file-lock ledger stays usable in such a child.
        assert child["inherited"]["ran"] == 1 and child["new"]["ran"] == 1
    assert report["parent_after"] == {"ran": 1, "replayed": 0, "errors": []}
    assert_sound(kind, tmp_path, provider)


@pytest.mark.parametrize("synchronous", ["FULL", "NORMAL"])
def test_operation_outliving_the_fork_wait_refuses_the_file_in_the_child(
    tmp_path: Path, provider: Provider, synchronous: str
) -> None:
    """When an operation is still running when fork() happens, its connection cannot be
    closed: the child inherits SQLite's bookkeeping for the file in an unknown state and
    must refuse the file, through the inherited object and through a new one."""
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, synchronous=synchronous, busy_timeout_s=0.2)
    ledger = Ledger(backend)
    ledger.run("before", lambda: provider.charge("before"))
    stuck = threading.Event()
    release = threading.Event()

    def running_operation(conn: sqlite3.Connection) -> None:
        stuck.set()
        release.wait(30)  # an operation that outlives the fork wait (busy timeout + 1 s)

    worker = threading.Thread(target=backend._guard, args=(running_operation,))
    worker.start()
    assert stuck.wait(10)
    try:

        def in_the_child() -> Any:
            refusals = []
            for make in (lambda: ledger, lambda: Ledger(SQLiteCacheBackend(path))):
                try:
                    make().run("in-child", lambda: provider.charge("in-child"))
                except LedgerUnavailable as exc:
                    refusals.append(str(exc))
            return refusals

        refusals = in_child(in_the_child)["value"]
    finally:
        release.set()
        worker.join()
    assert len(refusals) == 2
    assert all("still running in the parent" in r and "after the fork" in r for r in refusals)
    # The parent carries on with its own connections.
    assert ledger.run("after", lambda: provider.charge("after")).startswith("ch_")
    assert [e["key"] for e in provider.effects()] == ["before", "after"]
    ledger.close()
    assert_sound("sqlite", tmp_path, provider)


def test_fork_waits_for_a_running_operation_then_both_sides_work(
    tmp_path: Path, provider: Provider
) -> None:
    """An operation in flight in another thread at fork() finishes first (its claim is not
    lost), then the connections close; parent and child both go on with fresh ones."""
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path)
    ledger = Ledger(backend)
    ledger.run("before", lambda: provider.charge("before"))
    started = threading.Event()

    def slow_operation(conn: sqlite3.Connection) -> None:
        started.set()
        time.sleep(0.5)
        conn.execute("SELECT count(*) FROM idempotency_records").fetchone()

    worker = threading.Thread(target=backend._guard, args=(slow_operation,))
    worker.start()
    assert started.wait(10)
    forked_at = time.monotonic()
    reply = in_child(lambda: ledger.run("in-child", lambda: provider.charge("in-child")))
    waited = time.monotonic() - forked_at
    worker.join()
    assert reply.get("value", "").startswith("ch_"), reply
    assert waited >= 0.3  # the fork waited for the operation instead of cutting it off
    assert ledger.run("in-child", lambda: "again").startswith("ch_")  # a replay
    assert [e["key"] for e in provider.effects()] == ["before", "in-child"]
    ledger.close()
    assert_sound("sqlite", tmp_path, provider)


def test_closed_while_an_operation_ran_still_counts_at_the_next_fork(
    tmp_path: Path, provider: Provider
) -> None:
    """close() cannot close a connection an operation still uses; a fork after that must
    still know the file is open in the parent."""
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, busy_timeout_s=0.2)
    Ledger(backend).run("before", lambda: provider.charge("before"))
    stuck, release = threading.Event(), threading.Event()

    def running_operation(conn: sqlite3.Connection) -> None:
        stuck.set()
        release.wait(30)

    worker = threading.Thread(target=backend._guard, args=(running_operation,))
    worker.start()
    assert stuck.wait(10)
    try:
        backend.close()  # gives up waiting after busy timeout + 1 s
        with pytest.raises(LedgerUnavailable, match="is closed"):
            backend.get("before")

        def in_the_child() -> Any:
            Ledger(SQLiteCacheBackend(path)).run("in-child", lambda: provider.charge("x"))

        reply = in_child(in_the_child)
    finally:
        release.set()
        worker.join()
    assert reply.get("error") == "LedgerUnavailable", reply
    assert "after the fork" in reply["message"]
    assert [e["key"] for e in provider.effects()] == ["before"]
