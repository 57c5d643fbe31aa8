"""The fork scenarios of tests/support/fork.py, run against every backend that survives a
fork: SQLite (FULL and NORMAL), the file lock, PostgreSQL and Redis. Real processes.

What Celery's prefork pool, `gunicorn --preload` and multiprocessing's `fork` start method
do to a ledger: a parent that already used it forks workers, then closes it or exits. The
child uses either the ledger object it inherited or a new one on the same store. Every
effect is counted at a fake provider: no key may be charged twice, and SQLite's
`integrity_check` must stay ok. What is particular to the local backends is in
tests/process/test_fork_local.py, to a server connection in tests/process/test_fork_servers.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import Ledger, OutcomeUncertain, backend_from_url
from tests.support.faults.provider import Provider
from tests.support.fork import (
    ROOT,
    assert_sound,
    charge_keys,
    inspect_until,
    killed_on_exit,
    renewed,
    run_scenario,
    stale_unwritten,
    wait_for,
)
from tests.support.stores import backend_factory

KINDS = ["sqlite", "sqlite-normal", "filelock", "postgres", "redis"]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def url(kind: str, request: pytest.FixtureRequest) -> str:
    return backend_factory(kind, request).url


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider.create(tmp_path / "effects.jsonl")


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
        owner.wait(timeout=30)
        stale_unwritten(url, "held")  # nobody renewed it after its owner died
        retry = Ledger(backend_from_url(url))
        try:
            with pytest.raises(OutcomeUncertain):
                retry.run("held", lambda: provider.charge("held"))
        finally:
            retry.close()
        # The worker's own claim is unaffected, after several lease periods of renewals: it
        # finishes and commits once.
        renewed(url, "child-own", 6)
        (tmp_path / "release").touch()
        result = wait_for(tmp_path / "child.json", timeout=30)
    assert result.get("value", "").startswith("ch_"), result
    assert [e["key"] for e in provider.effects()] == ["child-own"]
    assert_sound(kind, tmp_path, provider)


def _start_owner(url: str, tmp_path: Path, child: str, lease_s: float) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "tests.support.fork", "owner_killed", "--url", url,
            "--dir", str(tmp_path), "--child", child, "--lease-s", str(lease_s)]  # fmt: skip
    return subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
