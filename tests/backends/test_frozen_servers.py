"""A server that stops answering: every PostgreSQL and Redis operation still ends, by the
backend's own bound, with LedgerUnavailable, and no guarded body runs unclaimed.

Two ways of not answering, both invisible to TCP: the server process is frozen (SIGSTOP;
its kernel still accepts connections and acknowledges what is sent), and a proxy on the
path stops forwarding (a network that drops packets). `statement_timeout`, keepalives
and TCP_USER_TIMEOUT cannot end a wait like that; only the client can.

What proves that the client ended it is the error: it names the limit that ran out
(`timeout_s`, `statement_timeout_s` or `connect_timeout_s`, each a second here), which the
backend says only when its own deadline passed. How long the call took is not asserted:
on a loaded machine the watchdog is late by however long it was not scheduled, which is
no fault of the code. A call that the bound failed to end is caught by the hang guard
(a minute, sixty of those limits), which is not a measurement.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import (
    CacheBackend,
    Ledger,
    LedgerUnavailable,
    OutcomeUncertain,
    backend_from_url,
)
from crewai_idempotent.ledger._record import Event, Owner, Record, Status
from tests.support.blackhole import BlackHoleProxy
from tests.support.faults.provider import Provider
from tests.support.servers import PostgresServer, RedisServer, discard, start_postgres, start_redis

# Every timeout of the backend is TIMEOUT_S. Each case waits out a few of these timeouts,
# so they are short; the live server answers well within them even on a loaded machine.
TIMEOUT_S = 1.0
BOUNDED = re.compile(r"(within|past) (timeout_s|statement_timeout_s|connect_timeout_s)=1\.0")


def _bounded(error: BaseException | None) -> bool:
    """A LedgerUnavailable saying which of the backend's limits ran out (its own clock)."""
    return isinstance(error, LedgerUnavailable) and BOUNDED.search(str(error)) is not None


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    """A server of this module's own: these tests freeze it."""
    server = start_postgres()
    yield server
    discard(server)


@pytest.fixture(scope="module")
def redis_() -> Iterator[RedisServer]:
    server = start_redis()
    yield server
    discard(server)


class Silence:
    """One way of making a server stop answering, and the URL that reaches it."""

    def __init__(
        self, url: str, on: Callable[[], None], off: Callable[[], None], close: Callable[[], None]
    ) -> None:
        self.url, self.on, self.off, self.close = url, on, off, close

    @contextmanager
    def active(self) -> Iterator[None]:
        self.on()
        try:
            yield
        finally:
            self.off()


def _nothing() -> None:
    pass


def _postgres_url(server: PostgresServer, port: int) -> str:
    url = server.fresh_url(
        timeout_s=TIMEOUT_S, connect_timeout_s=TIMEOUT_S, statement_timeout_s=TIMEOUT_S
    )
    return url.replace(f":{server.port}/", f":{port}/")


def _redis_url(server: RedisServer, port: int) -> str:
    url = server.fresh_url(timeout_s=TIMEOUT_S)
    return url.replace(f":{server.port}/", f":{port}/")


@pytest.fixture(params=["postgres-frozen", "postgres-blackhole", "redis-frozen", "redis-blackhole"])
def silence(request: pytest.FixtureRequest) -> Iterator[Silence]:
    kind, how = request.param.split("-")
    server: Any = request.getfixturevalue("postgres" if kind == "postgres" else "redis_")
    make_url = _postgres_url if kind == "postgres" else _redis_url
    if how == "frozen":
        silence = Silence(make_url(server, server.port), server.freeze, server.thaw, _nothing)
    else:
        proxy = BlackHoleProxy(server.port)
        silence = Silence(make_url(server, proxy.port), proxy.swallow, proxy.forward, proxy.close)
    try:
        yield silence
    finally:
        silence.off()
        silence.close()


def _pending(key: str, backend: CacheBackend) -> Record:
    now = backend.now()
    owner = Owner.current()
    return Record(
        key=key, status=Status.PENDING, fingerprint="f" * 64, token=1, revision=1,
        owner=owner, attempts=1, created_at=now, updated_at=now, lease_expires_at=now + 60,
        history=(Event(now, "claim", 1, owner.label),),
    )  # fmt: skip


def _committed(record: Record, backend: CacheBackend) -> Record:
    now = backend.now()
    return record.evolve(
        Event(now, "commit", record.token, "test"),
        status=Status.COMMITTED, updated_at=now, lease_expires_at=None,
    )  # fmt: skip


