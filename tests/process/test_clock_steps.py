"""A clock that steps never runs a body twice: real processes whose wall clocks read wrong.

Debian's `faketime` (libfaketime) runs a worker with its wall clock moved by an offset;
with FAKETIME_DONT_FAKE_MONOTONIC=1 it leaves CLOCK_MONOTONIC and CLOCK_BOOTTIME alone, as
an NTP step or `date -s` does (without that variable it would move those too, which no
step does). `test_faketime_steps_only_the_wall_clock` checks exactly that on this machine
before anything relies on it.

Against a live owner that renews its lease while its provider call is in flight, on
SQLite FULL, CLAIMS and NORMAL and on the file lock, with each stale policy (uncertain,
reconcile with a reconciler that truthfully asks the provider, retry): a worker whose
clock reads +1 h, +1 day or -1 h, and the same with the owner's clock stepped instead.
Every such worker gets OperationInProgress, no reconciler is asked, the record never
turns UNCERTAIN, and the provider shows one charge. `unshare --time` does the same with
the host's clocks themselves offset by a time namespace, which the ledger takes off.

Workers are real processes and wait in real time, bounded by their own `wait_s`; nothing
here asserts how long anything took.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import Ledger, Record, Status, backend_from_url
from tests.support.faults import launch
from tests.support.faults.provider import Provider
from tests.support.faults.worker import Spec
from tests.support.servers import missing

URLS: dict[str, Callable[[Path], str]] = {
    "sqlite-full": lambda folder: f"sqlite:///{folder / 'ledger.db'}",
    "sqlite-claims": lambda folder: f"sqlite:///{folder / 'ledger.db'}?synchronous=CLAIMS",
    "sqlite-normal": lambda folder: f"sqlite:///{folder / 'ledger.db'}?synchronous=NORMAL",
    "filelock": lambda folder: f"file://{folder / 'ledger'}",
}
STEPS = {"+1h": 3600.0, "+1d": 86400.0, "-1h": -3600.0}
POLICIES = ("uncertain", "reconcile", "retry")
# Long enough that a loaded machine never starves the owner's keeper (it renews every
# lease_s/3); a waiter's wait_s spans more than two lease periods of renewals.
LEASE_S = 2.0
WAIT_S = 5.0


def _faketime() -> str:
    found = shutil.which("faketime")
    if found is None:
        missing("faketime not found: install Debian's faketime package (libfaketime)")
    return found


def stepped(seconds: float) -> tuple[tuple[str, ...], dict[str, str]]:
    """The wrapper and environment that run a worker with its wall clock `seconds` off."""
    return (_faketime(), "-f", f"{seconds:+.0f}"), {"FAKETIME_DONT_FAKE_MONOTONIC": "1"}


def test_faketime_steps_only_the_wall_clock() -> None:
    """What the tests below rely on: the child's wall clock is an hour ahead, its
    monotonic and boot clocks are the host's (read before and after it ran)."""
    wrap, env = stepped(3600.0)
    probe = (
        "import json, time; print(json.dumps([time.time(), "
        "time.clock_gettime(time.CLOCK_MONOTONIC), time.clock_gettime(time.CLOCK_BOOTTIME)]))"
    )
    before = time.time(), time.clock_gettime(time.CLOCK_MONOTONIC), _boottime()
    done = subprocess.run(
        [*wrap, sys.executable, "-c", probe],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env}, check=True,
    )  # fmt: skip
    after = time.time(), time.clock_gettime(time.CLOCK_MONOTONIC), _boottime()
    wall, monotonic, boottime = json.loads(done.stdout)
    assert before[0] + 3600 <= wall <= after[0] + 3600
    assert before[1] <= monotonic <= after[1]
    assert before[2] <= boottime <= after[2]


