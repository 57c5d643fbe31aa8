"""fork() with the server backends (PostgreSQL, Redis): real processes, effects counted at a
fake provider.

The scenarios are the local backends' (tests/support/fork.py, run for every backend in
tests/process/test_fork_scenarios.py): a parent that used the ledger forks a worker that uses the
inherited object or a new one, the parent closes or exits while the worker runs, and a
fork pool of 4 plus 2 fresh processes share 150 keys. Here is what is particular to a
server connection: a child must never use or close the parent's connections (closing one
sends Terminate on the parent's socket, and a watchdog that cuts a late connection must
not cut one the parent is using), and a child must not hang on the pool's worker
threads, which it does not have.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import Ledger, backend_from_url
from tests.support.faults.provider import Provider
from tests.support.fork import ROOT, duplicates

SERVERS = ["postgres", "redis"]


@pytest.fixture(params=SERVERS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider.create(tmp_path / "effects.jsonl")


# -- the parent's connections stay the parent's -------------------------------------------

# A parent in an interpreter of its own, so that its forked child can exit the ordinary way
# (sys.exit: finalizers and garbage collection run) instead of os._exit. The parent has a
# statement in flight on another thread when it forks, and its connection's identity is
# taken before the fork and after the child has gone: the same connection must still serve.
_PARENT = textwrap.dedent(
    """
    import json, os, sys, threading, time
    from crewai_idempotent import Ledger, backend_from_url
    from tests.support.faults.provider import Provider

    kind, url, provider_path, mode = sys.argv[1:5]
    provider = Provider(provider_path)
    backend = backend_from_url(url)
    ledger = Ledger(backend)
    ledger.run("parent-before", lambda: provider.charge("parent-before"))

    if kind == "postgres":
        def session(sleep_s):
            return backend._call(
                "asking who we are",
                lambda conn, _resent: conn.execute(
                    "SELECT pg_backend_pid(), pg_sleep(%s)", (sleep_s,)
                ).fetchone()[0],
                retry=False,
            )
    else:
        def session(sleep_s):
            if sleep_s:
                # A command in flight at fork() time: the server answers after sleep_s.
                backend._call("waiting", lambda _: backend.client.blpop(
                    ["crewai-idempotent-test:nothing"], timeout=sleep_s), retry=False)
            return backend._call("asking who we are", lambda _: backend.client.client_id())

    before = session(0)
    in_flight = {}
    worker = threading.Thread(target=lambda: in_flight.update(who=session(1.5)))
    worker.start()
    time.sleep(0.3)  # the statement is running on the server when the child is forked

    pid = os.fork()
    if pid == 0:
        child = ledger if mode == "inherited" else Ledger(backend_from_url(url))
        for n in range(20):
            child.run(f"child-{n}", lambda n=n: provider.charge(f"child-{n}"))
        time.sleep(2.5)  # past the parent's statement deadline, with the child's ledger armed
        child.run("child-late", lambda: provider.charge("child-late"))
        sys.exit(0)  # an ordinary exit: whatever the child inherited is collected now

    _, status = os.waitpid(pid, 0)
    worker.join()
    after = session(0)
    ledger.run("parent-after", lambda: provider.charge("parent-after"))
    ledger.close()
    print(json.dumps({
        "child_exit": os.waitstatus_to_exitcode(status),
        "before": before, "in_flight": in_flight.get("who"), "after": after,
    }))
    """
)


@pytest.mark.parametrize("child", ["inherited", "new"])
def test_a_child_never_uses_or_ends_the_parents_connections(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, provider: Provider, child: str
) -> None:
    server: Any = request.getfixturevalue(f"{kind}_server")
    # Statement deadline 2 s: passed while the child lives, long after the parent's
    # in-flight statement finished on the connection the parent then keeps using.
    options = {"statement_timeout_s": 2} if kind == "postgres" else {"timeout_s": 2}
    url = server.fresh_url(**options)
    done = subprocess.run(
        [sys.executable, "-c", _PARENT, kind, url, str(provider.path), child],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["child_exit"] == 0, done.stderr
    # The connection that served before the fork, the statement in flight during it, and
    # the call after the child exited are one and the same session.
    assert report["before"] == report["in_flight"] == report["after"], report
    keys = [e["key"] for e in provider.effects()]
    assert sorted(keys) == sorted(
        ["parent-before", *(f"child-{n}" for n in range(20)), "child-late", "parent-after"]
    )
    assert duplicates(provider) == {}


def test_a_child_with_an_inherited_pool_neither_hangs_nor_ends_the_parents_pool(
    request: pytest.FixtureRequest, tmp_path: Path, provider: Provider
) -> None:
    """psycopg_pool's worker threads do not exist in a child; nothing the child does with
    the inherited backend, including closing it, may wait for them or end the sessions of
    the parent's pool (closing a connection sends Terminate on the shared socket)."""
    import psycopg

    server: Any = request.getfixturevalue("postgres_server")
    name = f"fork-{uuid.uuid4().hex[:12]}"
    url = server.fresh_url(min_size=4, max_size=8, application_name=name)

    def sessions() -> set[int]:
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            rows = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (name,)
            ).fetchall()
        return {row[0] for row in rows}

    ledger = Ledger(backend_from_url(url))
    try:
        ledger.run("warm-up", lambda: provider.charge("warm-up"))
        deadline = time.monotonic() + 30
        while len(parents := sessions()) < 4:  # the pool grows to min_size in the background
            assert time.monotonic() < deadline, parents
            time.sleep(0.05)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                ledger.run("in-child", lambda: provider.charge("in-child"))
                ledger.close()  # closes the child's own pool, never the parent's
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # every call it made is bounded
        deadline = time.monotonic() + 10
        while (now := sessions()) != parents:  # the child's own sessions end with it
            assert time.monotonic() < deadline, (parents, now)
            time.sleep(0.05)
        assert ledger.run("in-child", lambda: "not again") != "not again"
        assert ledger.run("parent-after", lambda: provider.charge("parent-after"))
    finally:
        ledger.close()
    assert [e["key"] for e in provider.effects()] == ["warm-up", "in-child", "parent-after"]


def test_a_redis_client_passed_in_is_reset_by_redis_py_in_the_child(
    request: pytest.FixtureRequest, provider: Provider
) -> None:
    """A client we do not own cannot be replaced after fork(); redis-py resets its pool in
    the child itself (it compares the pid on every checkout). Checked, not trusted: the
    child works through the inherited ledger, drops and collects what it inherited, and
    the parent's connection is the same one afterwards."""
    import gc

    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from crewai_idempotent.backends.redis import RedisCacheBackend

    server: Any = request.getfixturevalue("redis_server")
    client = redis.Redis.from_url(server.url(), retry=Retry(NoBackoff(), 0))
    ledger = Ledger(RedisCacheBackend(client, prefix=f"t{uuid.uuid4().hex[:12]}:"))
    try:
        ledger.run("parent-before", lambda: provider.charge("parent-before"))
        before = client.client_id()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                for n in range(10):
                    ledger.run(f"child-{n}", lambda n=n: provider.charge(f"child-{n}"))
                mine = client.client_id()
                client.connection_pool.disconnect()  # the child's own connections only
                gc.collect()
                code = 0 if mine != before else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert client.client_id() == before
        ledger.run("parent-after", lambda: provider.charge("parent-after"))
    finally:
        ledger.close()
        client.close()
    keys = sorted(e["key"] for e in provider.effects())
    assert keys == sorted(["parent-before", *(f"child-{n}" for n in range(10)), "parent-after"])
