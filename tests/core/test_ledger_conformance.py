"""Every backend, every transition of the guard. A later backend joins by adding a fixture."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest

from crewai_idempotent import (
    Absent,
    CacheBackend,
    Found,
    IdempotencyConfig,
    IdempotencyKeyConflict,
    InMemoryCacheBackend,
    InvalidIdempotencyKey,
    Ledger,
    OperationInProgress,
    OutcomeUncertain,
    OutcomeUnknown,
    Owner,
    Record,
    ResolutionRefused,
    Status,
    Unknown,
    fingerprint,
)
from crewai_idempotent.ledger._record import Event
from tests.support.clock import ClockedBackend, FrozenClock, ManualClock
from tests.support.faults.provider import Provider as Effects
from tests.support.stores import ALL_BACKENDS

# Every backend of conftest, plus SQLite in synchronous=CLAIMS (two connections per
# thread: claims on a FULL one, the rest on a NORMAL one) unless a run picks its own.
CONFORMANCE = ALL_BACKENDS if "sqlite" not in ALL_BACKENDS else [*ALL_BACKENDS, "sqlite-claims"]


@pytest.fixture(params=CONFORMANCE)
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Receipt(pydantic.BaseModel):
    charge_id: str
    amount_cents: int


class Provider:
    """Bodies whose runs are effects at the one fake provider (tests/support/faults/provider.py),
    counted there: a test asks the provider, never the ledger, how often a body ran."""

    def __init__(self, effects: Effects) -> None:
        self.effects = effects
        self.lock = threading.Lock()
        self.runs = 0

    def body(self, key: str, result: Any = ...) -> Callable[[], Any]:
        def run() -> Any:
            with self.lock:
                self.effects.charge(key)
                self.runs += 1
                number = self.runs
            return f"receipt-{key}-{number}" if result is ... else result

        return run

    def count(self, key: str) -> int:
        return len(self.effects.effects(key))

    def total(self) -> int:
        return len(self.effects.effects())


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider(Effects.create(tmp_path / "effects"))


@pytest.fixture
def ledger(backend: CacheBackend) -> Ledger:
    return Ledger(backend, wait_s=2.0, lease_s=5.0)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def clocked(backend: CacheBackend, clock: ManualClock) -> ClockedBackend:
    """The test's store on a clock the test moves: leases and TTLs lapse when it says."""
    return ClockedBackend(backend, clock)


@pytest.fixture
def clocked_ledger(clocked: ClockedBackend, clock: ManualClock) -> Ledger:
    return Ledger(clocked, wait_s=2.0, lease_s=5.0, clock=clock)


def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for another thread to reach a point (a correctness bound, generous on purpose)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the other thread never got there"
        time.sleep(0.002)


def _stale_pending(backend: CacheBackend, key: str, fp: str = "", token: int = 1) -> Record:
    """What a worker that died right after its claim leaves behind."""
    now = backend.now()
    owner = Owner("dead-host", 999_999, "deadbeef")
    record = Record(
        key=key, status=Status.PENDING, fingerprint=fp, token=token, revision=1, owner=owner,
        attempts=1, created_at=now - 60, updated_at=now - 60, lease_expires_at=now - 30,
        history=(Event(now - 60, "claim", token, owner.label),),
    )  # fmt: skip
    assert backend.insert(record) is None
    return record


def _live_pending(backend: CacheBackend, key: str, fp: str = "") -> Record:
    now = backend.now()
    owner = Owner("other-host", 4242, "cafebabe")
    record = Record(
        key=key, status=Status.PENDING, fingerprint=fp, token=1, revision=1, owner=owner,
        attempts=1, created_at=now, updated_at=now, lease_expires_at=now + 300,
    )  # fmt: skip
    assert backend.insert(record) is None
    return record


# -- absent, committed, conflict -------------------------------------------------------------


def test_absent_key_is_claimed_run_and_committed(ledger: Ledger, provider: Provider) -> None:
    outcome = ledger.execute("charge:1", provider.body("charge:1"), fingerprint="fp1")
    assert outcome.value == "receipt-charge:1-1"
    assert outcome.replayed is False
    record = ledger.get("charge:1")
    assert record is not None
    assert record.status is Status.COMMITTED
    assert (record.token, record.attempts, record.fingerprint) == (1, 1, "fp1")
    assert record.owner is not None and record.owner.pid > 0
    assert record.lease_expires_at is None
    assert [e.kind for e in record.history] == ["claim", "commit"]
    assert record.value() == "receipt-charge:1-1"