def _boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class Scene:
    """One ledger, one provider, and the workers started against them."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.url, self.tmp = url, tmp
        self.provider = Provider.create(tmp / "provider.jsonl")
        self.ledger = Ledger(backend_from_url(url))
        self.procs: list[launch.Proc] = []

    def start(
        self,
        role: str,
        key: str,
        *,
        wrap: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        **options: Any,
    ) -> launch.Proc:
        spec = Spec(
            ledger=self.url, provider=str(self.provider.path), key=key,
            report=str(self.tmp / f"{role}.json"), marker=str(self.tmp / f"{role}.at"),
            lease_s=LEASE_S, wait_s=WAIT_S, **options,
        )  # fmt: skip
        proc = launch.start(spec, "exec", self.tmp / f"{role}.log", wrap=wrap, env=env)
        self.procs.append(proc)
        return proc

    def owner(self, key: str, **options: Any) -> tuple[launch.Proc, Path]:
        """A worker that claims `key` and holds it, renewing, until released."""
        release = self.tmp / f"release-{key}"
        proc = self.start(
            f"owner-{key}", key, pause_at="before_effect", release=str(release), **options
        )
        return proc, release

    def record(self, key: str) -> Record:
        record = self.ledger.get(key)
        assert record is not None
        return record

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        self.ledger.close()


@pytest.fixture(params=list(URLS))
def scene(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Scene]:
    _faketime()
    built = Scene(URLS[request.param](tmp_path), tmp_path)
    yield built
    built.close()


def _waiter(scene: Scene, role: str, key: str, policy: str, **how: Any) -> launch.Proc:
    return scene.start(role, key, on_stale=policy, reconcile=policy == "reconcile", **how)


def _assert_kept_off(report: dict[str, Any]) -> None:
    """A worker that found the live claim: it waited, gave up, asked nobody, ran nothing."""
    assert report["outcome"] == "error", report
    assert report["error_type"] == "OperationInProgress", report
    assert report["reconcile_calls"] == []
    assert report["record"]["status"] == "PENDING" and report["record"]["token"] == 1


def _assert_one_charge(scene: Scene, key: str, owner: launch.Proc) -> None:
    ran = launch.finish(owner)
    assert ran["outcome"] == "ran", ran
    [charge] = scene.provider.effects(key)
    assert charge["pid"] == ran["pid"] and ran["value"] == charge["receipt"]
    record = scene.record(key)
    assert record.status is Status.COMMITTED
    assert [f"{e.kind}/{e.token}" for e in record.history] == ["claim/1", "commit/1"]


def test_a_worker_whose_clock_steps_never_takes_over_a_live_claim(scene: Scene) -> None:
    """Nine stepped workers (three steps, three policies) against one live owner."""
    owner, release = scene.owner("held")
    launch.wait_for_marker(owner)
    launched = time.time()
    waiters = {
        (step, policy): _waiter(scene, f"b{step}-{policy}", "held", policy, **_how(STEPS[step]))
        for step in STEPS
        for policy in POLICIES
    }
    for (step, policy), proc in waiters.items():
        report = launch.finish(proc)
        _assert_kept_off(report)
        # The step took effect: the worker's own clock read that far off.
        assert abs(report["started"] - launched - STEPS[step]) < 600, (step, policy, report)
    assert scene.provider.effects() == []
    release.touch()
    _assert_one_charge(scene, "held", owner)


@pytest.mark.slow
def test_an_owner_whose_clock_steps_keeps_its_claim(scene: Scene) -> None:
    """Three owners whose clocks read +1 h, +1 day and -1 h (their wall-clock leases say
    lapsed long ago, or live for a day), each against three workers with the host's time."""
    owners = {step: scene.owner(f"held{step}", **_how(STEPS[step])) for step in STEPS}
    for step, (owner, _) in owners.items():
        launch.wait_for_marker(owner)
        claimed = scene.record(f"held{step}")
        assert abs(claimed.created_at - time.time() - STEPS[step]) < 600, step
    waiters = {
        (step, policy): _waiter(scene, f"b{step}-{policy}", f"held{step}", policy)
        for step in STEPS
        for policy in POLICIES
    }
    for proc in waiters.values():
        _assert_kept_off(launch.finish(proc))
    assert scene.provider.effects() == []
    for step, (owner, release) in owners.items():
        release.touch()
        _assert_one_charge(scene, f"held{step}", owner)


def _how(seconds: float) -> dict[str, Any]:
    wrap, env = stepped(seconds)
    return {"wrap": wrap, "env": env}


# -- time namespaces: the host's clocks themselves offset ----------------------------------


def _unshare(offset: int) -> tuple[str, ...]:
    """A wrapper that runs a worker in a time namespace whose monotonic and boot clocks
    read `offset` seconds off the host's; skips where the kernel or the privileges refuse."""
    unshare = shutil.which("unshare")
    if unshare is None:
        missing("unshare not found: install Debian's util-linux")
    wrap = (unshare, "--time", "--monotonic", str(offset), "--boottime", str(offset))
    probe = subprocess.run(
        [*wrap, sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a time namespace here: {probe.stderr.strip()}")
    return wrap


def test_time_namespaces_of_one_kernel_read_one_host_clock(tmp_path: Path) -> None:
    """An owner in a time namespace whose clocks read 200 s behind the host's and a worker
    in one whose clocks read 1000 s ahead: without the offsets taken off, the worker would
    see the owner's lease lapsed twenty minutes ago and take the claim over."""
    behind = max(0, min(200, int(time.clock_gettime(time.CLOCK_MONOTONIC)) - 10))
    scene = Scene(URLS["sqlite-full"](tmp_path), tmp_path)
    try:
        owner, release = scene.owner("held", wrap=_unshare(-behind))
        launch.wait_for_marker(owner)
        waiters = [
            _waiter(scene, f"b-{policy}", "held", policy, wrap=_unshare(1000))
            for policy in POLICIES
        ]
        for proc in waiters:
            _assert_kept_off(launch.finish(proc))
        release.touch()
        _assert_one_charge(scene, "held", owner)
    finally:
        scene.close()
