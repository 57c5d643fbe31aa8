"""The host's clock: what embedded ledgers judge leases, receipts and grants by.

In-process, over the embedded stores: a wall clock stepped forward or back (a store
wrapper whose `now()` is moved, the host's clock untouched, as an NTP step leaves it), a
host clock the test moves, records an older version wrote (wall-clock deadlines only),
and deadlines read on another boot. The same with real processes whose clocks are
stepped by libfaketime is in tests/process/test_clock_steps.py.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import (
    ApprovalRequired,
    Approvals,
    CacheBackend,
    Found,
    Ledger,
    LedgerUnavailable,
    OperationInProgress,
    OutcomeUncertain,
    Owner,
    Record,
    Status,
)
from crewai_idempotent.gates._approvals import ApprovalState
from crewai_idempotent.ledger._hostclock import this_host
from tests.support.clock import ClockedBackend, FakeHostClock, ManualClock
from tests.support.faults.provider import Provider

EMBEDDED = ["memory", "sqlite", "sqlite-claims", "sqlite-normal", "filelock"]
HOUR, DAY = 3600.0, 86400.0
STEPS = [HOUR, DAY, -HOUR]
STEP_IDS = ["+1h", "+1d", "-1h"]


@pytest.fixture(params=EMBEDDED)
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider.create(tmp_path / "charges.jsonl")


def stepped(backend: CacheBackend, seconds: float) -> ClockedBackend:
    """`backend` as seen by a process whose wall clock reads `seconds` off."""
    wall = ManualClock()
    wall.advance(seconds)
    return ClockedBackend(backend, wall, host=False)


def kinds(record: Record | None) -> list[str]:
    assert record is not None
    return [f"{event.kind}/{event.token}" for event in record.history]


# -- the clock itself ----------------------------------------------------------------------


def test_this_host_reads_the_kernel_clocks_and_its_boot() -> None:
    host = this_host()
    assert host is not None
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        assert host.boot == f.read().strip()
    assert host.name == socket.gethostname()
    before = time.clock_gettime(time.CLOCK_MONOTONIC), time.clock_gettime(time.CLOCK_BOOTTIME)
    running, elapsed = host.running(), host.elapsed()
    after = time.clock_gettime(time.CLOCK_MONOTONIC), time.clock_gettime(time.CLOCK_BOOTTIME)
    # This process is in the host's own time namespace (tests/process/test_clock_steps.py has
    # one that is not): no offsets.
    assert before[0] <= running <= after[0] and before[1] <= elapsed <= after[1]
    assert this_host() is host  # read once per process


# -- leases --------------------------------------------------------------------------------


class Owned:
    """A live owner in this process: a thread whose body waits until released (at the
    latest when the test ends, whatever it asserted)."""

    def __init__(self, ledger: Ledger, key: str, provider: Provider) -> None:
        self.inside, self.release = threading.Event(), threading.Event()
        self.result: list[Any] = []

        def body() -> str:
            self.inside.set()
            assert self.release.wait(60)
            return provider.charge(key)

        self.thread = threading.Thread(target=lambda: self.result.append(ledger.run(key, body)))
        self.thread.start()
        assert self.inside.wait(30)

    def finish(self) -> Any:
        self.release.set()
        self.thread.join(60)
        [value] = self.result
        return value


@pytest.fixture
def owned() -> Iterator[Callable[[Ledger, str, Provider], Owned]]:
    made: list[Owned] = []

    def start(ledger: Ledger, key: str, provider: Provider) -> Owned:
        made.append(Owned(ledger, key, provider))
        return made[-1]

    yield start
    for owner in made:
        owner.release.set()
        owner.thread.join(60)


@pytest.mark.parametrize("policy", ["uncertain", "reconcile", "retry"])
@pytest.mark.parametrize("step", STEPS, ids=STEP_IDS)
def test_a_stepped_wall_clock_never_lapses_a_live_lease(
    backend: CacheBackend, provider: Provider, step: float, policy: str, owned: Any
) -> None:
    """Worker B reads a wall clock off by an hour or a day; owner A holds a live claim
    whose wall-clock lease B's clock says lapsed long ago (or not for an hour). B waits
    and gives up: OperationInProgress, the reconciler never asked, one charge."""
    owner = Ledger(backend, lease_s=0.3)
    a = owned(owner, "k", provider)
    asked: list[str] = []

    def reconcile(key: str, args: Any) -> Any:
        asked.append(key)
        return Found(provider.receipts(key)[0]) if provider.receipts(key) else None

    clock = ManualClock()  # B's wait_s passes at once: no real waiting
    b = Ledger(stepped(backend, step), wait_s=5.0, lease_s=0.3, clock=clock)
    with pytest.raises(OperationInProgress):
        b.run(
            "k",
            lambda: provider.charge("k"),
            on_stale=policy,  # type: ignore[arg-type]
            reconcile=reconcile if policy == "reconcile" else None,
        )
    assert asked == [] and provider.effects() == []
    value = a.finish()
    assert provider.receipts("k") == [value]
    assert kinds(owner.get("k")) == ["claim/1", "commit/1"]


@pytest.mark.parametrize("step", STEPS, ids=STEP_IDS)
def test_an_owner_whose_wall_clock_is_stepped_keeps_its_claim(
    backend: CacheBackend, provider: Provider, step: float, owned: Any
) -> None:
    """The owner's clock is the stepped one: its wall-clock lease (what an older version
    judges) reads lapsed an hour ago, or live for an hour; the host clock decides."""
    owner = Ledger(stepped(backend, step), lease_s=0.3)
    a = owned(owner, "k", provider)
    b = Ledger(backend, wait_s=5.0, clock=ManualClock())
    with pytest.raises(OperationInProgress):
        b.run("k", lambda: provider.charge("k"), on_stale="retry")
    record = b.get("k")
    assert record is not None and record.lease_expires_at is not None
    assert (record.lease_expires_at < b.backend.now()) == (step < 0)  # what the wall says
    a.finish()
    assert len(provider.effects("k")) == 1
    assert kinds(b.get("k")) == ["claim/1", "commit/1"]


def _plant(
    backend: CacheBackend,
    key: str,
    *,
    wall_left: float,
    host_lease: tuple[str, float] | None,
    owner_host: str = "",
    written: float | None = None,
) -> Record:
    """A PENDING record as another worker left it."""
    now = backend.now()
    at = now if written is None else written
    record = Record(
        key=key, status=Status.PENDING, fingerprint="", token=1, revision=1,
        owner=Owner(owner_host or socket.gethostname(), 4242, "planted"), attempts=1,
        created_at=at, updated_at=at, lease_expires_at=now + wall_left, host_lease=host_lease,
    )  # fmt: skip
    assert backend.insert(record) is None
    return record


@pytest.mark.parametrize("wall_left", [-60.0, 60.0], ids=["wall-lapsed", "wall-live"])
def test_a_record_an_older_version_wrote_is_judged_by_the_wall_clock(
    backend: CacheBackend, provider: Provider, wall_left: float
) -> None:
    _plant(backend, "k", wall_left=wall_left, host_lease=None)
    ledger = Ledger(backend, wait_s=5.0, clock=ManualClock())
    if wall_left > 0:
        with pytest.raises(OperationInProgress):
            ledger.run("k", lambda: provider.charge("k"))
    else:
        with pytest.raises(OutcomeUncertain, match="stopped renewing its lease"):
            ledger.run("k", lambda: provider.charge("k"))
    assert provider.effects() == []


@pytest.mark.parametrize("host_left", [-60.0, 60.0], ids=["host-lapsed", "host-live"])
def test_a_lease_on_this_boot_is_judged_by_the_host_clock_alone(
    backend: CacheBackend, provider: Provider, host_left: float
) -> None:
    """The wall-clock lease says the opposite of the host's each time: the host wins."""
    host = backend.host_clock
    assert host is not None
    _plant(backend, "k", wall_left=-host_left, host_lease=(host.boot, host.running() + host_left))
    ledger = Ledger(backend, wait_s=5.0, clock=ManualClock())
    if host_left > 0:
        with pytest.raises(OperationInProgress):
            ledger.run("k", lambda: provider.charge("k"))
        assert provider.effects() == []
    else:
        assert ledger.run("k", lambda: provider.charge("k"), on_stale="retry")
        assert kinds(ledger.get("k")) == ["takeover/2", "commit/2"]  # planted: no history
        assert len(provider.effects("k")) == 1


