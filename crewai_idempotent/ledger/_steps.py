"""What the decisions yield, what a guarded call returns, and the stage before a body.

The decisions (`_machine`) are generators that yield the blocking steps they need and
receive their results: `_Call` a backend, `_Sleep`, `_Park` until news of a key, `_Ask`
a reconciler. The drivers (`Ledger._drive` in the calling thread, `Ledger._adrive` on an
event loop) perform them; a decision never blocks by itself.

A `Stage` (the approval and spend-cap gates) is written the same way: the ledger drives
it between the claim and the body, on the same drivers, pools and clock.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from ._policy import Reconciler
from ._record import Peek, Record, Status
from ._rooms import _Room

if TYPE_CHECKING:
    from ._backend import CacheBackend

T = TypeVar("T")

_MISSING: Any = object()


class Outcome(Generic[T]):
    """What `Ledger.execute` returns: the value, whether it was replayed, and the record.

    A replay from the fast path holds a `Peek` and builds `record` on first access, so a
    caller that wants only the value never pays for decoding the history.
    """

    __slots__ = ("_record", "replayed", "value")

    def __init__(self, value: T, replayed: bool, record: Record | Peek) -> None:
        self.value = value
        self.replayed = replayed
        self._record = record

    @property
    def record(self) -> Record:
        record = self._record
        if type(record) is Peek:
            record = self._record = record.record()
        assert isinstance(record, Record)
        return record

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Outcome):
            return NotImplemented
        mine, theirs = (
            (self.value, self.replayed, self.record),
            (other.value, other.replayed, other.record),
        )
        return mine == theirs

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Outcome(value={self.value!r}, replayed={self.replayed!r}, record={self.record!r})"


class _Call:
    """A backend call. `claims` is the PENDING record the call stores if it succeeds: if
    an async caller is cancelled while it is in flight, a claim that landed is released."""

    __slots__ = ("args", "claims", "fn")

    def __init__(self, fn: Callable[..., Any], *args: Any, claims: Record | None = None) -> None:
        self.fn, self.args, self.claims = fn, args, claims


class _Sleep:
    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class _Park:
    """Wait until the room has news after generation `seen`, or `seconds` pass."""

    __slots__ = ("room", "seconds", "seen")

    def __init__(self, room: _Room, seen: int, seconds: float) -> None:
        self.room, self.seen, self.seconds = room, seen, seconds


class _Ask:
    """Ask a reconciler; `timeout` (seconds, None: no bound) before its answer is Unknown.
    `record`: the record it is asked about (`reconciling()` while it runs)."""

    __slots__ = ("args", "key", "reconcile", "record", "timeout")

    def __init__(
        self,
        reconcile: Reconciler,
        key: str,
        args: Any,
        timeout: float | None = None,
        record: Record | None = None,
    ) -> None:
        self.reconcile, self.key, self.args, self.timeout = reconcile, key, args, timeout
        self.record = record


Step = Generator[_Call | _Sleep | _Park | _Ask, Any, T]


class Swept:
    """What a sweeper's look at one record came to (`_Machine._sweep`).

    `outcome`: "found" (COMMITTED with the reconciler's receipt), "absent" (FAILED: the
    next call runs), "unknown" (still UNCERTAIN, the attempt in its history), "left" (not
    asked now: `reason` says why: no reconciler, backing off), "due" (a dry run: it would
    be asked), "skipped" (not for a sweeper: settled, its owner renews its lease, another
    sweeper is asking, it needs an operator) or "overtaken" (asked, but the record was
    settled or claimed again before the answer could be written: the answer was dropped).
    `record` is the record as the sweeper last wrote or read it.
    """

    __slots__ = ("outcome", "reason", "record")

    def __init__(self, outcome: str, record: Record | None, reason: str = "") -> None:
        self.outcome, self.record, self.reason = outcome, record, reason

    def __repr__(self) -> str:
        return f"Swept({self.outcome!r}, reason={self.reason!r})"


class Settled:
    """How a claim's body ended, as the ledger recorded it: what a `Stage` settles on.

    `status` is what the ledger recorded, or meant to: COMMITTED (the body returned),
    FAILED (it raised an ordinary exception) or UNCERTAIN (its effect may have happened).
    `record` is the record as stored, or None when it could not be stored or another
    owner had taken the claim over; `reason` says why a body failed.
    """

    __slots__ = ("reason", "record", "status")

    def __init__(self, status: Status, record: Record | None, reason: str | None = None) -> None:
        self.status, self.record, self.reason = status, record, reason

    def __repr__(self) -> str:
        return f"Settled({self.status.value}, record={self.record!r}, reason={self.reason!r})"


class Stage(Protocol):
    """What the ledger runs between a durable claim and its body, and after the body.

    `enter` is given the claim (the PENDING record, fencing token and all), the store
    and the ledger's monotonic clock, and returns the steps to drive (a generator that
    yields steps like a decision does, so either driver runs it on the ledger's own pools
    and clock) or None when there is nothing to wait for. Raising, in `enter` or in its
    steps, refuses the call: the ledger records the claim FAILED (the body never started)
    and raises it. What the steps return is handed to `settle` once the body's outcome is
    recorded; `settle` returns steps too (or None), which may write to the store but never
    change that outcome (the ledger logs what they raise).
    """

    def enter(
        self, claim: Record, backend: CacheBackend, monotonic: Callable[[], float]
    ) -> Step[Any] | None: ...

    def settle(
        self, entered: Any, settled: Settled, backend: CacheBackend
    ) -> Step[None] | None: ...