def test_committed_key_replays_without_running(ledger: Ledger, provider: Provider) -> None:
    first = ledger.run("charge:2", provider.body("charge:2"), fingerprint="fp")
    again = ledger.execute("charge:2", provider.body("charge:2"), fingerprint="fp")
    assert again.value == first
    assert again.replayed is True
    assert provider.count("charge:2") == 1


def test_committed_key_with_other_arguments_conflicts(ledger: Ledger, provider: Provider) -> None:
    ledger.run("charge:3", provider.body("charge:3"), fingerprint=fingerprint({"amount": 5}))
    with pytest.raises(IdempotencyKeyConflict, match="charge:3") as info:
        ledger.run("charge:3", provider.body("charge:3"), fingerprint=fingerprint({"amount": 6}))
    assert info.value.key == "charge:3"
    assert provider.count("charge:3") == 1
    assert ledger.get("charge:3").status is Status.COMMITTED  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "value",
    [
        "plain text",
        "",
        0,
        -17,
        2**70,
        3.25,
        True,
        None,
        {"charge": "ch_1", "amount": 500, "tags": ["a", "b"], "nested": {"x": None}},
        [1, "two", {"three": 3.0}],
        Receipt(charge_id="ch_42", amount_cents=1999),
    ],
    ids=repr,
)
def test_replay_returns_a_value_equal_to_the_original(
    ledger: Ledger, provider: Provider, value: Any
) -> None:
    first = ledger.run("v", provider.body("v", value))
    replayed = ledger.run("v", provider.body("v", value))
    assert first == value
    assert replayed == value
    assert type(replayed) is type(value)
    assert provider.count("v") == 1


def test_unserialisable_result_is_stored_as_its_str(ledger: Ledger) -> None:
    class Opaque:
        def __str__(self) -> str:
            return "opaque-receipt"

    first = ledger.run("opaque", Opaque)
    assert isinstance(first, Opaque)
    assert ledger.run("opaque", Opaque) == "opaque-receipt"


def test_result_whose_str_raises_still_commits(ledger: Ledger) -> None:
    class Hostile:
        def __str__(self) -> str:
            raise RuntimeError("no")

    ledger.run("hostile", Hostile)
    record = ledger.get("hostile")
    assert record is not None and record.status is Status.COMMITTED
    assert "unprintable" in ledger.run("hostile", Hostile)


# -- pending -----------------------------------------------------------------------------------


def test_live_pending_claim_is_never_run_twice(
    clocked: CacheBackend, clock: ManualClock, provider: Provider
) -> None:
    ledger = Ledger(clocked, clock=clock)
    _live_pending(clocked, "busy")
    started = clock.monotonic()
    with pytest.raises(OperationInProgress, match="busy") as info:
        ledger.run("busy", provider.body("busy"), wait_s=3.0)
    assert clock.monotonic() - started >= 3.0  # it waited its wait_s, on the moved clock
    assert info.value.record.owner.host == "other-host"  # type: ignore[union-attr]
    assert provider.count("busy") == 0


def test_async_wait_on_a_live_claim_ends_after_wait_s(
    clocked: CacheBackend, clock: ManualClock, provider: Provider
) -> None:
    ledger = Ledger(clocked, clock=clock)
    _live_pending(clocked, "abusy")

    async def body() -> str:
        return str(provider.body("abusy")())

    started = clock.monotonic()
    with pytest.raises(OperationInProgress, match="abusy"):
        asyncio.run(ledger.arun("abusy", body, wait_s=3.0))
    assert clock.monotonic() - started >= 3.0
    assert provider.count("abusy") == 0


class _Outage(ClockedBackend):
    """The store refuses the next `failures` writes after the claim (a short outage)."""

    failures = 0

    def replace(self, current: Record, new: Record) -> bool:
        if self.failures:
            self.failures -= 1
            raise ConnectionResetError("store restarting")
        return super().replace(current, new)


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_commit_is_retried_through_a_short_outage(
    backend: CacheBackend, clock: ManualClock, provider: Provider, driver: str
) -> None:
    store = _Outage(backend, clock)
    ledger = Ledger(store, commit_retry_s=30.0, clock=clock)

    def body() -> str:
        store.failures = 4
        return str(provider.body("outage")())

    async def abody() -> str:
        return body()

    started = clock.monotonic()
    if driver == "sync":
        value = ledger.run("outage", body)
    else:
        value = asyncio.run(ledger.arun("outage", abody))
    assert clock.monotonic() - started >= 0.05 + 0.1 + 0.2 + 0.4  # it paused between tries
    record = ledger.get("outage")
    assert record is not None and record.status is Status.COMMITTED
    assert record.value() == value and provider.count("outage") == 1
    assert ledger.run("outage", body) == value