@pytest.mark.parametrize("policy", ["uncertain", "retry"])
def test_a_lease_written_under_another_boot_of_this_host_reads_as_lapsed(
    backend: CacheBackend, provider: Provider, policy: str
) -> None:
    """The host rebooted under a live claim: the owner died with the boot, whatever its
    wall-clock lease (still live here) or its host-clock deadline (far ahead) say."""
    host = backend.host_clock
    assert host is not None
    _plant(
        backend, "k", wall_left=600.0, host_lease=("an-earlier-boot", host.running() + 600),
        written=host.booted_at() - 5,
    )  # fmt: skip
    ledger = Ledger(backend, wait_s=5.0, clock=ManualClock())
    if policy == "retry":
        ledger.run("k", lambda: provider.charge("k"), on_stale="retry")
        assert len(provider.effects("k")) == 1
        record = ledger.get("k")
        assert kinds(record) == ["takeover/2", "commit/2"]
        assert record is not None and "restarted" in record.history[0].note
    else:
        with pytest.raises(OutcomeUncertain, match="the host restarted"):
            ledger.run("k", lambda: provider.charge("k"))
        assert provider.effects() == []


def test_a_live_lease_from_another_host_fails_closed(
    backend: CacheBackend, provider: Provider
) -> None:
    """Another boot id, another host name, and a wall-clock lease that is live: another
    host is renewing it right now, so the folder is shared between hosts. Nothing runs,
    whatever the policy; once its wall-clock lease lapses it is judged as lapsed."""
    _plant(backend, "k", wall_left=600.0, host_lease=("another-boot", 1e12), owner_host="host-b")
    ledger = Ledger(backend, wait_s=5.0, clock=ManualClock())
    for policy in ("uncertain", "retry"):
        with pytest.raises(LedgerUnavailable, match="shared between hosts") as refused:
            ledger.run("k", lambda: provider.charge("k"), on_stale=policy)  # type: ignore[arg-type]
        assert "host-b:4242:planted" in str(refused.value)
    assert provider.effects() == []

    later = Ledger(stepped(backend, 601.0), wait_s=5.0, clock=ManualClock())
    with pytest.raises(OutcomeUncertain, match="lease expired"):
        later.run("k", lambda: provider.charge("k"))
    assert provider.effects() == []


