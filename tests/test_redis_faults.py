"""Faults around a real Redis: workers killed at every point of a guarded call, the server
restarted (cleanly and by SIGKILL) under a run of calls, connections cut around the claim
and the commit, and the server gone."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from crewai_idempotent import Ledger, LedgerUnavailable, backend_from_url
from crewai_idempotent.backends.redis import _CLAIM, _REPLACE
from tests.faults.matrix import CELLS, assert_cell, runs_per_cell
from tests.servers import (
    CuttingProxy,
    RedisServer,
    check_cut_claims,
    check_cut_commits,
    discard,
    effects_per_key,
    free_port,
    run_kill_cells,
    run_through_restart,
    start_redis,
)

# Each round kills one worker holding COPIES keys of every cell: ROUNDS x COPIES runs a cell.
ROUNDS = int(os.environ.get("CREWAI_IDEMPOTENT_KILL_ROUNDS", "5"))
COPIES = int(os.environ.get("CREWAI_IDEMPOTENT_KILL_COPIES", "4"))


def _sha(script: str) -> bytes:
    import hashlib

    return hashlib.sha1(script.encode()).hexdigest().encode()


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A server of this module's own: these tests restart it. AOF with appendfsync
    everysec: a killed redis-server loses nothing it acknowledged (only the machine
    crashing could lose the last second)."""
    server = start_redis(appendonly=True, appendfsync="everysec")
    yield server
    discard(server)


@pytest.fixture
def proxy(server: RedisServer) -> Iterator[CuttingProxy]:
    proxy = CuttingProxy(server.port)
    yield proxy
    proxy.close()


# The recovery helper's matrix (one worker per run, operator resolution afterwards):
# MATRIX_RUNS per cell here on top of the runs above, its own count with its soak switches.
MATRIX_RUNS = (
    runs_per_cell()
    if os.environ.get("CREWAI_IDEMPOTENT_FAULT_RUNS") or os.environ.get("CREWAI_IDEMPOTENT_SOAK")
    else 5
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "reconciler"),
    CELLS,
    ids=[f"{point}-{'reconciler' if reconciler else 'bare'}" for point, reconciler in CELLS],
)
def test_the_fault_matrix_cell(
    server: RedisServer, point: str, reconciler: bool, tmp_path: Path
) -> None:
    assert_cell(server.fresh_url(), point, reconciler, tmp_path / "cell", runs=MATRIX_RUNS)


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_worker_killed_at_any_point_never_causes_a_second_effect(
    server: RedisServer, tmp_path: Path, round_: int
) -> None:
    run_kill_cells(server.fresh_url(), tmp_path / "effects", copies=COPIES)


@pytest.mark.slow
@pytest.mark.parametrize("crash", [False, True], ids=["shutdown", "sigkill"])
def test_a_server_restart_under_load_fails_calls_closed_and_then_serves_again(
    server: RedisServer, tmp_path: Path, crash: bool
) -> None:
    run_through_restart(
        server.fresh_url(timeout_s=1),
        tmp_path / "effects",
        server.kill if crash else server.stop,  # SIGKILL, or SIGTERM (which flushes the AOF)
        server.start,
        down_s=1.5,  # longer than a call keeps resending
    )


def test_a_claim_cut_on_the_wire_fails_closed_or_is_recognised_when_resent(
    server: RedisServer, proxy: CuttingProxy, tmp_path: Path
) -> None:
    url = server.fresh_url(timeout_s=2).replace(f":{server.port}/", f":{proxy.port}/")
    check_cut_claims(url, proxy, _sha(_CLAIM), tmp_path / "effects")


def test_a_commit_cut_on_the_wire_is_recognised_when_resent_or_left_uncertain(
    server: RedisServer, proxy: CuttingProxy, tmp_path: Path
) -> None:
    url = server.fresh_url(timeout_s=2).replace(f":{server.port}/", f":{proxy.port}/")
    check_cut_commits(url, proxy, _sha(_REPLACE), tmp_path / "effects")


def test_no_server_means_no_run(tmp_path: Path) -> None:
    ledger = Ledger(backend_from_url(f"redis://127.0.0.1:{free_port()}/0?timeout_s=0.5"))
    try:
        with pytest.raises(LedgerUnavailable, match=r"cannot be reached.*refused"):
            ledger.run("k", lambda: (tmp_path / "ran").touch())
        assert not (tmp_path / "ran").exists()
    finally:
        ledger.close()


def test_a_server_stopped_between_calls_fails_the_next_claim_closed(
    server: RedisServer, tmp_path: Path
) -> None:
    effects = tmp_path / "effects"
    ledger = Ledger(backend_from_url(server.fresh_url(timeout_s=1)))
    try:
        assert ledger.run("before", lambda: "r") == "r"
        server.stop()
        try:
            with pytest.raises(LedgerUnavailable):
                ledger.run("down", lambda: effects.write_text("ran"))
        finally:
            server.start()
        assert not effects.exists()
        assert ledger.run("after", lambda: "back") == "back"
        assert ledger.run("down", lambda: "ran now") == "ran now"  # nothing was claimed
        assert ledger.run("before", lambda: "again") == "r"  # the AOF kept the receipt
    finally:
        ledger.close()
    assert effects_per_key(effects) == {}