def test_waiter_replays_once_the_owner_commits(ledger: Ledger, provider: Provider) -> None:
    release = threading.Event()
    claimed = threading.Event()
    results: list[Any] = []

    def slow() -> str:
        claimed.set()
        release.wait(5)
        return provider.body("slow")()

    owner = threading.Thread(target=lambda: results.append(ledger.run("slow", slow)))
    owner.start()
    assert claimed.wait(5)
    waiter_result: list[Any] = []
    waiter = threading.Thread(
        target=lambda: waiter_result.append(ledger.execute("slow", provider.body("slow")))
    )
    waiter.start()
    _until(lambda: ledger.stats().rooms == 1)  # the waiter waits on the owner's claim
    release.set()
    owner.join(5)
    waiter.join(5)
    assert provider.count("slow") == 1
    assert waiter_result[0].replayed is True
    assert waiter_result[0].value == results[0]


def test_pending_with_other_arguments_conflicts_at_once(
    backend: CacheBackend, provider: Provider
) -> None:
    _live_pending(backend, "busy2", fp="a")
    with pytest.raises(IdempotencyKeyConflict):
        Ledger(backend).run("busy2", provider.body("busy2"), fingerprint="b", wait_s=5)
    assert provider.count("busy2") == 0


# -- failed ------------------------------------------------------------------------------------


def test_raising_body_records_failed_and_reraises_the_original(ledger: Ledger) -> None:
    error = ValueError("card declined before charging")

    def body() -> None:
        raise error

    with pytest.raises(ValueError) as info:
        ledger.run("declined", body)
    assert info.value is error
    record = ledger.get("declined")
    assert record is not None and record.status is Status.FAILED
    assert "ValueError: card declined" in (record.error or "")
    assert record.lease_expires_at is None


def test_failed_key_is_claimed_again_with_a_new_token(ledger: Ledger, provider: Provider) -> None:
    with pytest.raises(RuntimeError):
        ledger.run("retry-me", lambda: (_ for _ in ()).throw(RuntimeError("transient")))
    assert ledger.run("retry-me", provider.body("retry-me")) == "receipt-retry-me-1"
    record = ledger.get("retry-me")
    assert record is not None
    assert (record.status, record.token, record.attempts) == (Status.COMMITTED, 2, 2)
    assert [e.kind for e in record.history] == ["claim", "fail", "takeover", "commit"]
    assert provider.count("retry-me") == 1


# -- uncertain ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "signal", [OutcomeUnknown("provider timed out"), TimeoutError("read timed out")], ids=repr
)
def test_unknown_outcome_is_uncertain_and_nothing_runs_again(
    ledger: Ledger, provider: Provider, signal: BaseException
) -> None:
    def body() -> None:
        provider.body("maybe")()
        raise signal

    with pytest.raises(type(signal)):
        ledger.run("maybe", body)
    assert ledger.get("maybe").status is Status.UNCERTAIN  # type: ignore[union-attr]
    with pytest.raises(OutcomeUncertain, match="maybe"):
        ledger.run("maybe", provider.body("maybe"))
    assert provider.count("maybe") == 1


def test_uncertain_record_is_reconciled_when_a_reconciler_is_given(
    ledger: Ledger, provider: Provider
) -> None:
    with pytest.raises(OutcomeUnknown):
        ledger.run("rec", lambda: (_ for _ in ()).throw(OutcomeUnknown("timeout")))
    seen: list[tuple[str, Any]] = []

    def lookup(key: str, args: Any) -> Found:
        seen.append((key, args))
        return Found("receipt-from-provider")

    value = ledger.run("rec", provider.body("rec"), reconcile=lookup, args={"amount": 5})
    assert value == "receipt-from-provider"
    assert seen == [("rec", {"amount": 5})]
    assert ledger.run("rec", provider.body("rec")) == "receipt-from-provider"
    assert provider.count("rec") == 0


# -- stale claims (the owner died) -----------------------------------------------------------


def test_stale_claim_becomes_uncertain_by_default(
    backend: CacheBackend, provider: Provider
) -> None:
    _stale_pending(backend, "orphan")
    with pytest.raises(OutcomeUncertain, match="stopped renewing"):
        Ledger(backend).run("orphan", provider.body("orphan"))
    record = backend.get("orphan")
    assert record is not None and record.status is Status.UNCERTAIN
    assert provider.count("orphan") == 0


