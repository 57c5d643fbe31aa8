"""Sixteen processes, each with its own PostgreSQL connection, race on one key, round after
round: the body runs exactly once every round (counted at a fake provider)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.servers import PostgresServer, run_race

ROUNDS = int(os.environ.get("CREWAI_IDEMPOTENT_SERVER_RACE_ROUNDS", "100"))


@pytest.mark.slow
def test_sixteen_processes_on_one_key_run_it_once_every_round(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    run_race(postgres_server.fresh_url(max_size=2), tmp_path / "effects", rounds=ROUNDS)