def test_a_host_deadline_never_outlives_the_wall_clock_deadline_it_was_written_with() -> None:
    record = Record(
        key="k", status=Status.PENDING, fingerprint="", token=1, revision=1, owner=None,
        attempts=1, created_at=1.0, updated_at=1.0, lease_expires_at=31.0, expires_at=None,
        host_lease=("b", 40.0),
    )  # fmt: skip
    assert record.evolve(None, lease_expires_at=61.0).host_lease is None
    assert record.evolve(None, lease_expires_at=61.0, host_lease=("b", 70.0)).host_lease == (
        "b",
        70.0,
    )
    assert record.evolve(None, error="x").host_lease == ("b", 40.0)
    committed = record.evolve(None, status=Status.COMMITTED, expires_at=9.0, host_expires=("b", 9))
    assert committed.evolve(None, expires_at=None).host_expires is None


# -- what older versions read and write ----------------------------------------------------

# The keys version 1 of the record document has always had (Record.to_json of the first
# release): an older reader reads these and ignores the rest.
V1_KEYS = {
    "v", "key", "status", "fingerprint", "token", "revision", "owner", "attempts",
    "created_at", "updated_at", "lease_expires_at", "expires_at", "result", "error",
    "needs_operator", "evidence", "history",
}  # fmt: skip


def test_the_document_stays_version_1_with_optional_keys(backend: CacheBackend) -> None:
    ledger = Ledger(backend, ttl=60.0)
    inside = threading.Event()
    seen: list[dict[str, Any]] = []

    def body() -> str:
        record = backend.get("k")
        assert record is not None
        seen.append(json.loads(record.to_json()))
        inside.set()
        return "ok"

    ledger.run("k", body)
    claim_doc = seen[0]
    committed = backend.get("k")
    assert committed is not None
    commit_doc = json.loads(committed.to_json())
    assert claim_doc["v"] == 1 and commit_doc["v"] == 1
    # The history's chain (ledger/_chain) is one more optional key beside the history.
    assert set(claim_doc) == V1_KEYS | {"host_lease", "chain"}
    assert set(commit_doc) == V1_KEYS | {"host_expires", "chain"}
    host = backend.host_clock
    assert host is not None
    assert claim_doc["host_lease"][0] == host.boot
    assert commit_doc["host_expires"][0] == host.boot

    # What an older version writes back (it drops keys it does not know) reads as a record
    # without host deadlines, judged by the wall clock.
    older = {k: v for k, v in commit_doc.items() if k in V1_KEYS}
    back = Record.from_json(json.dumps(older))
    assert back.host_expires is None and back.host_lease is None
    assert Record.from_json(committed.to_json()) == committed


# -- receipts ------------------------------------------------------------------------------


class Moving:
    """An embedded store whose host clock the test moves (its wall clock via `stepped`)."""

    def __init__(self, backend: CacheBackend) -> None:
        real = backend.host_clock
        assert real is not None
        self.offset = 0.0
        self.backend = backend
        backend.host_clock = FakeHostClock(lambda: real.elapsed() + self.offset, real.boot)