def test_stale_claim_is_rerun_with_on_stale_retry(
    backend: CacheBackend, provider: Provider
) -> None:
    _stale_pending(backend, "orphan2")
    assert Ledger(backend).run("orphan2", provider.body("orphan2"), on_stale="retry")
    record = backend.get("orphan2")
    assert record is not None
    assert (record.status, record.token) == (Status.COMMITTED, 2)
    assert provider.count("orphan2") == 1


@pytest.mark.parametrize(
    ("verdict", "status", "runs"),
    [
        (Found("found-receipt"), Status.COMMITTED, 0),
        (Absent(), Status.COMMITTED, 1),
        (Absent, Status.COMMITTED, 1),
        (Unknown("provider cannot tell"), Status.UNCERTAIN, 0),
        (RuntimeError("lookup failed"), Status.UNCERTAIN, 0),
        ("nonsense", Status.UNCERTAIN, 0),
    ],
    ids=["found", "absent", "absent-class", "unknown", "raises", "nonsense"],
)
def test_stale_claim_is_reconciled(
    backend: CacheBackend, provider: Provider, verdict: Any, status: Status, runs: int
) -> None:
    _stale_pending(backend, "stale")

    def reconcile(key: str, args: Any) -> Any:
        if isinstance(verdict, Exception):
            raise verdict
        return verdict

    ledger = Ledger(backend)
    if status is Status.UNCERTAIN:
        with pytest.raises(OutcomeUncertain):
            ledger.run("stale", provider.body("stale"), reconcile=reconcile)
    else:
        value = ledger.run("stale", provider.body("stale"), reconcile=reconcile)
        assert value == ("found-receipt" if runs == 0 else "receipt-stale-1")
    record = backend.get("stale")
    assert record is not None and record.status is status
    assert provider.count("stale") == runs
    kinds = [e.kind for e in record.history]
    expected = {Status.UNCERTAIN: "uncertain"}.get(status, "takeover" if runs else "reconcile")
    assert kinds[-1 if status is Status.UNCERTAIN or runs == 0 else -2] == expected


# -- fencing -----------------------------------------------------------------------------------


def test_backend_compare_and_set_refuses_a_stale_token_or_revision(backend: CacheBackend) -> None:
    held = _live_pending(backend, "cas")
    assert backend.insert(held) == held  # insert-if-absent returns the holder
    takeover = held.evolve(None, token=2)
    assert backend.replace(held, takeover) is True
    late_commit = held.evolve(None, status=Status.COMMITTED)
    assert backend.replace(held, late_commit) is False  # old token
    assert backend.replace(takeover.evolve(None), takeover.evolve(None, revision=9)) is False
    assert backend.get("cas") == takeover
    assert backend.delete(held) is False
    assert backend.delete(takeover) is True
    assert backend.get("cas") is None


class FrozenOwner:
    """A worker that claimed `key` and then, mid-body, stopped renewing its lease (as if
    frozen) until `finish()`; the lease has lapsed (on `clock`) when the constructor returns."""

    def __init__(
        self,
        backend: CacheBackend,
        clock: ManualClock,
        key: str,
        effects: list[str],
        effect: str,
    ) -> None:
        # On a clock where no time passes, its lease keeper never finds a renewal due.
        ledger = Ledger(backend, lease_s=5.0, clock=FrozenClock())
        self.inside, self.release = threading.Event(), threading.Event()
        self.returned: list[Any] = []
        self.errors: list[BaseException] = []

        def body() -> str:
            self.inside.set()
            self.release.wait(5)
            effects.append(effect)
            return f"{effect}-receipt"

        def run() -> None:
            try:
                self.returned.append(ledger.run(key, body))
            except BaseException as exc:  # noqa: BLE001
                self.errors.append(exc)

        self.thread = threading.Thread(target=run)
        self.thread.start()
        assert self.inside.wait(5)
        clock.advance(6.0)  # past the lease: nobody renewed it

    def finish(self) -> None:
        self.release.set()
        self.thread.join(5)


