"""Faults around a real PostgreSQL or Redis: workers killed at every point of a guarded call,
the server restarted (cleanly and by a crash) under a run of calls, connections cut around
the claim and the commit, and the server gone. Every case runs on both servers; the facts
that differ (how a crash is made, what a claim looks like on the wire) are in `Target`."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from crewai_idempotent import (
    Ledger,
    LedgerUnavailable,
    OutcomeUncertain,
    Status,
    backend_from_url,
)
from crewai_idempotent.backends.redis._scripts import CLAIM, REPLACE
from tests.support.faults.matrix import CELLS, assert_batch_killed, assert_cell, runs_per_cell
from tests.support.faults.provider import Provider
from tests.support.servers import (
    CuttingProxy,
    PostgresServer,
    RedisServer,
    discard,
    free_port,
    start_postgres,
    start_redis,
)

# Each round kills one worker holding COPIES keys of every cell: ROUNDS x COPIES runs a cell.
ROUNDS = int(os.environ.get("CREWAI_IDEMPOTENT_KILL_ROUNDS", "5"))
COPIES = int(os.environ.get("CREWAI_IDEMPOTENT_KILL_COPIES", "4"))
# The recovery matrix (one worker per run, operator resolution afterwards): MATRIX_RUNS per
# cell on top of the batches above, its own count with its soak switches.
MATRIX_RUNS = (
    runs_per_cell()
    if os.environ.get("CREWAI_IDEMPOTENT_FAULT_RUNS") or os.environ.get("CREWAI_IDEMPOTENT_SOAK")
    else 5
)


def _sha(script: str) -> bytes:
    return hashlib.sha1(script.encode()).hexdigest().encode()


@dataclass
class Target:
    """A server of one kind and what the tests need to know about it."""

    kind: str
    server: PostgresServer | RedisServer
    claim: bytes  # bytes only the claim sends on the wire
    commit: bytes  # bytes only the commit sends
    stops: dict[str, Callable[[], None]]  # a clean stop, and a crash

    def fresh_url(self, **options: object) -> str:
        return self.server.fresh_url(**options)


def _postgres() -> Target:
    server = start_postgres()
    return Target(
        "postgres", server, b"WITH claimed AS (INSERT", b"UPDATE ",
        # "immediate" is a crash: the server recovers from its WAL
        {"clean": lambda: server.stop("fast"), "crash": lambda: server.stop("immediate")},
    )  # fmt: skip


def _redis() -> Target:
    # AOF with appendfsync everysec: a killed redis-server loses nothing it acknowledged
    # (only the machine crashing could lose the last second).
    server = start_redis(appendonly=True, appendfsync="everysec")
    return Target(
        "redis", server, _sha(CLAIM), _sha(REPLACE),
        # SIGTERM flushes the AOF; SIGKILL is a crash
        {"clean": server.stop, "crash": server.kill},
    )  # fmt: skip


@pytest.fixture(scope="module", params=["postgres", "redis"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    """A server of this module's own: these tests stop and restart it."""
    made = {"postgres": _postgres, "redis": _redis}[request.param]()
    yield made
    discard(made.server)


@pytest.fixture
def proxy(target: Target) -> Iterator[CuttingProxy]:
    proxy = CuttingProxy(target.server.port)
    yield proxy
    proxy.close()


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider.create(tmp_path / "provider.jsonl")


def charging(provider: Provider, key: str, value: str = "r") -> Callable[[], str]:
    """A body that charges `key` at the provider and returns `value`."""

    def body() -> str:
        provider.charge(key)
        return value

    return body


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "reconciler"),
    CELLS,
    ids=[f"{point}-{'reconciler' if reconciler else 'bare'}" for point, reconciler in CELLS],
)
def test_the_fault_matrix_cell(
    target: Target, point: str, reconciler: bool, tmp_path: Path
) -> None:
    assert_cell(target.fresh_url(), point, reconciler, tmp_path / "cell", runs=MATRIX_RUNS)


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_worker_killed_at_any_point_never_causes_a_second_effect(
    target: Target, tmp_path: Path, round_: int
) -> None:
    assert_batch_killed(target.fresh_url(), tmp_path / "batch", copies=COPIES)


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["clean", "crash"])
def test_a_server_restart_under_load_fails_calls_closed_and_then_serves_again(
    target: Target, provider: Provider, stop: str
) -> None:
    run_through_restart(
        target.fresh_url(timeout_s=1),
        provider,
        target.stops[stop],
        target.server.start,
        # longer than a call waits for a connection (PostgreSQL's timeout_s) or keeps
        # resending (Redis)
        down_s=2.5 if target.kind == "postgres" else 1.5,
    )


