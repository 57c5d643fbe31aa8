"""What is particular to the PostgreSQL backend: its versioned schema, the server clock, its
pool, and the specific errors it gives. (The ledger's semantics are in the conformance
suite, which this backend joins through conftest.)"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from crewai_idempotent import Ledger, LedgerUnavailable, backend_from_url
from crewai_idempotent.backends.postgres import SCHEMA_VERSION, PostgresCacheBackend
from tests.servers import PostgresServer


@pytest.fixture
def admin(postgres_server: PostgresServer) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(postgres_server.dsn(), autocommit=True) as conn:
        yield conn


@pytest.fixture
def table() -> str:
    return f"ledger_{uuid.uuid4().hex[:16]}"


@pytest.fixture
def open_ledger(postgres_server: PostgresServer) -> Iterator[Any]:
    opened: list[Ledger] = []

    def open_(url: str | None = None, **options: Any) -> Ledger:
        ledger = Ledger(backend_from_url(url or postgres_server.fresh_url()), **options)
        opened.append(ledger)
        return ledger

    yield open_
    for ledger in opened:
        ledger.close()


def test_first_use_creates_the_table_and_records_its_schema_version(
    postgres_server: PostgresServer, admin: psycopg.Connection[Any], table: str, open_ledger: Any
) -> None:
    ledger = open_ledger(postgres_server.url(table=table))
    assert ledger.run("k", lambda: "r") == "r"
    version = admin.execute(
        "SELECT version FROM crewai_idempotency_schema WHERE table_name = %s", (table,)
    ).fetchone()
    assert version == (SCHEMA_VERSION,)
    rows = admin.execute(f'SELECT key, status, token, revision FROM "{table}"').fetchall()
    assert rows == [("k", "COMMITTED", 1, 2)]


def test_a_table_migrated_by_a_newer_release_is_refused_and_nothing_runs(
    postgres_server: PostgresServer, admin: psycopg.Connection[Any], table: str, open_ledger: Any
) -> None:
    url = postgres_server.url(table=table)
    open_ledger(url).get("k")
    admin.execute(
        "UPDATE crewai_idempotency_schema SET version = 99 WHERE table_name = %s", (table,)
    )
    ran = []
    with pytest.raises(LedgerUnavailable, match=r"schema version 99.*Upgrade crewai-idempotent"):
        open_ledger(url).run("k", lambda: ran.append(1))
    assert ran == []


def test_many_workers_starting_at_once_on_a_fresh_table_all_work(
    postgres_server: PostgresServer, table: str
) -> None:
    url = postgres_server.url(table=table)
    backends = [backend_from_url(url) for _ in range(8)]
    start = threading.Barrier(len(backends))
    results: list[Any] = []

    def first_use(n: int) -> None:
        start.wait()
        try:
            results.append(Ledger(backends[n]).run("shared", lambda: f"worker {n}"))
        except Exception as exc:  # noqa: BLE001 - asserted below
            results.append(exc)

    threads = [threading.Thread(target=first_use, args=(n,)) for n in range(len(backends))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for backend in backends:
        backend.close()
    assert len({str(r) for r in results}) == 1, results  # one ran; the others replayed it


def test_a_schema_option_keeps_the_ledger_in_that_schema(
    postgres_server: PostgresServer, admin: psycopg.Connection[Any], table: str, open_ledger: Any
) -> None:
    schema = f"s_{uuid.uuid4().hex[:8]}"
    open_ledger(postgres_server.url(table=table, schema=schema)).run("k", lambda: "r")
    found = admin.execute(
        "SELECT table_schema, table_name FROM information_schema.tables WHERE table_schema = %s "
        "ORDER BY table_name",
        (schema,),
    ).fetchall()
    assert found == [(schema, "crewai_idempotency_schema"), (schema, table)]


@pytest.mark.parametrize(
    ("option", "value"),
    [("table", 'x"; DROP TABLE y; --'), ("table", "1abc"), ("table", "a" * 64),
     ("table", ""), ("table", "tablé"), ("schema", "public.x")],
)  # fmt: skip
def test_a_table_or_schema_name_that_is_not_a_plain_identifier_is_refused(
    option: str, value: str
) -> None:
    with pytest.raises(ValueError, match=f"{option} must be a plain identifier"):
        PostgresCacheBackend("postgresql://localhost/x", **{option: value})


def test_url_options_are_ours_and_the_rest_go_to_libpq(
    postgres_server: PostgresServer, table: str, open_ledger: Any
) -> None:
    url = postgres_server.url(
        table=table, max_size=3, timeout_s=2.5, statement_timeout_s=1.5,
        application_name="billing-crew",
    )  # fmt: skip
    ledger = open_ledger(url)
    backend = ledger.backend
    assert isinstance(backend, PostgresCacheBackend)
    assert (backend.table, backend.max_size, backend.timeout_s) == (table, 3, 2.5)
    ledger.run("k", lambda: "r")
    settings = backend._call(
        "checking",
        lambda conn, _resent: conn.execute(
            "SELECT current_setting('application_name'), current_setting('statement_timeout')"
        ).fetchone(),
        retry=False,
    )
    assert settings == ("billing-crew", "1500ms")
    with pytest.raises(ValueError, match="max_size"):
        backend_from_url(postgres_server.url(max_size="many"))


def test_leases_are_measured_on_the_server_clock_not_the_host_clock(
    open_ledger: Any, admin: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600.0)  # this host is an hour off
    ledger = open_ledger(lease_s=30.0)
    seen: list[Any] = []
    ledger.run("k", lambda: seen.append(ledger.get("k")))
    (server_now,) = admin.execute("SELECT extract(epoch from clock_timestamp())::float8").fetchone()
    claim = seen[0]
    assert abs(claim.created_at - server_now) < 2.0
    assert abs(claim.lease_expires_at - (claim.created_at + 30.0)) < 1e-6
    assert abs(ledger.backend.now() - server_now) < 2.0


def test_the_server_clock_costs_no_round_trip_per_claim(
    open_ledger: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = open_ledger()
    ledger.run("warm-up", lambda: None)  # connected, migrated, clock read
    statements: list[str] = []
    execute = psycopg.Connection.execute

    def counting(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        statements.append(str(query).split()[0])
        return execute(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "execute", counting)
    for n in range(50):
        ledger.run(f"k{n}", lambda: "r")
    assert statements == ["WITH", "UPDATE"] * 50  # the claim and the commit, nothing else


def test_the_server_clock_is_read_again_after_the_refresh_interval(
    postgres_server: PostgresServer, open_ledger: Any
) -> None:
    ledger = open_ledger(postgres_server.fresh_url(clock_refresh_s=0.2))
    ledger.run("warm-up", lambda: None)
    clock = ledger.backend._clock
    first = clock.reading
    time.sleep(0.3)
    ledger.run("k", lambda: None)
    assert clock.reading != first


def test_sessions_ended_by_an_admin_are_replaced_without_failing_a_call(
    postgres_server: PostgresServer, admin: psycopg.Connection[Any], open_ledger: Any
) -> None:
    ledger = open_ledger(postgres_server.fresh_url(application_name="to-be-ended"))
    for n in range(5):
        ledger.run(f"before-{n}", lambda: None)
    ended = admin.execute(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE application_name = 'to-be-ended'"
    ).fetchone()
    assert ended and ended[0] >= 1
    time.sleep(0.2)  # the termination reaches the idle connections
    assert ledger.run("after", lambda: "fine") == "fine"


def test_a_pool_passed_in_is_used_and_left_open(
    postgres_server: PostgresServer, table: str
) -> None:
    with ConnectionPool(
        postgres_server.dsn(), min_size=1, max_size=2, kwargs={"autocommit": True}
    ) as pool:
        backend = PostgresCacheBackend(pool, table=table)
        assert Ledger(backend).run("k", lambda: "r") == "r"
        backend.close()
        with pool.connection() as conn:
            assert conn.execute(f'SELECT count(*) FROM "{table}"').fetchone() == (1,)


def test_a_backend_used_before_fork_opens_its_own_connections_in_the_child(
    open_ledger: Any, tmp_path: Path
) -> None:
    ledger = open_ledger()
    assert ledger.run("parent", lambda: "p") == "p"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            ok = ledger.run("child", lambda: "c") == "c" and ledger.get("parent") is not None
            code = 0 if ok else 2
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert ledger.run("child", lambda: "not again") == "c"  # the parent's pool still works
    assert ledger.run("parent-again", lambda: "p2") == "p2"


def test_a_role_without_access_to_the_table_gets_a_clear_error(
    postgres_server: PostgresServer, admin: psycopg.Connection[Any], table: str, open_ledger: Any
) -> None:
    open_ledger(postgres_server.url(table=table)).get("k")
    role = f"r_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE ROLE {role} LOGIN")
    url = postgres_server.url(table=table).replace("postgres@", f"{role}@")
    ran = []
    with pytest.raises(LedgerUnavailable, match="refused access"):
        open_ledger(url).run("k", lambda: ran.append(1))
    assert ran == []


def test_a_claim_blocked_past_the_statement_timeout_fails_closed(
    postgres_server: PostgresServer, table: str, open_ledger: Any
) -> None:
    ledger = open_ledger(postgres_server.url(table=table, statement_timeout_s=0.5))
    ledger.get("k")
    ran = []
    with psycopg.connect(postgres_server.dsn()) as blocker:  # holds the key, uncommitted
        blocker.execute(
            f'INSERT INTO "{table}" VALUES (%s, %s, 1, 1, 0, %s)', ("k", "PENDING", "{}")
        )
        with pytest.raises(LedgerUnavailable, match=r"statement_timeout_s=0\.5"):
            ledger.run("k", lambda: ran.append(1))
        blocker.rollback()
    assert ran == []


def test_a_corrupt_row_and_a_dropped_table_are_named(
    postgres_server: PostgresServer, admin: psycopg.Connection[Any], table: str, open_ledger: Any
) -> None:
    ledger = open_ledger(postgres_server.url(table=table))
    ledger.run("k", lambda: "r")
    admin.execute(f"UPDATE \"{table}\" SET doc = 'not json' WHERE key = 'k'")
    with pytest.raises(LedgerUnavailable, match="corrupt record"):
        ledger.run("k", lambda: "r")
    admin.execute(f'DROP TABLE "{table}"')
    with pytest.raises(LedgerUnavailable, match="has no ledger table"):
        ledger.run("k2", lambda: "r")


@pytest.mark.parametrize("on_ci", [False, True])
def test_missing_server_binaries_skip_locally_and_fail_on_ci(
    monkeypatch: pytest.MonkeyPatch, on_ci: bool
) -> None:
    import tests.servers as servers

    monkeypatch.setattr(servers, "postgres_bindir", lambda: None)
    monkeypatch.setattr(servers, "redis_binary", lambda: None)
    monkeypatch.setattr(servers, "ON_CI", on_ci)
    outcome = pytest.fail.Exception if on_ci else pytest.skip.Exception
    with pytest.raises(outcome, match="initdb, pg_ctl"):
        servers.start_postgres()
    with pytest.raises(outcome, match="redis-server not found"):
        servers.start_redis()


# -- URL options (issue 10): ours, libpq's, and nothing else -------------------------------


@pytest.mark.parametrize(
    ("query", "named"),
    [("statment_timeout_s=1", "statment_timeout_s"), ("sslmdoe=require", "sslmdoe"),
     ("prepare_threshold=0", "prepare_threshold")],
)  # fmt: skip
def test_an_unknown_url_option_is_refused_naming_it_and_the_known_ones(
    query: str, named: str
) -> None:
    from crewai_idempotent import LedgerConfigurationError

    url = f"postgresql://app:s3cret@127.0.0.1:1/db?table=t&{query}"
    with pytest.raises(LedgerConfigurationError) as refused:
        backend_from_url(url)
    message = str(refused.value)
    assert f"unknown PostgreSQL URL option {named!r}" in message
    # the known ones, ours and libpq's, so a typo can be corrected from the message
    assert "statement_timeout_s" in message and "sslmode" in message
    assert "s3cret" not in message


def test_url_options_that_would_be_overridden_or_are_given_twice_are_refused() -> None:
    from crewai_idempotent import LedgerConfigurationError

    with pytest.raises(LedgerConfigurationError, match=r"'connect_timeout'.*connect_timeout_s"):
        backend_from_url("postgresql://127.0.0.1:1/db?connect_timeout=3")
    with pytest.raises(LedgerConfigurationError, match="'table' is given twice"):
        backend_from_url("postgresql://127.0.0.1:1/db?table=a&table=b")
    with pytest.raises(LedgerConfigurationError, match=r"bad value.*max_size"):
        backend_from_url("postgresql://127.0.0.1:1/db?max_size=many")


def test_libpq_options_arrive_exactly_as_written(
    postgres_server: PostgresServer, open_ledger: Any
) -> None:
    # libpq decodes %20 to a space and keeps + as a plus: the URL must reach it unchanged.
    for written, arrives in (("my%20app", "my app"), ("a+b", "a+b"), ("x%2By", "x+y")):
        ledger = open_ledger(postgres_server.fresh_url(application_name=written))
        ledger.run("k", lambda: "r")
        backend = ledger.backend
        assert isinstance(backend, PostgresCacheBackend)
        seen = backend._call(
            "checking",
            lambda conn, _resent: conn.execute("SELECT current_setting('application_name')")
            .fetchone()[0],
            retry=False,
        )  # fmt: skip
        assert seen == arrives, written