def test_worker_whose_claim_was_taken_over_cannot_commit(
    clocked: CacheBackend, clock: ManualClock
) -> None:
    backend = clocked
    effects: list[str] = []
    owner = FrozenOwner(backend, clock, "fenced", effects, "first")
    second = Ledger(backend).run(
        "fenced", lambda: effects.append("second") or "second-receipt", on_stale="retry"
    )
    assert second == "second-receipt"
    owner.finish()
    assert effects == ["second", "first"]
    assert len(owner.errors) == 1 and isinstance(owner.errors[0], OutcomeUncertain)
    record = backend.get("fenced")
    assert record is not None
    assert record.status is Status.UNCERTAIN and record.needs_operator
    assert record.token == 2
    assert [e["token"] for e in record.evidence] == [1]
    assert record.evidence[0]["result"] == {"t": "json", "v": "first-receipt"}
    # a reconciler is not allowed to paper over a possible double execution
    with pytest.raises(OutcomeUncertain):
        Ledger(backend).run("fenced", lambda: "x", reconcile=lambda k, a: Found("y"))


# -- TTL ---------------------------------------------------------------------------------------


def test_committed_receipt_expires_after_its_ttl(
    clocked_ledger: Ledger, clock: ManualClock, provider: Provider
) -> None:
    ledger = clocked_ledger
    ledger.run("ttl", provider.body("ttl"), ttl=30)
    assert ledger.execute("ttl", provider.body("ttl")).replayed
    clock.advance(29)
    assert ledger.execute("ttl", provider.body("ttl")).replayed
    clock.advance(2)
    outcome = ledger.execute("ttl", provider.body("ttl"))
    assert outcome.replayed is False
    assert provider.count("ttl") == 2
    record = ledger.get("ttl")
    assert record is not None and record.token == 2
    assert "expire" in [e.kind for e in record.history]


def test_a_zero_ttl_is_refused(backend: CacheBackend) -> None:
    with pytest.raises(ValueError, match="ttl must be greater than 0"):
        Ledger(backend, ttl=0)
    with pytest.raises(ValueError, match="ttl must be greater than 0"):
        Ledger(backend).run("k", lambda: 1, ttl=0)
    assert backend.get("k") is None


@pytest.mark.parametrize("name", ["wait_s", "lease_s", "ttl"])
@pytest.mark.parametrize("bad", [True, False, float("nan"), -1, "5"], ids=repr)
def test_the_ledger_and_the_configuration_refuse_the_same_durations(name: str, bad: Any) -> None:
    """One rule for a duration wherever it is given: a bool is not a number of seconds."""
    backend = InMemoryCacheBackend()
    with pytest.raises((TypeError, ValueError)) as by_ledger:
        Ledger(backend, **{name: bad})
    with pytest.raises((TypeError, ValueError)) as by_call:
        Ledger(backend).run("k", lambda: 1, **{name: bad})
    with pytest.raises((TypeError, ValueError)) as by_config:
        IdempotencyConfig(**{name: bad})
    assert backend.get("k") is None
    assert type(by_ledger.value) is type(by_call.value) is type(by_config.value)
    assert str(by_ledger.value) == str(by_call.value) == str(by_config.value)
    assert str(by_ledger.value).startswith(f"{name} must be")
    if isinstance(bad, bool):
        assert isinstance(by_ledger.value, TypeError)


@pytest.mark.parametrize("bad", [True, -1.0, float("nan"), None])
def test_a_bad_commit_retry_time_is_refused(bad: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="commit_retry_s must be"):
        Ledger(InMemoryCacheBackend(), commit_retry_s=bad)


def test_no_ttl_means_the_receipt_never_expires(ledger: Ledger, provider: Provider) -> None:
    ledger.run("forever", provider.body("forever"))
    record = ledger.get("forever")
    assert record is not None and record.expires_at is None


def test_purge_removes_only_expired_receipts(
    clocked_ledger: Ledger, clock: ManualClock, provider: Provider
) -> None:
    ledger = clocked_ledger
    ledger.run("short", provider.body("short"), ttl=10)
    ledger.run("long", provider.body("long"), ttl=3600)
    with pytest.raises(OutcomeUnknown):
        ledger.run("unsure", lambda: (_ for _ in ()).throw(OutcomeUnknown("?")), ttl=10)
    assert ledger.purge() == 0
    clock.advance(11)
    assert ledger.purge() == 1
    assert ledger.get("short") is None
    assert ledger.get("long") is not None
    assert ledger.get("unsure") is not None  # uncertain records are never purged


# -- resolution --------------------------------------------------------------------------------


def test_resolve_happened_commits_the_given_receipt(ledger: Ledger, provider: Provider) -> None:
    with pytest.raises(OutcomeUnknown):
        ledger.run("r1", lambda: (_ for _ in ()).throw(OutcomeUnknown("timeout")))
    record = ledger.resolve("r1", result={"charge": "ch_9"}, by="alice", reason="seen in dashboard")
    assert record.status is Status.COMMITTED
    assert ledger.run("r1", provider.body("r1")) == {"charge": "ch_9"}
    assert provider.count("r1") == 0
    last = record.history[-1]
    assert (last.kind, last.by) == ("resolve", "alice")
    assert "seen in dashboard" in last.note


