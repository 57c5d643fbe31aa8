"""What is particular to the server backends, PostgreSQL and Redis: what both do the same way
(the server clock, fork, refusing unknown URL options), then each one's own: PostgreSQL's
versioned schema, pool and errors; Redis's key layout, status indexes, persistence warnings
and errors. (The ledger's semantics are in the conformance suite, which both join through
conftest.)"""

from __future__ import annotations

import os
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis
from psycopg_pool import ConnectionPool
from redis.backoff import NoBackoff
from redis.retry import Retry

from crewai_idempotent import (
    Ledger,
    LedgerConfigurationError,
    LedgerUnavailable,
    Record,
    Status,
    backend_from_url,
)
from crewai_idempotent.backends.postgres import SCHEMA_VERSION, PostgresCacheBackend
from crewai_idempotent.backends.redis import (
    RedisCacheBackend,
    RedisDurabilityWarning,
    persistence_problem,
)
from tests.support.servers import PostgresServer, RedisServer, discard, start_redis


def _open_ledgers(default_url: Any) -> Iterator[Any]:
    opened: list[Ledger] = []

    def open_(url: str | None = None, **options: Any) -> Ledger:
        ledger = Ledger(backend_from_url(url or default_url()), **options)
        opened.append(ledger)
        return ledger

    yield open_
    for ledger in opened:
        ledger.close()


@pytest.fixture(params=["postgres", "redis"])
def server(request: pytest.FixtureRequest) -> PostgresServer | RedisServer:
    """The session's server of each kind."""
    return request.getfixturevalue(f"{request.param}_server")  # type: ignore[no-any-return]


@pytest.fixture
def open_ledger(server: PostgresServer | RedisServer) -> Iterator[Any]:
    yield from _open_ledgers(server.fresh_url)


def server_now(server: PostgresServer | RedisServer) -> float:
    """The server's own clock, asked directly."""
    if isinstance(server, PostgresServer):
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            row = conn.execute("SELECT extract(epoch from clock_timestamp())::float8").fetchone()
            assert row is not None
            return float(row[0])
    client = redis.Redis(port=server.port)
    try:
        seconds, micros = client.time()
    finally:
        client.close()
    return seconds + micros / 1e6


# -- both servers ----------------------------------------------------------------------------


def test_leases_are_measured_on_the_server_clock_not_the_host_clock(
    server: PostgresServer | RedisServer, open_ledger: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600.0)  # this host is an hour off
    ledger = open_ledger(lease_s=30.0)
    seen: list[Any] = []
    before = server_now(server)
    ledger.run("k", lambda: seen.append(ledger.get("k")))
    mine = ledger.backend.now()
    after = server_now(server)
    claim = seen[0]
    # Between two readings of the server's clock (however long apart a loaded machine
    # makes them), give or take the clock estimate's own error (half a round trip): an
    # hour from what this host's clock says.
    assert before - 1.0 <= claim.created_at <= after + 1.0
    assert abs(claim.lease_expires_at - (claim.created_at + 30.0)) < 1e-6
    assert before - 1.0 <= mine <= after + 1.0


