"""Sixteen processes, each with its own connection to a PostgreSQL or Redis server, race on
one key, round after round: the body runs exactly once every round (counted at the fake
provider)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.faults.race import run_race

ROUNDS = int(os.environ.get("CREWAI_IDEMPOTENT_SERVER_RACE_ROUNDS", "100"))
# max_size=2: a small pool, so that racers also queue for connections.
URL_OPTIONS = {"postgres": {"max_size": 2}, "redis": {}}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(URL_OPTIONS))
def test_sixteen_processes_on_one_key_run_it_once_every_round(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    server = request.getfixturevalue(f"{kind}_server")
    run_race(server.fresh_url(**URL_OPTIONS[kind]), tmp_path, rounds=ROUNDS)