def test_resolved_receipt_expires_like_a_committed_one(
    clocked: CacheBackend, clock: ManualClock
) -> None:
    ledger = Ledger(clocked, ttl=30, clock=clock)
    with pytest.raises(OutcomeUnknown):
        ledger.run("r-ttl", lambda: (_ for _ in ()).throw(OutcomeUnknown("timeout")))
    assert ledger.resolve("r-ttl", result="seen").expires_at is not None
    assert ledger.run("r-ttl", lambda: "new") == "seen"
    clock.advance(31)
    assert ledger.run("r-ttl", lambda: "new") == "new"


def test_resolve_absent_lets_the_next_attempt_run(ledger: Ledger, provider: Provider) -> None:
    with pytest.raises(OutcomeUnknown):
        ledger.run("r2", lambda: (_ for _ in ()).throw(OutcomeUnknown("timeout")))
    ledger.resolve("r2", absent=True, by="bob", reason="no charge at provider")
    assert ledger.run("r2", provider.body("r2")) == "receipt-r2-1"
    assert provider.count("r2") == 1


def test_resolve_stale_pending(backend: CacheBackend) -> None:
    _stale_pending(backend, "r3")
    Ledger(backend).resolve("r3", absent=True, reason="checked")
    assert backend.get("r3").status is Status.FAILED  # type: ignore[union-attr]


def test_resolve_refuses_settled_or_live_records(backend: CacheBackend, provider: Provider) -> None:
    ledger = Ledger(backend)
    ledger.run("done", provider.body("done"))
    _live_pending(backend, "running")
    with pytest.raises(ResolutionRefused, match="COMMITTED"):
        ledger.resolve("done", absent=True)
    with pytest.raises(ResolutionRefused, match="live lease"):
        ledger.resolve("running", result="x")
    with pytest.raises(ResolutionRefused, match="no record"):
        ledger.resolve("never-seen", absent=True)
    with pytest.raises(ValueError, match="exactly one"):
        ledger.resolve("done")
    assert backend.get("done").status is Status.COMMITTED  # type: ignore[union-attr]


# -- keys --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["", "   ", "\t", "a" * 513, "é" * 257, "line\nbreak", "nul\x00", "del\x7f", "esc\x1b[0m", 42],
    ids=[
        "empty",
        "blank",
        "tab",
        "513-bytes",
        "514-utf8-bytes",
        "newline",
        "nul",
        "del",
        "esc",
        "int",
    ],
)
def test_invalid_keys_are_refused_and_nothing_runs(
    ledger: Ledger, provider: Provider, key: Any
) -> None:
    with pytest.raises(InvalidIdempotencyKey):
        ledger.run(key, provider.body("k"))
    assert provider.total() == 0
    assert ledger.records() == []


def test_longest_valid_key_is_accepted(ledger: Ledger, provider: Provider) -> None:
    key = "é" * 256  # 512 UTF-8 bytes
    assert ledger.run(key, provider.body("long")) == "receipt-long-1"
    assert ledger.run(key, provider.body("long")) == "receipt-long-1"


# -- async -------------------------------------------------------------------------------------


def test_async_twin_claims_replays_and_fails_like_run(ledger: Ledger, provider: Provider) -> None:
    async def charge() -> str:
        await asyncio.sleep(0)
        return provider.body("async")()

    async def boom() -> str:
        raise KeyError("declined")

    async def scenario() -> None:
        assert await ledger.arun("async", charge) == "receipt-async-1"
        assert (await ledger.aexecute("async", charge)).replayed
        with pytest.raises(KeyError):
            await ledger.arun("async-fail", boom)
        assert ledger.get("async-fail").status is Status.FAILED  # type: ignore[union-attr]

    asyncio.run(scenario())
    assert provider.count("async") == 1


def test_cancelled_async_body_is_uncertain(ledger: Ledger, provider: Provider) -> None:
    async def scenario() -> None:
        started = asyncio.Event()

        async def slow() -> str:
            started.set()
            provider.body("cancel")()
            await asyncio.sleep(10)
            return "never"

        task = asyncio.create_task(ledger.arun("cancel", slow))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert ledger.get("cancel").status is Status.UNCERTAIN  # type: ignore[union-attr]
    with pytest.raises(OutcomeUncertain):
        ledger.run("cancel", provider.body("cancel"))
    assert provider.count("cancel") == 1