def test_a_backend_used_before_fork_opens_its_own_connections_in_the_child(
    open_ledger: Any,
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


@pytest.mark.parametrize(
    ("url", "named", "known"),
    [("postgresql://app:s3cret@127.0.0.1:1/db?table=t&statment_timeout_s=1",
      "unknown PostgreSQL URL option 'statment_timeout_s'", ("statement_timeout_s", "sslmode")),
     ("postgresql://app:s3cret@127.0.0.1:1/db?table=t&sslmdoe=require",
      "unknown PostgreSQL URL option 'sslmdoe'", ("statement_timeout_s", "sslmode")),
     ("postgresql://app:s3cret@127.0.0.1:1/db?table=t&prepare_threshold=0",
      "unknown PostgreSQL URL option 'prepare_threshold'", ("statement_timeout_s", "sslmode")),
     ("redis://:s3cret@127.0.0.1:1/0?prefx=app:",
      "unknown Redis URL option 'prefx'", ("prefix", "client_name")),
     ("redis://:s3cret@127.0.0.1:1/0?client_nam=crew",
      "unknown Redis URL option 'client_nam'", ("prefix", "client_name")),
     ("redis://:s3cret@127.0.0.1:1/0?credential_provider=x",
      "unknown Redis URL option 'credential_provider'", ("prefix", "client_name"))],
)  # fmt: skip
def test_an_unknown_url_option_is_refused_naming_it_and_the_known_ones(
    url: str, named: str, known: tuple[str, ...]
) -> None:
    with pytest.raises(LedgerConfigurationError) as refused:
        backend_from_url(url)
    message = str(refused.value)
    assert named in message
    # the known ones, ours and the client library's, so a typo can be corrected from it
    assert all(option in message for option in known), message
    assert "s3cret" not in message


@pytest.mark.parametrize("on_ci", [False, True])
def test_missing_server_binaries_skip_locally_and_fail_on_ci(
    monkeypatch: pytest.MonkeyPatch, on_ci: bool
) -> None:
    import tests.support.servers as servers

    monkeypatch.setattr(servers, "postgres_bindir", lambda: None)
    monkeypatch.setattr(servers, "redis_binary", lambda: None)
    monkeypatch.setattr(servers, "ON_CI", on_ci)
    outcome = pytest.fail.Exception if on_ci else pytest.skip.Exception
    with pytest.raises(outcome, match="initdb, pg_ctl"):
        servers.start_postgres()
    with pytest.raises(outcome, match="redis-server not found"):
        servers.start_redis()


# -- PostgreSQL ------------------------------------------------------------------------------


@pytest.fixture
def admin(postgres_server: PostgresServer) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(postgres_server.dsn(), autocommit=True) as conn:
        yield conn


@pytest.fixture
def table() -> str:
    return f"ledger_{uuid.uuid4().hex[:16]}"


@pytest.fixture
def pg_ledger(postgres_server: PostgresServer) -> Iterator[Any]:
    yield from _open_ledgers(postgres_server.fresh_url)


def test_first_use_creates_the_table_and_records_its_schema_version(
    postgres_server: PostgresServer, admin: psycopg.Connection[Any], table: str, pg_ledger: Any
) -> None:
    ledger = pg_ledger(postgres_server.url(table=table))
    assert ledger.run("k", lambda: "r") == "r"
    version = admin.execute(
        "SELECT version FROM crewai_idempotency_schema WHERE table_name = %s", (table,)
    ).fetchone()
    assert version == (SCHEMA_VERSION,)
    rows = admin.execute(f'SELECT key, status, token, revision FROM "{table}"').fetchall()
    assert rows == [("k", "COMMITTED", 1, 2)]


def test_documents_are_scanned_by_their_index_under_a_linguistic_collation(
    postgres_server: PostgresServer, admin: psycopg.Connection[Any], table: str, pg_ledger: Any
) -> None:
    """Under a linguistic collation a range of the primary key is not a prefix (ICU puts
    'CREWAI-IDEMPOTENT/OUTBOX/b' between 'crewai-idempotent/outbox/' and
    'crewai-idempotent/outbox0'): the documents' scan compares bytes and reads the partial
    index of the documents, not the table."""
    collations = [
        row[0]
        for row in admin.execute(
            "SELECT collname FROM pg_collation WHERE collname IN ('en-x-icu', 'und-x-icu')"
        ).fetchall()
    ]
    if not collations:
        pytest.skip("this PostgreSQL has no ICU collation")
    ledger = pg_ledger(postgres_server.url(table=table))
    ledger.get("k")  # the table exists
    admin.execute(f'ALTER TABLE "{table}" ALTER COLUMN key TYPE text COLLATE "{collations[0]}"')
    backend = ledger.backend
    keys = [
        "crewai-idempotent/outbox/a", "crewai-idempotent/outbox/Zz", "crewaiidempotent0",
        "crewai-idempotent/outbox/\u00e9", "crewai-idempotent0", "CREWAI-IDEMPOTENT/OUTBOX/b",
    ]  # fmt: skip
    now = backend.now()
    for key in keys:
        record = Record(key, Status.COMMITTED, "fp", 1, 1, None, 1, now, now, result=1)
        assert backend.insert(record) is None
    found = [r.key for r in backend.scan_prefix("crewai-idempotent/outbox/")]
    assert found == sorted(k for k in keys if k.startswith("crewai-idempotent/outbox/"))
    admin.execute(f'ANALYZE "{table}"')
    admin.execute("SET enable_seqscan = off")  # a tiny table: make the planner show its choice
    plan = admin.execute(
        f"EXPLAIN SELECT doc FROM \"{table}\" WHERE key LIKE 'crewai-idempotent/%' "
        "AND key ~>=~ 'crewai-idempotent/outbox/' AND key ~<~ 'crewai-idempotent/outbox0'"
    ).fetchall()
    assert "_docs" in " ".join(row[0] for row in plan), plan


def test_a_table_migrated_by_a_newer_release_is_refused_and_nothing_runs(
    postgres_server: PostgresServer, admin: psycopg.Connection[Any], table: str, pg_ledger: Any
) -> None:
    url = postgres_server.url(table=table)
    pg_ledger(url).get("k")
    admin.execute(
        "UPDATE crewai_idempotency_schema SET version = 99 WHERE table_name = %s", (table,)
    )
    ran = []
    with pytest.raises(LedgerUnavailable, match=r"schema version 99.*newer crewai-idempotent"):
        pg_ledger(url).run("k", lambda: ran.append(1))
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
    postgres_server: PostgresServer, admin: psycopg.Connection[Any], table: str, pg_ledger: Any
) -> None:
    schema = f"s_{uuid.uuid4().hex[:8]}"
    pg_ledger(postgres_server.url(table=table, schema=schema)).run("k", lambda: "r")
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
    postgres_server: PostgresServer, table: str, pg_ledger: Any
) -> None:
    url = postgres_server.url(
        table=table, max_size=3, timeout_s=2.5, statement_timeout_s=1.5,
        application_name="billing-crew",
    )  # fmt: skip
    ledger = pg_ledger(url)
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


