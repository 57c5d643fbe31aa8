"""Real processes started together on the same keys: each body runs exactly once.

Executions are counted at a fake provider (lines appended to a file the processes share),
never in log lines.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import random
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from crewai_idempotent import Ledger, backend_from_url
from tests.support.forked_race import fork_together

# The server backends race 16 processes in tests/test_{postgres,redis}_race.py.
LOCAL_DURABLE_BACKENDS = ["sqlite", "sqlite-normal", "sqlite-claims", "filelock"]

ROUNDS = int(os.environ.get("CREWAI_IDEMPOTENT_RACE_ROUNDS", "100"))
PROCESSES = 8


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode() + b"\n")  # one small O_APPEND write: never interleaved
    finally:
        os.close(fd)


def _worker(
    url: str,
    plan: list[list[str]],
    barrier: threading.Barrier,
    folder: Path,
    start_fd: int,
) -> None:
    """Run round after round: `plan[r]` is this process's keys in round `r`. Every round
    starts in all the processes at once (the barrier), so each is a fresh race."""
    ledger = Ledger(backend_from_url(url), wait_s=30.0)
    os.read(start_fd, 1)  # blocks until the parent closes the pipe: everyone is forked
    try:
        for round_, keys in enumerate(plan):
            effects, results = folder / f"effects-{round_}", folder / f"results-{round_}"
            barrier.wait(timeout=120)
            for key in keys:

                def charge(key: str = key, effects: Path = effects) -> str:
                    _append(effects, key)
                    time.sleep(random.uniform(0, 0.003))
                    return f"receipt:{key}:{os.getpid()}"

                _append(results, f"{key} {ledger.run(key, charge)}")
    except BaseException:
        barrier.abort()  # the others stop at the next round instead of waiting it out
        raise
    ledger.close()


def _race(url: str, plans: list[list[list[str]]], folder: Path) -> None:
    """Fork one process per entry of `plans` (its keys round by round), run every round
    in all of them together, wait for all. The processes are forked once, not once per
    round: a fork of the test process costs more than a round."""
    barrier = multiprocessing.get_context("fork").Barrier(len(plans))
    codes = fork_together(functools.partial(_worker, url, plan, barrier, folder) for plan in plans)
    failures = [code for code in codes if code != 0]
    assert not failures, f"{len(failures)} worker(s) failed; see stderr"


def _check(effects: Path, results: Path, keys: list[str], callers_per_key: int) -> None:
    ran = Counter(effects.read_text().split())
    assert {key: ran[key] for key in keys} == dict.fromkeys(keys, 1)
    returned: dict[str, set[str]] = {}
    calls: Counter[str] = Counter()
    for line in results.read_text().splitlines():
        key, value = line.split(" ", 1)
        returned.setdefault(key, set()).add(value)
        calls[key] += 1
    assert all(len(values) == 1 for values in returned.values()), "a caller saw another receipt"
    assert calls == dict.fromkeys(keys, callers_per_key)


@pytest.fixture(params=LOCAL_DURABLE_BACKENDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.slow
def test_processes_racing_on_one_key_run_it_once(backend_url: str, tmp_path: Path) -> None:
    keys = [f"one-key-{round_}" for round_ in range(ROUNDS)]
    _race(backend_url, [[[key] for key in keys]] * PROCESSES, tmp_path)
    for round_, key in enumerate(keys):
        effects, results = tmp_path / f"effects-{round_}", tmp_path / f"results-{round_}"
        _check(effects, results, [key], PROCESSES)


@pytest.mark.slow
def test_processes_racing_on_distinct_keys_run_each_once(backend_url: str, tmp_path: Path) -> None:
    rng = random.Random(7)
    rounds = [[f"round-{round_}-key-{i}" for i in range(PROCESSES)] for round_ in range(ROUNDS)]
    # Each process takes each round's keys in its own order.
    plans = [[rng.sample(keys, len(keys)) for keys in rounds] for _ in range(PROCESSES)]
    _race(backend_url, plans, tmp_path)
    for round_, keys in enumerate(rounds):
        effects, results = tmp_path / f"effects-{round_}", tmp_path / f"results-{round_}"
        _check(effects, results, keys, PROCESSES)