def test_async_reconciler_is_awaited(backend: CacheBackend, provider: Provider) -> None:
    _stale_pending(backend, "astale")

    async def lookup(key: str, args: Any) -> Found:
        await asyncio.sleep(0)
        return Found("async-found")

    async def body() -> str:
        return provider.body("astale")()

    assert asyncio.run(Ledger(backend).arun("astale", body, reconcile=lookup)) == "async-found"
    assert provider.count("astale") == 0


# -- events ------------------------------------------------------------------------------------


def test_listener_sees_each_transition(ledger: Ledger, provider: Provider) -> None:
    seen: list[tuple[str, str]] = []
    ledger.add_listener(lambda kind, record: seen.append((kind, record.key)))
    ledger.add_listener(lambda kind, record: 1 / 0)  # a broken listener changes nothing
    ledger.run("ev", provider.body("ev"), fingerprint="a")
    ledger.run("ev", provider.body("ev"), fingerprint="a")
    with pytest.raises(IdempotencyKeyConflict):
        ledger.run("ev", provider.body("ev"), fingerprint="b")
    assert seen == [("claim", "ev"), ("commit", "ev"), ("replay", "ev"), ("conflict", "ev")]


# -- durability across processes ---------------------------------------------------------------


def test_records_survive_reopening_in_a_new_process(
    backend_kind: str, backend_url: str, open_backend: Callable[[], CacheBackend], tmp_path: Any
) -> None:
    if backend_kind == "memory":
        pytest.skip("the in-memory backend is documented as not durable")
    effects = tmp_path / "effects.txt"
    child = textwrap.dedent(
        f"""
        from crewai_idempotent import Ledger, backend_from_url
        def charge():
            with open({str(effects)!r}, "a") as f:
                f.write("charged\\n")
            return {{"charge": "ch_1"}}
        ledger = Ledger(backend_from_url({backend_url!r}))
        print(ledger.run("persist", charge, fingerprint="fp"))
        ledger.close()
        """
    )
    first = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=60
    )
    assert first.returncode == 0, first.stderr
    ledger = Ledger(open_backend())
    assert ledger.execute("persist", lambda: "again", fingerprint="fp").value == {"charge": "ch_1"}
    second = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=60
    )
    assert second.returncode == 0, second.stderr
    assert effects.read_text() == "charged\n"


def test_closing_and_reopening_keeps_every_state(
    backend_kind: str, open_backend: Callable[[], CacheBackend]
) -> None:
    first = Ledger(open_backend())
    first.run("c", lambda: "committed")
    with pytest.raises(ValueError):
        first.run("f", lambda: (_ for _ in ()).throw(ValueError("x")))
    with pytest.raises(OutcomeUnknown):
        first.run("u", lambda: (_ for _ in ()).throw(OutcomeUnknown("?")))
    if backend_kind != "memory":
        first.close()
    again = Ledger(open_backend())
    records = again.records()
    states = {r.key: r.status for r in records if not r.key.startswith("crewai-idempotent/")}
    assert states == {"c": Status.COMMITTED, "f": Status.FAILED, "u": Status.UNCERTAIN}
    assert [r.key for r in again.records(Status.UNCERTAIN)] == ["u"]
    # and the outbox's entry saying "u" needs a person
    assert len([r for r in records if r.key.startswith("crewai-idempotent/outbox/")]) == 1


def test_owner_that_outlived_its_lease_settles_an_uncertain_record(
    clocked: CacheBackend, clock: ManualClock
) -> None:
    """Nobody took the claim over, so only one execution happened: the owner's receipt wins."""
    backend = clocked
    effects: list[str] = []
    owner = FrozenOwner(backend, clock, "late", effects, "charged")
    with pytest.raises(OutcomeUncertain):
        Ledger(backend).run("late", lambda: effects.append("again") or "x")
    owner.finish()
    assert owner.returned == ["charged-receipt"]
    record = backend.get("late")
    assert record is not None
    assert (record.status, record.token, record.needs_operator) == (Status.COMMITTED, 1, False)
    assert record.history[-1].note.startswith("late commit")
    assert Ledger(backend).run("late", lambda: effects.append("again") or "x") == "charged-receipt"
    assert effects == ["charged"]


def test_http_client_timeouts_count_as_unknown_outcomes(ledger: Ledger) -> None:
    class ReadTimeout(OSError):  # the shape of requests' and httpx's timeouts
        pass

    with pytest.raises(ReadTimeout):
        ledger.run("http", lambda: (_ for _ in ()).throw(ReadTimeout("read timed out")))
    assert ledger.get("http").status is Status.UNCERTAIN  # type: ignore[union-attr]


