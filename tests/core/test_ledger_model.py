"""A hypothesis state machine: the guard against a plain model of the record states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from crewai_idempotent import (
    Absent,
    Found,
    IdempotencyKeyConflict,
    InMemoryCacheBackend,
    Ledger,
    OperationInProgress,
    OutcomeUncertain,
    OutcomeUnknown,
    Owner,
    Record,
    ResolutionRefused,
    SQLiteCacheBackend,
    Status,
    Unknown,
)
from tests.support.clock import FakeHostClock

LEASE_S = 10.0
KEYS = st.sampled_from(["a", "b", "c"])
FINGERPRINTS = st.sampled_from(["x", "y"])


class ClockMixin:
    """A store whose clocks the test moves, so leases and TTLs expire on demand: `now()`
    and the host's clock both read `clock` (records the ledger writes carry deadlines on
    both; those `worker_dies_after_claiming` plants carry only wall-clock ones, as an
    older version wrote them)."""

    clock = 1_000_000.0

    def now(self) -> float:
        return self.clock

    @property
    def host_clock(self) -> FakeHostClock:
        return FakeHostClock(lambda: self.clock)

    @host_clock.setter
    def host_clock(self, _: object) -> None:
        pass  # the store's own (the real host clock) gives way to the moved one


class ClockedMemory(ClockMixin, InMemoryCacheBackend):
    pass


class ClockedSQLite(ClockMixin, SQLiteCacheBackend):
    pass


class ClaimFirstMemory(ClockedMemory):
    """The path server stores take: claim first, no peek (one round trip)."""

    read_first = False


@dataclass
class Expected:
    status: Status
    fingerprint: str
    token: int
    value: Any = None
    expires_at: float | None = None
    lease_expires_at: float | None = None


class GuardMachine(RuleBasedStateMachine):
    backend_type: type = ClockedMemory

    def __init__(self) -> None:
        super().__init__()
        if self.backend_type is ClockedSQLite:
            import tempfile

            self.folder = tempfile.TemporaryDirectory()
            self.backend: Any = ClockedSQLite(f"{self.folder.name}/ledger.db")
        else:
            self.backend = self.backend_type()
        self.backend.clock = 1_000_000.0
        self.ledger = Ledger(self.backend, wait_s=0.0, lease_s=LEASE_S)
        self.model: dict[str, Expected] = {}
        self.runs = 0
        self.serial = 0

    def teardown(self) -> None:
        self.backend.close()
        if self.backend_type is ClockedSQLite:
            self.folder.cleanup()

    # -- the model's view of one call --------------------------------------------------

    def _predict(self, key: str, fp: str, reconcile: str | None) -> str:
        now = self.backend.clock
        held = self.model.get(key)
        if held is None:
            return "run"
        if held.status is Status.COMMITTED:
            if held.expires_at is not None and held.expires_at <= now:
                return "run"
            return "replay" if held.fingerprint == fp else "conflict"
        if held.status is Status.FAILED:
            return "run"
        if held.fingerprint != fp:
            return "conflict"
        if held.status is Status.PENDING and held.lease_expires_at > now:  # type: ignore[operator]
            return "in_progress"
        if reconcile is None:
            return "uncertain"
        return {"found": "found", "absent": "run", "unknown": "uncertain"}[reconcile]

    @rule(
        key=KEYS,
        fp=FINGERPRINTS,
        behaviour=st.sampled_from(["ok", "raise", "unknown"]),
        ttl=st.sampled_from([None, 5.0]),
        reconcile=st.sampled_from([None, "found", "absent", "unknown"]),
    )
    def call(
        self, key: str, fp: str, behaviour: str, ttl: float | None, reconcile: str | None
    ) -> None:
        expected = self._predict(key, fp, reconcile)
        self.serial += 1
        value = f"v{self.serial}"
        ran: list[bool] = []

        def body() -> str:
            ran.append(True)
            if behaviour == "raise":
                raise ValueError("declined")
            if behaviour == "unknown":
                raise OutcomeUnknown("timeout")
            return value

        verdicts = {"found": Found(f"found{self.serial}"), "absent": Absent(), "unknown": Unknown()}
        reconciler = (lambda k, a: verdicts[reconcile]) if reconcile else None
        held = self.model.get(key)
        try:
            got = self.ledger.run(key, body, fingerprint=fp, ttl=ttl, reconcile=reconciler)
            outcome = "returned"
        except ValueError:
            outcome = "raised"
        except OutcomeUnknown:
            outcome = "unknown"
        except IdempotencyKeyConflict:
            outcome = "conflict"
        except OperationInProgress:
            outcome = "in_progress"
        except OutcomeUncertain:
            outcome = "uncertain"

        assert bool(ran) == (expected == "run"), (expected, outcome)
        now = self.backend.clock
        if expected == "run":
            token = 1 if held is None else held.token + 1
            if behaviour == "ok":
                assert (outcome, got) == ("returned", value)
                self.model[key] = Expected(
                    Status.COMMITTED, fp, token, value, now + ttl if ttl else None
                )
            elif behaviour == "raise":
                assert outcome == "raised"
                self.model[key] = Expected(Status.FAILED, fp, token)
            else:
                assert outcome == "unknown"
                self.model[key] = Expected(Status.UNCERTAIN, fp, token)
        elif expected == "replay":
            assert (outcome, got) == ("returned", held.value)  # type: ignore[union-attr]
        elif expected == "found":
            assert (outcome, got) == ("returned", f"found{self.serial}")
            assert held is not None
            self.model[key] = Expected(
                Status.COMMITTED, fp, held.token, got, now + ttl if ttl else None
            )
        else:
            assert outcome == expected, (expected, outcome)
            if expected == "uncertain":
                self.model[key].status = Status.UNCERTAIN
        self.runs += len(ran)

    @rule(key=KEYS, fp=FINGERPRINTS, live=st.booleans())
    def worker_dies_after_claiming(self, key: str, fp: str, live: bool) -> None:
        """What a worker killed between its claim and its commit leaves in the store."""
        held = self.model.get(key)
        now = self.backend.clock
        expired = held is not None and held.expires_at is not None and held.expires_at <= now
        if held is not None and held.status is not Status.FAILED and not expired:
            return  # a real worker could not have claimed this key
        token = 1 if held is None else held.token + 1
        lease = now + (LEASE_S if live else -1.0)
        owner = Owner("dead", 1, "0")
        record = Record(
            key=key, status=Status.PENDING, fingerprint=fp, token=token, revision=1,
            owner=owner, attempts=1, created_at=now, updated_at=now, lease_expires_at=lease,
        )  # fmt: skip
        stored = self.backend.get(key)
        if stored is None:
            assert self.backend.insert(record) is None
        else:
            assert self.backend.replace(stored, stored.evolve(None, **_fields(record)))
        self.model[key] = Expected(Status.PENDING, fp, token, lease_expires_at=lease)

    @rule(seconds=st.sampled_from([1.0, 6.0, 20.0]))
    def time_passes(self, seconds: float) -> None:
        self.backend.clock += seconds

    @rule(key=KEYS, happened=st.booleans())
    def operator_resolves(self, key: str, happened: bool) -> None:
        held = self.model.get(key)
        now = self.backend.clock
        resolvable = held is not None and (
            held.status is Status.UNCERTAIN
            or (held.status is Status.PENDING and held.lease_expires_at <= now)  # type: ignore[operator]
        )
        try:
            if happened:
                self.ledger.resolve(key, result="resolved", reason="checked")
            else:
                self.ledger.resolve(key, absent=True, reason="checked")
        except ResolutionRefused:
            assert not resolvable
            return
        assert resolvable and held is not None
        if happened:
            self.model[key] = Expected(Status.COMMITTED, held.fingerprint, held.token, "resolved")
        else:
            self.model[key] = Expected(Status.FAILED, held.fingerprint, held.token)

    @invariant()
    def store_matches_model(self) -> None:
        for key, expected in self.model.items():
            record = self.backend.get(key)
            assert record is not None
            assert (record.status, record.token, record.fingerprint) == (
                expected.status,
                expected.token,
                expected.fingerprint,
            )
            if expected.status is Status.COMMITTED:
                assert record.value() == expected.value


def _fields(record: Record) -> dict[str, Any]:
    return {
        name: getattr(record, name)
        for name in ("status", "fingerprint", "token", "owner", "attempts", "lease_expires_at",
                     "expires_at", "result", "error")
    }  # fmt: skip


class SQLiteGuardMachine(GuardMachine):
    backend_type = ClockedSQLite


class ClaimFirstGuardMachine(GuardMachine):
    backend_type = ClaimFirstMemory


TestGuardInMemory = GuardMachine.TestCase
TestGuardInMemory.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
TestGuardClaimFirst = ClaimFirstGuardMachine.TestCase
TestGuardClaimFirst.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
TestGuardSQLite = SQLiteGuardMachine.TestCase
TestGuardSQLite.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