def test_the_server_clock_costs_no_round_trip_per_claim(
    pg_ledger: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = pg_ledger()
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
    postgres_server: PostgresServer, pg_ledger: Any
) -> None:
    ledger = pg_ledger(postgres_server.fresh_url(clock_refresh_s=0.2))
    ledger.run("warm-up", lambda: None)
    clock = ledger.backend._clock
    first = clock.reading
    time.sleep(0.3)
    ledger.run("k", lambda: None)
    assert clock.reading != first


def test_sessions_ended_by_an_admin_are_replaced_without_failing_a_call(
    postgres_server: PostgresServer, admin: psycopg.Connection[Any], pg_ledger: Any
) -> None:
    ledger = pg_ledger(postgres_server.fresh_url(application_name="to-be-ended"))
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


def test_a_role_without_access_to_the_table_gets_a_clear_error(
    postgres_server: PostgresServer, admin: psycopg.Connection[Any], table: str, pg_ledger: Any
) -> None:
    pg_ledger(postgres_server.url(table=table)).get("k")
    role = f"r_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE ROLE {role} LOGIN")
    url = postgres_server.url(table=table).replace("postgres@", f"{role}@")
    ran = []
    with pytest.raises(LedgerUnavailable, match="refused access"):
        pg_ledger(url).run("k", lambda: ran.append(1))
    assert ran == []


def test_a_claim_blocked_past_the_statement_timeout_fails_closed(
    postgres_server: PostgresServer, table: str, pg_ledger: Any
) -> None:
    ledger = pg_ledger(postgres_server.url(table=table, statement_timeout_s=0.5))
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
    postgres_server: PostgresServer, admin: psycopg.Connection[Any], table: str, pg_ledger: Any
) -> None:
    ledger = pg_ledger(postgres_server.url(table=table))
    ledger.run("k", lambda: "r")
    admin.execute(f"UPDATE \"{table}\" SET doc = 'not json' WHERE key = 'k'")
    with pytest.raises(LedgerUnavailable, match="corrupt record"):
        ledger.run("k", lambda: "r")
    admin.execute(f'DROP TABLE "{table}"')
    with pytest.raises(LedgerUnavailable, match="has no ledger table"):
        ledger.run("k2", lambda: "r")


# URL options: ours, libpq's, and nothing else.


def test_url_options_that_would_be_overridden_or_are_given_twice_are_refused() -> None:
    with pytest.raises(LedgerConfigurationError, match=r"'connect_timeout'.*connect_timeout_s"):
        backend_from_url("postgresql://127.0.0.1:1/db?connect_timeout=3")
    with pytest.raises(LedgerConfigurationError, match="'table' is given twice"):
        backend_from_url("postgresql://127.0.0.1:1/db?table=a&table=b")
    with pytest.raises(LedgerConfigurationError, match=r"bad value.*max_size"):
        backend_from_url("postgresql://127.0.0.1:1/db?max_size=many")