def test_a_claim_cut_on_the_wire_fails_closed_or_is_recognised_when_resent(
    target: Target, proxy: CuttingProxy, provider: Provider
) -> None:
    port = target.server.port
    url = target.fresh_url(timeout_s=2).replace(f":{port}/", f":{proxy.port}/")
    ledger = Ledger(backend_from_url(url))
    direct = Ledger(backend_from_url(url.replace(f":{proxy.port}/", f":{port}/")))
    try:
        assert ledger.run("warm-up", lambda: "warm") == "warm"  # connected; scripts loaded

        proxy.arm(target.claim, when="before", times=100)
        with pytest.raises(LedgerUnavailable) as failure:
            ledger.run("cut-before", charging(provider, "cut-before"))
        assert "cut-before" in str(failure.value)
        assert direct.get("cut-before") is None
        assert provider.counts() == {}

        proxy.arm(target.claim, when="after", times=1)
        assert ledger.run("cut-after", charging(provider, "cut-after")) == "r"
        assert proxy.cut == 1
        record = direct.get("cut-after")
        assert record is not None and record.status is Status.COMMITTED
        assert [e.kind for e in record.history] == ["claim", "commit"]
        assert provider.counts() == {"cut-after": 1}
    finally:
        ledger.close()
        direct.close()


def test_a_commit_cut_on_the_wire_is_recognised_when_resent_or_left_uncertain(
    target: Target, proxy: CuttingProxy, provider: Provider
) -> None:
    """A commit whose reply was lost is recognised when resent; a commit that never gets
    through leaves the record to the lease rules (uncertain), never to a blind re-run."""
    port = target.server.port
    url = target.fresh_url(timeout_s=2).replace(f":{port}/", f":{proxy.port}/")
    ledger = Ledger(backend_from_url(url), lease_s=1.0, commit_retry_s=0.5)
    direct = Ledger(backend_from_url(url.replace(f":{proxy.port}/", f":{port}/")))
    try:
        assert ledger.run("warm-up", lambda: "warm") == "warm"

        proxy.arm(target.commit, when="after", times=1)
        assert ledger.run("landed", charging(provider, "landed")) == "r"
        assert proxy.cut == 1
        record = direct.get("landed")
        assert record is not None and record.status is Status.COMMITTED
        assert not record.needs_operator

        proxy.arm(target.commit, when="before", times=10**6)
        # The receipt is in hand, so the caller may get it; the record cannot say so.
        with contextlib.suppress(LedgerUnavailable):
            assert ledger.run("lost", charging(provider, "lost")) == "r"
        proxy.arm(b"", times=0)
        record = direct.get("lost")
        assert record is not None and record.status is Status.PENDING
        with pytest.raises(OutcomeUncertain):
            direct.run("lost", charging(provider, "lost", "again"), wait_s=10.0)
        record = direct.get("lost")
        assert record is not None and record.status is Status.UNCERTAIN
        assert provider.counts() == {"landed": 1, "lost": 1}
    finally:
        ledger.close()
        direct.close()


@pytest.mark.parametrize("kind", ["postgres", "redis"])
def test_no_server_means_no_run(kind: str, provider: Provider) -> None:
    port = free_port()  # nothing listens there
    url, says = {
        "postgres": (f"postgresql://postgres@127.0.0.1:{port}/postgres?timeout_s=0.5",
                     r"cannot reach PostgreSQL.*refused"),
        "redis": (f"redis://127.0.0.1:{port}/0?timeout_s=0.5", r"cannot be reached.*refused"),
    }[kind]  # fmt: skip
    ledger = Ledger(backend_from_url(url))
    try:
        with pytest.raises(LedgerUnavailable, match=says):
            ledger.run("k", charging(provider, "k"))
        assert provider.counts() == {}
    finally:
        ledger.close()