def _timed(call: Callable[[], Any], give_up_s: float = 60.0) -> tuple[float, BaseException | None]:
    """How long `call` took and what it raised. It runs on a thread of its own, so that a
    call that never ends fails the test after `give_up_s` instead of hanging the suite."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - the caller asserts on it
            outcome.append(exc)
        else:
            outcome.append(None)

    started = time.monotonic()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(give_up_s)
    elapsed = time.monotonic() - started
    assert outcome, f"the call was still blocked after {elapsed:.0f} s"
    return elapsed, outcome[0]


OPERATIONS = ["claim", "commit", "read"]


@pytest.mark.parametrize("operation", OPERATIONS)
def test_an_operation_on_a_silent_server_fails_closed_within_its_timeout(
    silence: Silence, operation: str
) -> None:
    backend = backend_from_url(silence.url)
    try:
        tag = uuid.uuid4().hex[:8]
        held = _pending(f"held-{tag}", backend)
        assert backend.insert(held) is None  # connected, migrated, clock read
        operations: dict[str, Callable[[int], Any]] = {
            "claim": lambda n: backend.insert(_pending(f"new-{tag}-{n}", backend)),
            "commit": lambda n: backend.replace(held, _committed(held, backend)),
            "read": lambda n: backend.get(held.key),
        }
        with silence.active():
            # The first call finds a pooled connection that was fine a moment ago; the
            # second must get a new one, from a server that accepts and never answers.
            for attempt in range(2):
                _elapsed, error = _timed(lambda n=attempt: operations[operation](n))
                assert _bounded(error), (attempt, error)
        # Answering again: the backend recovers by itself.
        deadline = time.monotonic() + 30
        while True:
            try:
                backend.get(held.key)
                break
            except LedgerUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        backend.close()


def test_a_guarded_call_on_a_silent_server_never_runs_its_body(
    silence: Silence, tmp_path: Path
) -> None:
    provider = Provider.create(tmp_path / "provider.jsonl")
    ledger = Ledger(backend_from_url(silence.url), lease_s=5.0, wait_s=0.0)
    try:
        assert ledger.run("warm-up", lambda: "ok") == "ok"
        with silence.active():
            for n in range(2):
                _elapsed, error = _timed(
                    lambda n=n: ledger.run(f"silent-{n}", lambda: provider.charge(f"silent-{n}"))
                )
                # The claim, then the ledger's look for a claim that may have landed anyway:
                # bounded operations, the last of which says which limit ran out.
                assert _bounded(error), error
        assert provider.counts() == {}
    finally:
        ledger.close()


def test_a_commit_on_a_silent_server_leaves_the_effect_once_and_the_record_unresolved(
    silence: Silence, tmp_path: Path
) -> None:
    """The body ran, the commit cannot be stored: the call ends in bounded time (with the
    receipt in hand, or LedgerUnavailable), the record stays PENDING, and once its lease
    lapses a retry is uncertain, never a second run."""
    provider = Provider.create(tmp_path / "provider.jsonl")
    ledger = Ledger(backend_from_url(silence.url), lease_s=1.0, commit_retry_s=0.5)
    try:
        assert ledger.run("warm-up", lambda: "ok") == "ok"

        def body() -> str:
            provider.charge("charged")
            silence.on()  # the server goes silent while the body runs
            return "receipt"

        try:
            _elapsed, error = _timed(lambda: ledger.run("charged", body))
        finally:
            silence.off()
        # commit_retry_s, then the attempt under way when it ran out: the receipt in hand
        # (the commit is left unrecorded), or the bound that ended the last attempt
        assert error is None or _bounded(error), error
        time.sleep(1.5)  # the lease lapses
        deadline = time.monotonic() + 30
        outcomes: list[Any] = []
        while True:
            _elapsed, error = _timed(
                lambda: outcomes.append(ledger.execute("charged", body, wait_s=5.0))
            )
            if not isinstance(error, LedgerUnavailable) or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # the backend is still reconnecting
        if error is None:
            # A frozen server read the commit from its socket buffer when it woke up: the
            # commit landed, and the retry replays it.
            assert outcomes[-1].replayed and outcomes[-1].value == "receipt"
        else:
            assert isinstance(error, OutcomeUncertain), error
        assert provider.counts() == {"charged": 1}
    finally:
        ledger.close()