def test_libpq_options_arrive_exactly_as_written(
    postgres_server: PostgresServer, pg_ledger: Any
) -> None:
    # libpq decodes %20 to a space and keeps + as a plus: the URL must reach it unchanged.
    for written, arrives in (("my%20app", "my app"), ("a+b", "a+b"), ("x%2By", "x+y")):
        ledger = pg_ledger(postgres_server.fresh_url(application_name=written))
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


# -- Redis -----------------------------------------------------------------------------------


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=redis_server.port)
    yield client
    client.close()


@pytest.fixture
def redis_ledger(redis_server: RedisServer) -> Iterator[Any]:
    yield from _open_ledgers(redis_server.fresh_url)


@pytest.fixture(scope="module")
def bare_server() -> Iterator[RedisServer]:
    """A server that persists nothing, for the warnings and for breaking on purpose."""
    server = start_redis(appendonly=False, save="")
    yield server
    discard(server)


@pytest.mark.parametrize(
    ("config", "warned"),
    [
        ({"appendonly": "no", "save": ""}, "persistence is disabled"),
        ({"appendonly": "no", "save": "3600 1 300 100"}, "only RDB snapshots"),
        ({"appendonly": "yes", "save": "", "appendfsync": "everysec"}, None),
        ({"appendonly": "yes", "save": "3600 1", "appendfsync": "always"}, None),
    ],
)
def test_persistence_settings_that_lose_acknowledged_claims_are_named(
    config: dict[str, str], warned: str | None
) -> None:
    problem = persistence_problem(config)
    assert (problem is None) if warned is None else (problem and warned in problem)