# -- the documents' prefix scan ------------------------------------------------------------

_OUTBOX = "crewai-idempotent/outbox/"
_PREFIX_KEYS = [
    f"{_OUTBOX}b",
    f"{_OUTBOX}a",
    f"{_OUTBOX}\u00e9t\u00e9",  # two bytes in UTF-8
    f"{_OUTBOX}\U0001f600",  # four bytes in UTF-8: after every BMP character
    f"{_OUTBOX}Z",
    "crewai-idempotent/outboxes/x",  # shares the letters, not the folder
    "crewai-idempotent/approval/ap_1",
    "crewaiidempotent0outbox",  # what a linguistic collation sorts between the bounds
    "crewai-idempotent0",
    "user:crewai-idempotent/outbox/a",
]


def _committed(backend: CacheBackend, key: str) -> Record:
    now = backend.now()
    record = Record(
        key=key, status=Status.COMMITTED, fingerprint="fp", token=1, revision=1, owner=None,
        attempts=1, created_at=now, updated_at=now, result={"k": key},
    )  # fmt: skip
    assert backend.insert(record) is None
    return record


def _keys(records: Any) -> list[str]:
    return [record.key for record in records]


def test_scan_prefix_returns_exactly_the_keys_under_it_in_code_point_order(
    backend: CacheBackend,
) -> None:
    stored = {key: _committed(backend, key) for key in _PREFIX_KEYS}
    under = sorted(key for key in _PREFIX_KEYS if key.startswith(_OUTBOX))
    assert _keys(backend.scan_prefix(_OUTBOX)) == under
    assert _keys(backend.scan_prefix("crewai-idempotent/")) == sorted(
        key for key in _PREFIX_KEYS if key.startswith("crewai-idempotent/")
    )
    assert _keys(backend.scan_prefix("user:")) == ["user:crewai-idempotent/outbox/a"]
    assert _keys(backend.scan_prefix("")) == sorted(_PREFIX_KEYS)
    assert list(backend.scan_prefix(f"{_OUTBOX}nothing")) == []
    # A change is seen, a deletion is gone.
    a = stored[f"{_OUTBOX}a"]
    changed = a.evolve(None, result={"k": "changed"})
    assert backend.replace(a, changed)
    assert backend.delete(stored[f"{_OUTBOX}b"])
    found = {record.key: record for record in backend.scan_prefix(_OUTBOX)}
    assert sorted(found) == [key for key in under if key != f"{_OUTBOX}b"]
    assert found[f"{_OUTBOX}a"] == changed


def _forget_documents_index(backend: CacheBackend) -> None:
    """Make the store look like one written before it indexed its documents."""
    import shutil

    from crewai_idempotent.backends.filelock import FileLockCacheBackend
    from crewai_idempotent.backends.postgres import PostgresCacheBackend
    from crewai_idempotent.backends.redis import RedisCacheBackend

    if isinstance(backend, FileLockCacheBackend):
        shutil.rmtree(backend.directory / "documents")
    elif isinstance(backend, RedisCacheBackend):
        backend.client.delete(f"{backend.prefix}docs", f"{backend.prefix}docs:complete")
    elif isinstance(backend, PostgresCacheBackend):

        def drop(conn: Any, _resent: bool) -> None:
            rows = conn.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename = %s AND indexname LIKE %s",
                (backend.table, "%\\_docs"),
            ).fetchall()
            assert len(rows) == 1, rows
            conn.execute(f'DROP INDEX "{rows[0][0]}"')

        backend._call("dropping the documents' index", drop, retry=False)


def test_scan_prefix_finds_documents_written_before_the_index(
    factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    first = factory()
    for key in _PREFIX_KEYS:
        _committed(first, key)
    _forget_documents_index(first)
    first.close()
    later = factory()  # a process of a version that indexes documents opens the old store
    try:
        with caplog.at_level("WARNING", logger="crewai_idempotent"):
            assert _keys(later.scan_prefix(_OUTBOX)) == sorted(
                key for key in _PREFIX_KEYS if key.startswith(_OUTBOX)
            )
        _committed(later, f"{_OUTBOX}new")
        assert f"{_OUTBOX}new" in _keys(later.scan_prefix(_OUTBOX))
    finally:
        later.close()
    if "postgres" in repr(factory):
        assert "CREATE INDEX CONCURRENTLY" in caplog.text  # says how to build it
