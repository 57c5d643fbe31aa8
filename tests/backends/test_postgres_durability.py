"""PostgreSQL settings that can lose an acknowledged claim: the warning and `doctor`.

Each test starts its own throwaway server with the setting under test (the session's
shared server runs with fsync=off for speed, which is why pyproject.toml ignores
`PostgresDurabilityWarning` for the rest of the suite): fsync=off, synchronous_commit=off
(server-wide, and set for the ledger's database only, as the session reports it),
full_page_writes=off, a standby streaming asynchronously, and the defaults.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner, Result

from crewai_idempotent import Ledger, PostgresDurabilityWarning, backend_from_url
from crewai_idempotent.cli import main
from tests.support.servers import PostgresServer, discard, start_postgres


@pytest.fixture
def servers() -> Iterator[list[PostgresServer]]:
    started: list[PostgresServer] = []
    yield started
    for server in reversed(started):
        discard(server)


def _server(started: list[PostgresServer], **settings: str) -> PostgresServer:
    # fsync=True: the defaults (fsync and full_page_writes on) unless a test says otherwise.
    server = start_postgres(fsync=True, max_connections=20, settings=settings)
    started.append(server)
    return server


def doctor(url: str) -> Result:
    return CliRunner().invoke(main, ["--ledger", url, "doctor"], env={"COLUMNS": "250"})


def _opened(url: str) -> list[warnings.WarningMessage]:
    """The durability warnings the first use of a new backend raises (and a second use
    does not: once per backend)."""
    backend = backend_from_url(url)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Ledger(backend).run("k", lambda: "ok")
        with warnings.catch_warnings():
            warnings.simplefilter("error", PostgresDurabilityWarning)
            backend.get("k")
    finally:
        backend.close()
    return [w for w in caught if issubclass(w.category, PostgresDurabilityWarning)]


def test_the_defaults_raise_nothing_and_doctor_exits_0(servers: list[PostgresServer]) -> None:
    server = _server(servers)
    assert _opened(server.fresh_url()) == []
    result = doctor(server.fresh_url())
    assert result.exit_code == 0, result.output
    assert (
        "durability   fsync=on, synchronous_commit=on, full_page_writes=on: acknowledged "
        "commits survive a crash"
    ) in result.stdout


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"synchronous_commit": "off"}, "synchronous_commit=off"),
        ({"fsync": "off"}, "fsync=off"),
        ({"full_page_writes": "off"}, "full_page_writes=off"),
    ],
    ids=["synchronous_commit=off", "fsync=off", "full_page_writes=off"],
)
def test_a_setting_that_can_lose_a_claim_warns_and_fails_doctor(
    servers: list[PostgresServer], settings: dict[str, str], named: str
) -> None:
    server = _server(servers, **settings)
    [warning] = _opened(server.fresh_url())
    assert f"{named}: " in str(warning.message) and "run again" in str(warning.message)
    assert server.dsn().split("@")[1].split("/")[0] in str(warning.message)
    result = doctor(server.fresh_url())
    assert result.exit_code == 1, result.output
    [problem] = [line for line in result.stdout.splitlines() if "PROBLEM" in line]
    assert problem.startswith(f"durability   PROBLEM: {named}: ")
    assert "1 problem(s) found" in result.stderr


def test_the_sessions_own_synchronous_commit_counts(servers: list[PostgresServer]) -> None:
    """The server's default is on, but the ledger's database sets it off for its
    sessions: what matters is what the ledger's own session gets."""
    server = _server(servers)
    server.sql("CREATE DATABASE ledger_db")
    server.sql("ALTER DATABASE ledger_db SET synchronous_commit = off")
    url = server.dsn("ledger_db") + "?table=ledger"
    [warning] = _opened(url)
    assert "synchronous_commit=off" in str(warning.message)
    assert doctor(url).exit_code == 1
    assert _opened(server.fresh_url()) == []  # the postgres database keeps the default


def test_the_check_can_be_turned_off(servers: list[PostgresServer]) -> None:
    server = _server(servers, fsync="off")
    assert _opened(server.fresh_url(check_durability="false")) == []


def test_an_asynchronous_standby_is_a_problem_until_it_is_synchronous(
    servers: list[PostgresServer],
) -> None:
    """A failover target that may lack acknowledged claims: named until the primary
    waits for it (synchronous_standby_names), and again if the ledger's commits do not
    wait (synchronous_commit=local)."""
    primary = _server(servers)
    servers.append(primary.standby())
    _replicating(primary)
    result = doctor(primary.fresh_url())
    assert result.exit_code == 1, result.output
    assert "1 standby(s), synchronous_standby_names=''" in result.stdout
    assert "PROBLEM: synchronous_standby_names='': 1 standby server(s)" in result.stdout
    [warning] = _opened(primary.fresh_url())
    assert "asynchronously" in str(warning.message)

    primary.sql("ALTER SYSTEM SET synchronous_standby_names = '*'")
    primary.sql("SELECT pg_reload_conf()")
    _until(lambda: primary.sql("SHOW synchronous_standby_names") == [("*",)])
    result = doctor(primary.fresh_url())
    assert result.exit_code == 0, result.output
    assert _opened(primary.fresh_url()) == []

    primary.sql("CREATE DATABASE local_db")
    primary.sql("ALTER DATABASE local_db SET synchronous_commit = local")
    result = doctor(primary.dsn("local_db") + "?table=ledger")
    assert result.exit_code == 1
    assert "PROBLEM: synchronous_commit=local: commits do not wait" in result.stdout


def _replicating(primary: PostgresServer) -> None:
    _until(lambda: primary.sql("SELECT count(*) FROM pg_stat_replication") == [(1,)])


def _until(done: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not done within {timeout} s")
        time.sleep(0.05)