def test_a_server_without_persistence_gets_a_warning_once(bare_server: RedisServer) -> None:
    backend = backend_from_url(bare_server.fresh_url())
    try:
        with pytest.warns(RedisDurabilityWarning, match=r"persistence is disabled.*appendonly yes"):
            backend.get("k")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            backend.get("k")  # once per backend, not per call
    finally:
        backend.close()
    quiet = backend_from_url(bare_server.fresh_url(check_persistence="false"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            quiet.get("k")
    finally:
        quiet.close()


def test_a_server_with_an_append_only_file_gets_no_warning(redis_server: RedisServer) -> None:
    backend = backend_from_url(redis_server.fresh_url())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            backend.get("k")
    finally:
        backend.close()


def test_each_record_is_one_hash_indexed_by_status_and_purge_leaves_nothing(
    redis_server: RedisServer, client: redis.Redis, redis_ledger: Any
) -> None:
    prefix = f"p{uuid.uuid4().hex[:8]}:"
    ledger = redis_ledger(redis_server.url(prefix=prefix))
    ledger.run("done", lambda: "r")
    with pytest.raises(ZeroDivisionError):
        ledger.run("broken", lambda: 1 / 0)
    keys = sorted(k.decode() for k in client.scan_iter(f"{prefix}*"))
    # Beside the records and their status indexes, the ledger's change counter and the
    # mark that its listing indexes are complete (a new ledger is complete from its start).
    assert keys == [f"{prefix}i:COMMITTED", f"{prefix}i:FAILED", f"{prefix}r:broken",
                    f"{prefix}r:done", f"{prefix}x:changes", f"{prefix}x:ready"]  # fmt: skip
    assert client.hget(f"{prefix}r:done", "status") == b"COMMITTED"
    assert [r.key for r in ledger.records(Status.FAILED)] == ["broken"]
    assert ledger.run("broken", lambda: "fixed") == "fixed"  # FAILED -> claimed -> COMMITTED
    assert client.zrange(f"{prefix}i:FAILED", 0, -1) == []
    assert sorted(client.zrange(f"{prefix}i:COMMITTED", 0, -1)) == [b"broken", b"done"]
    assert ledger.purge(expired_only=False) == 2
    assert sorted(k.decode() for k in client.scan_iter(f"{prefix}*")) == [
        f"{prefix}x:changes", f"{prefix}x:ready"
    ]  # fmt: skip


def test_prefixes_keep_ledgers_apart_on_one_server(
    redis_server: RedisServer, redis_ledger: Any
) -> None:
    first = redis_ledger(redis_server.fresh_url())
    second = redis_ledger(redis_server.fresh_url())
    assert first.run("k", lambda: "first") == "first"
    assert second.run("k", lambda: "second") == "second"
    assert [r.key for r in second.records()] == ["k"]


def test_url_options_are_ours_and_the_rest_go_to_redis_py(redis_server: RedisServer) -> None:
    backend = backend_from_url(
        redis_server.url(prefix="app:", timeout_s=2.5, retries=1, client_name="billing-crew")
    )
    try:
        assert isinstance(backend, RedisCacheBackend)
        assert (backend.prefix, backend.timeout_s, backend.retries) == ("app:", 2.5, 1)
        backend.get("k")
        assert backend.client.client_getname() == "billing-crew"
    finally:
        backend.close()
    with pytest.raises(ValueError, match="timeout_s"):
        backend_from_url(redis_server.url(timeout_s="soon"))


def test_a_flushed_script_cache_is_reloaded(redis_ledger: Any, client: redis.Redis) -> None:
    ledger = redis_ledger()
    assert ledger.run("before", lambda: "r") == "r"
    client.script_flush()
    assert ledger.run("after", lambda: "r2") == "r2"


def test_a_client_passed_in_is_used_and_left_open(redis_server: RedisServer) -> None:
    client = redis.Redis(port=redis_server.port, retry=Retry(NoBackoff(), 0))
    backend = RedisCacheBackend(client, prefix=f"p{uuid.uuid4().hex[:8]}:")
    assert Ledger(backend).run("k", lambda: "r") == "r"
    backend.close()
    assert client.ping()
    client.close()


def test_wrong_credentials_are_named_and_nothing_runs() -> None:
    server = start_redis(extra=("--requirepass", "s3cret"))
    try:
        ran: list[int] = []
        ledger = Ledger(backend_from_url(f"redis://:wrong@127.0.0.1:{server.port}/0"))
        with pytest.raises(LedgerUnavailable, match="refused our credentials"):
            ledger.run("k", lambda: ran.append(1))
        ledger.close()
        ledger = Ledger(backend_from_url(f"redis://:s3cret@127.0.0.1:{server.port}/0"))
        assert ledger.run("k", lambda: "r") == "r"
        ledger.close()
        assert ran == []
    finally:
        discard(server)


def test_a_read_only_replica_and_a_full_server_are_named_and_nothing_runs(
    bare_server: RedisServer,
) -> None:
    replica = start_redis(extra=("--replicaof", "127.0.0.1", str(bare_server.port)))
    admin = redis.Redis(port=bare_server.port)
    ran: list[int] = []
    try:
        ledger = Ledger(backend_from_url(replica.fresh_url(check_persistence="false")))
        with pytest.raises(LedgerUnavailable, match="read-only replica"):
            ledger.run("k", lambda: ran.append(1))
        ledger.close()
        admin.config_set("maxmemory", "1")
        ledger = Ledger(backend_from_url(bare_server.fresh_url(check_persistence="false")))
        with pytest.raises(LedgerUnavailable, match="out of memory"):
            ledger.run("k", lambda: ran.append(1))
        ledger.close()
    finally:
        admin.config_set("maxmemory", "0")
        admin.close()
        discard(replica)
    assert ran == []


# URL options: ours, redis-py's, and nothing else.


@pytest.mark.parametrize(
    ("query", "why"),
    [("socket_timeout=100", "timeout_s"), ("retry_on_timeout=yes", "timeout_s"),
     ("decode_responses=true", "decodes replies"), ("password=x", "in the URL itself"),
     ("check_persistence=flase", "bad value"), ("prefix=a&prefix=b", "given twice")],
)  # fmt: skip
def test_url_options_that_would_undo_the_bounds_or_are_malformed_are_refused(
    query: str, why: str
) -> None:
    with pytest.raises(LedgerConfigurationError, match=why):
        backend_from_url(f"redis://127.0.0.1:1/0?{query}")


def test_redis_py_options_arrive_as_written(redis_server: RedisServer) -> None:
    backend = backend_from_url(redis_server.fresh_url(client_name="crew%2Done", protocol=3))
    try:
        assert isinstance(backend, RedisCacheBackend)
        assert Ledger(backend).run("k", lambda: "r") == "r"
        assert backend.client.client_getname() in ("crew-one", b"crew-one")
        assert Ledger(backend).run("k", lambda: "again") == "r"  # RESP3 replies replay too
    finally:
        backend.close()
