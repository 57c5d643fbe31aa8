"""What is particular to the Redis backend: its key layout and status indexes, the warnings
about the server's persistence, the server clock, and the specific errors it gives. (The
ledger's semantics are in the conformance suite, which this backend joins through
conftest.)"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from crewai_idempotent import Ledger, LedgerUnavailable, Status, backend_from_url
from crewai_idempotent.backends.redis import (
    RedisCacheBackend,
    RedisDurabilityWarning,
    persistence_problem,
)
from tests.servers import RedisServer, discard, start_redis


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=redis_server.port)
    yield client
    client.close()


@pytest.fixture
def open_ledger(redis_server: RedisServer) -> Iterator[Any]:
    opened: list[Ledger] = []

    def open_(url: str | None = None, **options: Any) -> Ledger:
        ledger = Ledger(backend_from_url(url or redis_server.fresh_url()), **options)
        opened.append(ledger)
        return ledger

    yield open_
    for ledger in opened:
        ledger.close()


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
    redis_server: RedisServer, client: redis.Redis, open_ledger: Any
) -> None:
    prefix = f"p{uuid.uuid4().hex[:8]}:"
    ledger = open_ledger(redis_server.url(prefix=prefix))
    ledger.run("done", lambda: "r")
    with pytest.raises(ZeroDivisionError):
        ledger.run("broken", lambda: 1 / 0)
    keys = sorted(k.decode() for k in client.scan_iter(f"{prefix}*"))
    assert keys == [f"{prefix}i:COMMITTED", f"{prefix}i:FAILED", f"{prefix}r:broken",
                    f"{prefix}r:done"]  # fmt: skip
    assert client.hget(f"{prefix}r:done", "status") == b"COMMITTED"
    assert [r.key for r in ledger.records(Status.FAILED)] == ["broken"]
    assert ledger.run("broken", lambda: "fixed") == "fixed"  # FAILED -> claimed -> COMMITTED
    assert client.zrange(f"{prefix}i:FAILED", 0, -1) == []
    assert sorted(client.zrange(f"{prefix}i:COMMITTED", 0, -1)) == [b"broken", b"done"]
    assert ledger.purge(expired_only=False) == 2
    assert list(client.scan_iter(f"{prefix}*")) == []


def test_prefixes_keep_ledgers_apart_on_one_server(
    redis_server: RedisServer, open_ledger: Any
) -> None:
    first = open_ledger(redis_server.fresh_url())
    second = open_ledger(redis_server.fresh_url())
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


def test_leases_are_measured_on_the_server_clock_not_the_host_clock(
    open_ledger: Any, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600.0)  # this host is an hour off
    ledger = open_ledger(lease_s=30.0)
    seen: list[Any] = []
    ledger.run("k", lambda: seen.append(ledger.get("k")))
    seconds, micros = client.time()
    server_now = seconds + micros / 1e6
    claim = seen[0]
    assert abs(claim.created_at - server_now) < 2.0
    assert abs(claim.lease_expires_at - (claim.created_at + 30.0)) < 1e-6
    assert abs(ledger.backend.now() - server_now) < 2.0


def test_a_flushed_script_cache_is_reloaded(open_ledger: Any, client: redis.Redis) -> None:
    ledger = open_ledger()
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


def test_a_backend_used_before_fork_works_in_the_child(open_ledger: Any) -> None:
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
    assert ledger.run("child", lambda: "not again") == "c"
    assert ledger.run("parent-again", lambda: "p2") == "p2"


# -- URL options (issue 10): ours, redis-py's, and nothing else ----------------------------


@pytest.mark.parametrize(
    ("query", "named"),
    [("prefx=app:", "prefx"), ("client_nam=crew", "client_nam"),
     ("credential_provider=x", "credential_provider")],
)  # fmt: skip
def test_an_unknown_url_option_is_refused_naming_it_and_the_known_ones(
    query: str, named: str
) -> None:
    from crewai_idempotent import LedgerConfigurationError

    url = f"redis://:s3cret@127.0.0.1:1/0?{query}"
    with pytest.raises(LedgerConfigurationError) as refused:
        backend_from_url(url)
    message = str(refused.value)
    assert f"unknown Redis URL option {named!r}" in message
    assert "prefix" in message and "client_name" in message
    assert "s3cret" not in message


@pytest.mark.parametrize(
    ("query", "why"),
    [("socket_timeout=100", "timeout_s"), ("retry_on_timeout=yes", "timeout_s"),
     ("decode_responses=true", "decodes replies"), ("password=x", "in the URL itself"),
     ("check_persistence=flase", "bad value"), ("prefix=a&prefix=b", "given twice")],
)  # fmt: skip
def test_url_options_that_would_undo_the_bounds_or_are_malformed_are_refused(
    query: str, why: str
) -> None:
    from crewai_idempotent import LedgerConfigurationError

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