@pytest.fixture
def moving(backend: CacheBackend) -> Moving:
    return Moving(backend)


def _receipt(ledger: Ledger, provider: Provider) -> str:
    return ledger.run("k", lambda: provider.charge("k"))


def test_a_forward_step_never_expires_a_receipt_early(moving: Moving, provider: Provider) -> None:
    first = _receipt(Ledger(moving.backend, ttl=60.0), provider)
    for step in (HOUR, DAY):
        ahead = Ledger(stepped(moving.backend, step), ttl=60.0)
        assert ahead.execute("k", lambda: provider.charge("k")).replayed
        assert ahead.purge() == 0
    assert provider.receipts("k") == [first]


def test_a_backward_step_keeps_a_receipt_until_the_wall_clock_passes_its_ttl(
    moving: Moving, provider: Provider
) -> None:
    first = _receipt(Ledger(moving.backend, ttl=60.0), provider)
    moving.offset = 120.0  # two TTLs of real time have passed: the host clock says so
    behind = Ledger(stepped(moving.backend, -HOUR), ttl=60.0)
    assert behind.execute("k", lambda: provider.charge("k")).replayed  # the wall has not
    assert provider.receipts("k") == [first]


def test_a_receipt_expires_when_both_clocks_say_its_ttl_passed(
    moving: Moving, provider: Provider
) -> None:
    first = _receipt(Ledger(moving.backend, ttl=60.0), provider)
    moving.offset = 61.0
    later = Ledger(stepped(moving.backend, 61.0), ttl=60.0)
    second = later.run("k", lambda: provider.charge("k"))
    assert provider.receipts("k") == [first, second]
    assert kinds(later.get("k"))[-2:] == ["expire/2", "commit/2"]

    moving.offset = 122.0
    assert Ledger(stepped(moving.backend, 122.0)).purge() == 1


def test_a_receipt_from_another_boot_expires_by_the_wall_clock(
    backend: CacheBackend, provider: Provider
) -> None:
    first = _receipt(Ledger(backend, ttl=60.0), provider)
    backend.host_clock = FakeHostClock(lambda: 1.0, "the-next-boot")  # a fresh boot's clock
    assert Ledger(stepped(backend, 30.0)).execute("k", lambda: "x").replayed
    second = Ledger(stepped(backend, 61.0), ttl=60.0).run("k", lambda: provider.charge("k"))
    assert provider.receipts("k") == [first, second]


# -- approval grants -----------------------------------------------------------------------


def _claim() -> Record:
    now = time.time()
    return Record(
        key="k", status=Status.PENDING, fingerprint="fp", token=1, revision=1,
        owner=Owner.current(), attempts=1, created_at=now, updated_at=now,
        lease_expires_at=now + 30,
    )  # fmt: skip


def _authorize(backend: CacheBackend, claim: Record) -> Any:
    return Approvals(backend).authorize(claim, "fp", tool="pay", reason="big", summary={})


@pytest.fixture
def granted(moving: Moving) -> Record:
    claim = _claim()
    with pytest.raises(ApprovalRequired) as asked:
        _authorize(moving.backend, claim)
    Approvals(moving.backend).approve(asked.value.request_id, by="ops", ttl_s=60.0)
    return claim


@pytest.mark.parametrize("step", STEPS, ids=STEP_IDS)
def test_a_grant_lasts_its_ttl_by_the_host_clock_whatever_the_wall_clock(
    moving: Moving, granted: Record, step: float
) -> None:
    if step < 0:  # set back an hour: by the wall the grant has an hour more to go
        moving.offset = 61.0
        with pytest.raises(ApprovalRequired, match="expired"):
            _authorize(stepped(moving.backend, step), granted)
    else:  # set forward: by the wall it expired long ago
        used = _authorize(stepped(moving.backend, step), granted)
        assert used.state is ApprovalState.USED


def test_a_grant_without_a_matching_host_deadline_is_judged_by_the_wall_clock(
    moving: Moving, granted: Record
) -> None:
    moving.backend.host_clock = FakeHostClock(lambda: 0.0, "the-next-boot")
    with pytest.raises(ApprovalRequired, match="expired"):
        _authorize(stepped(moving.backend, 61.0), granted)
    moving.backend.host_clock = FakeHostClock(lambda: 0.0, "the-next-boot")
    request = Approvals(moving.backend).list()[0]
    Approvals(moving.backend).approve(request.id, by="ops", ttl_s=60.0)
    assert _authorize(stepped(moving.backend, 59.0), granted).state is ApprovalState.USED