def test_a_server_stopped_between_calls_fails_the_next_claim_closed(
    target: Target, provider: Provider, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crewai_idempotent.notifications import Outbox, _incidents

    monkeypatch.setattr(_incidents, "_PROBE_S", 0.05)  # look at the ledger often
    ledger = Ledger(backend_from_url(target.fresh_url(timeout_s=1)))
    # PostgreSQL: a pooled connection first, then direct attempts.
    attempts = 3 if target.kind == "postgres" else 1
    try:
        assert ledger.run("before", lambda: "r") == "r"
        target.stops["clean"]()
        try:
            for attempt in range(attempts):
                with pytest.raises(LedgerUnavailable):
                    ledger.run(f"down-{attempt}", charging(provider, f"down-{attempt}"))
        finally:
            target.server.start()
        assert ledger.run("after", lambda: "back") == "back"
        assert ledger.run("down-0", lambda: "ran now") == "ran now"  # nothing was claimed
        assert ledger.run("before", lambda: "again") == "r"  # the restart kept the receipt
        # The outage is said once the ledger can hold it: one entry for a person.
        deadline = time.monotonic() + 60
        while not (said := Outbox(ledger.backend).entries()):
            assert time.monotonic() < deadline, "the outage never reached the outbox"
            time.sleep(0.05)
        (entry,) = said
        assert entry.type == "ledger.unavailable" and entry.data["count"] >= attempts
        assert entry.data["process"] == os.getpid() and entry.data["error"]
    finally:
        ledger.close()
    assert provider.counts() == {}


def run_through_restart(
    url: str, provider: Provider, stop: Callable[[], None], start: Callable[[], None], *,
    down_s: float, threads: int = 4, before: int = 30, after: int = 30,
) -> dict[str, str]:  # fmt: skip
    """Guarded calls on fresh keys from `threads` threads; once `before` have succeeded,
    `stop()` the server, keep it down for `down_s` (a guarded call made meanwhile must
    fail closed), `start()` it; go on until `after` more succeed. Every call must either
    complete or raise LedgerUnavailable, and no key may have two effects. Then every key
    that failed is retried from another ledger: still never a second effect. Returns
    key -> outcome."""
    ledger = Ledger(backend_from_url(url), lease_s=2.0, wait_s=1.0)
    tag = uuid.uuid4().hex[:8]
    outcomes: dict[str, str] = {}
    lock = threading.Lock()
    enough_before, restarted = threading.Event(), threading.Event()
    succeeded_after = 0
    deadline = time.monotonic() + 120

    def calls(n: int) -> None:
        nonlocal succeeded_after
        for i in range(10**6):
            key = f"restart-{tag}-{n}-{i}"
            try:
                value = ledger.run(key, charging(provider, key, f"receipt:{key}"))
                outcome = "ok" if value == f"receipt:{key}" else f"wrong receipt {value!r}"
            except LedgerUnavailable:
                outcome = "unavailable"
            except Exception as exc:  # noqa: BLE001 - the assertion below names it
                outcome = f"{type(exc).__name__}: {exc}"
            with lock:
                outcomes[key] = outcome
                if outcome == "ok" and restarted.is_set():
                    succeeded_after += 1
                if sum(o == "ok" for o in outcomes.values()) >= before:
                    enough_before.set()
                if succeeded_after >= after or time.monotonic() > deadline:
                    return

    workers = [threading.Thread(target=calls, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    try:
        assert enough_before.wait(60), f"calls did not succeed before the restart: {outcomes}"
        stop()
        down_since = time.monotonic()
        with pytest.raises(LedgerUnavailable):
            ledger.run(f"restart-{tag}-while-down", charging(provider, "while-down"))
        # Down for down_s on purpose: calls made meanwhile must fail closed, not wait it out.
        time.sleep(max(0.0, down_s - (time.monotonic() - down_since)))
        start()
        restarted.set()
    finally:
        for worker in workers:
            worker.join()
        ledger.close()
    strange = {key: o for key, o in outcomes.items() if o not in ("ok", "unavailable")}
    assert not strange, f"calls neither completed nor raised LedgerUnavailable: {strange}"
    assert succeeded_after >= after, "calls did not succeed again after the restart"
    counts = provider.counts()
    assert max(counts.values(), default=0) <= 1, "a key ran twice"
    assert all(counts.get(key) == 1 for key, o in outcomes.items() if o == "ok")

    # The failed keys, retried once the lease of any claim that landed has lapsed: run
    # once, replayed, or uncertain (a claim landed and nobody knows more), never twice.
    retry = Ledger(backend_from_url(url), wait_s=10.0, lease_s=2.0)
    try:
        for key, outcome in outcomes.items():
            if outcome != "unavailable":
                continue
            with contextlib.suppress(OutcomeUncertain):
                retry.run(key, charging(provider, key, f"receipt:{key}"))
    finally:
        retry.close()
    assert max(provider.counts().values(), default=0) <= 1, "a retry ran a key twice"
    return outcomes
