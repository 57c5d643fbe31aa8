"""The guard: claim a key durably before the body runs, replay its receipt afterwards.

The decisions are written once, as generators that yield the blocking steps they need
(`_Call` a backend, `_Sleep`, `_Park` until news of a key, `_Ask` a reconciler) and
receive their results. Two drivers perform those steps: `_drive` in the calling thread
(`run`, `execute`), and `_adrive` on the event loop (`arun`, `aexecute`), where sleeping
and waiting are `asyncio` waits and backend calls run on the ledger's own bounded thread
pools: one lane for claims and reads, another for commits, so that an owner's commit
never queues behind the claims of its waiters.

Callers of one key in one process meet in a `_Room`: one of them asks the store at a
time (the claim, a poll, a takeover) and publishes what it learnt; the others park until
that news, or until this process commits the key. A thousand waiters cost one poller.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import getpass
import inspect
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from . import _fork
from ._backend import CacheBackend
from ._errors import (
    BodyFailed,
    IdempotencyError,
    IdempotencyKeyConflict,
    LedgerUnavailable,
    OperationInProgress,
    OutcomeUncertain,
    OutcomeUnknown,
    ResolutionRefused,
)
from ._keys import validate_key
from ._reconcile import Absent, Found, Unknown, Verdict
from ._record import _HOST, Event, Owner, Peek, Record, Status
from ._results import decode, encode

log = logging.getLogger("crewai_idempotent")

T = TypeVar("T")
StalePolicy = Literal["uncertain", "reconcile", "retry"]
Reconciler = Callable[[str, Any], Any]
Listener = Callable[[str, Record], None]

_MISSING: Any = object()
_UNKNOWN: Any = object()  # a room whose members have not asked the store yet
# How long a member waits for the one holding its room before looking again; the holder
# wakes it sooner when it learns something or lets go.
_HOLDER_PAUSE = 0.2
# Waiters woken per turn of the event loop: a thousand waiters woken by one commit
# resume a batch at a time, so other work on the loop is never held up for long.
_WAKE_BATCH = 32

# Threads per lane of the async path. Claims and reads share one lane; commits, failures
# and releases get their own, so a crowd of claimants never delays an owner's commit.
# Both are small: a store serialises writes to one key anyway, and server pools are
# sized for a handful of connections per process.
IO_THREADS = 4
SETTLE_THREADS = 2

_current_claim: ContextVar[Record | None] = ContextVar(
    "crewai_idempotent_current_claim", default=None
)


def current_claim() -> Record | None:
    """The claim (PENDING record) whose body is running in this context, if any.

    Set by `Ledger.run`/`arun` around the body, so a body (or an event it emits) can
    name the token it runs under. Each asyncio task sees its own.
    """
    return _current_claim.get()


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


@dataclass(slots=True)  # not frozen: built on every call, and frozen fields cost a call each
class _Options:
    fingerprint: str
    args: Any
    wait_s: float
    lease_s: float
    ttl: float | None
    reconcile: Reconciler | None
    on_stale: StalePolicy


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
    __slots__ = ("args", "key", "reconcile")

    def __init__(self, reconcile: Reconciler, key: str, args: Any) -> None:
        self.reconcile, self.key, self.args = reconcile, key, args


Step = Generator[_Call | _Sleep | _Park | _Ask, Any, T]


class _Claim:
    """A claim this process holds; the lease keeper renews it until `done`."""

    __slots__ = ("by", "done", "due", "lease_s", "lock", "lost", "pid", "record", "ttl")

    def __init__(self, record: Record, options: _Options, by: str | None = None) -> None:
        self.record = record
        # Who the history names for the outcome: the owner, labelled once per claim.
        self.by = by or (record.owner.label if record.owner else _whoami())
        self.lease_s = options.lease_s
        self.ttl = options.ttl
        self.lock = threading.Lock()
        self.done = False
        self.lost = False
        self.due = 0.0
        self.pid = os.getpid()  # a forked child inherits the object, not the claim


class Ledger:
    """Claim-before-execute, replay-after-commit, over any `CacheBackend`.

    `run(key, fn)` runs `fn` at most once per key across threads, processes and (with a
    shared backend) hosts, returning the stored result on every later call. See the
    README for the state machine.
    """

    def __init__(
        self,
        backend: CacheBackend,
        *,
        wait_s: float = 10.0,
        lease_s: float = 30.0,
        ttl: float | None = None,
        on_stale: StalePolicy | None = None,
        listener: Listener | None = None,
        commit_retry_s: float = 10.0,
    ) -> None:
        if not isinstance(backend, CacheBackend):
            raise TypeError(f"backend must be a CacheBackend, not {type(backend).__name__}")
        _check_durations(wait_s=wait_s, lease_s=lease_s, ttl=ttl)
        self.backend = backend
        self.wait_s = wait_s
        self.lease_s = lease_s
        self.ttl = ttl
        self.on_stale = on_stale
        self.commit_retry_s = commit_retry_s
        self._listeners: list[Listener] = [listener] if listener else []
        self._keeper = _LeaseKeeper(backend)
        self._rooms = _Rooms()
        self._lanes = _Lanes()

    def __repr__(self) -> str:
        return f"Ledger({self.backend!r})"

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(kind, record)` on claim, replay, commit, fail, conflict, uncertain…"""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        self._listeners.remove(listener)

    # -- the guard ---------------------------------------------------------------------

    def run(self, key: str, fn: Callable[[], T], **options: Any) -> T:
        """Run `fn()` once for `key`; later calls return its stored result."""
        return self.execute(key, fn, **options).value

    def execute(
        self,
        key: str,
        fn: Callable[[], T],
        *,
        fingerprint: str = "",
        args: Any = None,
        wait_s: float | None = None,
        lease_s: float | None = None,
        ttl: float | None = _MISSING,
        reconcile: Reconciler | None = None,
        on_stale: StalePolicy | None = None,
        wrap_errors: bool = False,
    ) -> Outcome[T]:
        """Like `run`, but says whether the value was replayed and returns the record.

        With `wrap_errors=True` an exception from the body is raised as `BodyFailed`
        (the body's exception is its `__cause__`) carrying how it was recorded.
        """
        validate_key(key)
        options = self._options(fingerprint, args, wait_s, lease_s, ttl, reconcile, on_stale)
        acquired = self._drive(self._acquire(key, options))
        if isinstance(acquired, Outcome):
            return acquired
        claim: _Claim = acquired
        self._keeper.add(claim)
        try:
            token = _current_claim.set(claim.record)
            try:
                value = fn()
            except BaseException as exc:
                failed = self._settle_failure(claim, exc)
                if wrap_errors and isinstance(exc, Exception):
                    raise failed from exc
                raise
            finally:
                _current_claim.reset(token)
            try:
                return self._drive(self._finish(claim, Status.COMMITTED, value=value))
            except LedgerUnavailable:
                return self._unrecorded(claim, value)
        finally:
            self._keeper.remove(claim)

    async def arun(self, key: str, fn: Callable[[], Awaitable[T]], **options: Any) -> T:
        """Async twin of `run`: `fn()` returns an awaitable."""
        return (await self.aexecute(key, fn, **options)).value

    async def aexecute(
        self,
        key: str,
        fn: Callable[[], Awaitable[T]],
        *,
        fingerprint: str = "",
        args: Any = None,
        wait_s: float | None = None,
        lease_s: float | None = None,
        ttl: float | None = _MISSING,
        reconcile: Reconciler | None = None,
        on_stale: StalePolicy | None = None,
        wrap_errors: bool = False,
    ) -> Outcome[T]:
        """Async twin of `execute`. Waiting happens on the event loop; backend calls run on
        this ledger's own small thread pools, never the loop's default executor."""
        validate_key(key)
        options = self._options(fingerprint, args, wait_s, lease_s, ttl, reconcile, on_stale)
        acquired = await self._adrive(self._acquire(key, options), self._lanes.io)
        if isinstance(acquired, Outcome):
            return acquired
        claim: _Claim = acquired
        self._keeper.add(claim)
        try:
            token = _current_claim.set(claim.record)
            try:
                value = await fn()
            except BaseException as exc:
                # Recorded even if this task is cancelled again meanwhile: a cancelled
                # body may have had its effect, and that must not be forgotten.
                failed = await self._unstoppable(self._settle_failure_async(claim, exc))
                if wrap_errors and isinstance(exc, Exception):
                    raise failed from exc
                raise
            finally:
                _current_claim.reset(token)
            finish = self._finish(claim, Status.COMMITTED, value=value)
            try:
                return await self._unstoppable(self._adrive(finish, self._lanes.settle))
            except LedgerUnavailable:
                return self._unrecorded(claim, value)
        finally:
            self._keeper.remove(claim)

    async def _unstoppable(self, work: Awaitable[T]) -> T:
        """Finish `work` (a commit or a failure record) even if the caller is cancelled."""
        task = asyncio.ensure_future(work)
        task.add_done_callback(_observe)
        return await asyncio.shield(task)

    # -- inspection and resolution -----------------------------------------------------

    def get(self, key: str) -> Record | None:
        return self._drive(self._read(key))

    def records(self, status: Status | None = None) -> list[Record]:
        return list(self._drive(self._scan(status)))

    def is_stale(self, record: Record) -> bool:
        """True for a PENDING record whose owner stopped renewing its lease."""
        return record.status is Status.PENDING and not record.lease_live(self.backend.now())

    def resolve(
        self,
        key: str,
        *,
        result: Any = _MISSING,
        absent: bool = False,
        by: str | None = None,
        reason: str = "",
    ) -> Record:
        """Settle an UNCERTAIN (or stale PENDING) record after checking the outside system.

        `result=...` says the operation happened: the record is COMMITTED and `result`
        is replayed from now on. `absent=True` says it did not: the record is FAILED and
        the next attempt runs. Who (`by`) and why (`reason`) are kept in its history.
        """
        if (result is _MISSING) == (not absent):
            raise ValueError("pass exactly one of result=... or absent=True")
        validate_key(key)
        by = by or _whoami()
        return self._drive(self._resolve(key, result, absent, by, reason))

    def purge(self, *, expired_only: bool = True) -> int:
        """Delete COMMITTED records whose TTL has passed (or, with expired_only=False,
        every COMMITTED and FAILED record). UNCERTAIN and PENDING records are never purged."""
        removed = 0
        now = self.backend.now()
        for record in self.records():
            keep = record.status in (Status.PENDING, Status.UNCERTAIN) or (
                expired_only and not record.expired(now)
            )
            if not keep and self._drive(self._delete(record)):
                removed += 1
        return removed

    def close(self) -> None:
        self._lanes.close()
        self.backend.close()

    # -- decisions ---------------------------------------------------------------------

    def _options(
        self,
        fingerprint: str,
        args: Any,
        wait_s: float | None,
        lease_s: float | None,
        ttl: float | None,
        reconcile: Reconciler | None,
        on_stale: StalePolicy | None,
    ) -> _Options:
        if wait_s is None and lease_s is None and ttl is _MISSING:
            wait_s, lease_s, ttl = self.wait_s, self.lease_s, self.ttl  # checked in __init__
        else:
            wait_s = self.wait_s if wait_s is None else wait_s
            lease_s = self.lease_s if lease_s is None else lease_s
            ttl = self.ttl if ttl is _MISSING else ttl
            _check_durations(wait_s=wait_s, lease_s=lease_s, ttl=ttl)
        policy = on_stale or self.on_stale or ("reconcile" if reconcile else "uncertain")
        if policy not in ("uncertain", "reconcile", "retry"):
            raise ValueError(
                f"on_stale must be 'uncertain', 'reconcile' or 'retry', not {policy!r}"
            )
        if policy == "reconcile" and reconcile is None:
            raise ValueError("on_stale='reconcile' needs a reconcile= callable")
        if not isinstance(fingerprint, str):
            raise TypeError("fingerprint must be a str (see crewai_idempotent.fingerprint)")
        return _Options(fingerprint, args, wait_s, lease_s, ttl, reconcile, policy)

    def _acquire(self, key: str, o: _Options) -> Step[_Claim | Outcome[Any]]:
        peeked: Peek | None = None
        if self.backend.read_first:
            # A replay is a read: no write lock, no claim record, no room, and only the
            # result decoded. Anything else goes the full way below, which decides (and
            # writes) with the whole record.
            peeked = yield _Call(self.backend.peek, key)
            if peeked is not None and peeked.replayable(o.fingerprint, self.backend.now()):
                if self._listeners:
                    self._emit("replay", peeked.record())
                return Outcome(decode(peeked.result), True, peeked)
        rooms = self._rooms
        # Nothing known of the key: the first caller in the room holds it from the start
        # and claims (what _acquire_in would do, with half the trips through the lock).
        room, holding = rooms.enter(key, hold=peeked is None)
        me = object()
        try:
            if holding:
                try:
                    claim = yield from self._claim(room, o)
                finally:
                    rooms.release(room)
                if claim is not None:
                    return claim
            elif peeked is not None:
                rooms.publish(key, peeked.record(), read=True)  # spares a failing claim
            return (yield from self._acquire_in(room, o, me))
        finally:
            rooms.leave(room, me)

    def _acquire_in(self, room: _Room, o: _Options, me: object) -> Step[_Claim | Outcome[Any]]:
        """Judge the latest news of the key; to learn more or to act, hold the room.

        Only the member holding the room talks to the store; every write it makes and
        every record it reads is published to the room, so the other members judge the
        same record without asking the store themselves.
        """
        rooms, key = self._rooms, room.key
        started = time.monotonic()
        seen, held = rooms.news(room)
        while True:
            if held is _UNKNOWN:
                if not rooms.hold(room, seen):
                    yield _Park(room, seen, _HOLDER_PAUSE)
                    seen, held = self._catch_up(room, seen, held)
                    continue
                try:
                    if room.latest is _UNKNOWN or room.latest is None:
                        claim = yield from self._claim(room, o)
                        if claim is not None:
                            return claim
                    else:
                        try:
                            found = yield _Call(self.backend.get, key)
                        except LedgerUnavailable as exc:
                            rooms.publish_error(key, exc)
                            raise
                        rooms.publish(key, found, read=True)
                finally:
                    rooms.release(room)
                seen, held = rooms.news(room)
                continue

            now = self.backend.now()
            status = held.status if held is not None else None
            if held is not None and status is not Status.PENDING and status is not Status.FAILED:
                if status is Status.COMMITTED and not held.expired(now):
                    self._check_fingerprint(held, o)
                    self._emit("replay", held)
                    return Outcome(held.value(), True, held)
                if status is Status.UNCERTAIN:
                    self._check_fingerprint(held, o)
                    if o.reconcile is None or held.needs_operator:
                        self._emit("uncertain", held)
                        raise OutcomeUncertain(key, held, held.error or "the outcome is unknown")
            if held is not None and status is Status.PENDING and held.lease_live(now):
                self._check_fingerprint(held, o)
                waited = time.monotonic() - started
                if waited >= o.wait_s:
                    self._emit("in_progress", held)
                    raise OperationInProgress(key, held, waited)
                lease_left = (held.lease_expires_at or now) - now
                if rooms.hold(room, seen):
                    # This member polls for everyone; news from this process (the
                    # owner's commit) ends the pause early and spares the read.
                    room.poller = me
                    polled = False
                    try:
                        pause = min(room.delay, o.wait_s - waited, lease_left + 0.001)
                        yield _Park(room, seen, pause)
                        if rooms.news(room)[0] == seen:
                            room.delay = min(room.delay * 2, 0.2)
                            try:
                                found = yield _Call(self.backend.get, key)
                            except LedgerUnavailable as exc:
                                rooms.publish_error(key, exc)
                                raise
                            rooms.publish(key, found, read=True)
                        polled = True
                    finally:
                        rooms.release(room, wake=not polled)
                    seen, held = rooms.news(room)
                else:  # woken by news, or when the poller leaves
                    yield _Park(room, seen, min(o.wait_s - waited, lease_left + 0.001))
                    seen, held = self._catch_up(room, seen, held)
                continue

            # Every other state needs a write: one member at a time makes it.
            if status is Status.PENDING:
                self._check_fingerprint(held, o)
            if not rooms.hold(room, seen):
                yield _Park(room, seen, _HOLDER_PAUSE)
                seen, held = self._catch_up(room, seen, held)
                continue
            try:
                answer = yield from self._act(room, held, o, now)
                if answer is not None:
                    return answer
                if rooms.news(room)[0] == seen:  # lost a race and learnt nothing: look
                    found = yield _Call(self.backend.get, key)
                    rooms.publish(key, found, read=True)
            except LedgerUnavailable as exc:
                rooms.publish_error(key, exc)
                raise
            finally:
                rooms.release(room)
            seen, held = rooms.news(room)

    def _catch_up(self, room: _Room, seen: int, held: Any) -> tuple[int, Any]:
        """After a pause: the room's news if there is any, else what this member knew."""
        generation, latest = self._rooms.news(room)
        if generation == seen:
            return seen, held
        error = room.error
        if error is not None and latest is _UNKNOWN:
            raise LedgerUnavailable(error.message) from error
        return generation, latest

    def _claim(self, room: _Room, o: _Options) -> Step[_Claim | None]:
        """Insert the claim; None (with the holder published) if the key is taken."""
        now = self.backend.now()
        owner = Owner.current()
        label = owner.label
        record = Record(
            room.key, Status.PENDING, o.fingerprint, 1, 1, owner, 1, now, now, now + o.lease_s,
            None, None, None, False, (), (Event(now, "claim", 1, label),),
        )  # fmt: skip
        try:
            holder = yield _Call(self.backend.insert, record, claims=record)
        except LedgerUnavailable as exc:
            self._rooms.publish_error(room.key, exc)
            yield from self._release_unanswered(record)
            raise
        if holder is None:
            self._rooms.publish(room.key, record)
            self._emit("claim", record)
            return _Claim(record, o, label)
        self._rooms.publish(room.key, holder, read=True)
        return None

    def _act(
        self, room: _Room, held: Record | None, o: _Options, now: float
    ) -> Step[_Claim | Outcome[Any] | None]:
        """The write a record calls for; None if another writer got there first."""
        if held is None:
            return (yield from self._claim(room, o))
        status = held.status
        if status is Status.COMMITTED:  # expired
            return (yield from self._take_over(held, o, "expire", "TTL passed; new operation"))
        if status is Status.FAILED:
            return (yield from self._take_over(held, o, "takeover", "previous attempt failed"))
        if status is Status.UNCERTAIN:  # with a reconciler
            return (yield from self._reconcile(held, o, "uncertain"))
        # PENDING whose owner stopped renewing the lease
        lapse = f"lease expired {now - (held.lease_expires_at or now):.1f} s ago"
        if o.on_stale == "retry":
            return (yield from self._take_over(held, o, "takeover", f"{lapse}; on_stale=retry"))
        if o.on_stale == "reconcile":
            return (yield from self._reconcile(held, o, lapse))
        yield from self._mark_uncertain(
            held,
            f"its owner {_label(held)} stopped renewing its lease ({lapse}) "
            "before committing: the effect may or may not have happened",
        )
        return None

    def _release_unanswered(self, record: Record) -> Step[None]:
        """The store failed to answer a claim that may nonetheless have landed. The body
        never started, so if the claim is there it is released as FAILED rather than left
        to lapse into an uncertain record."""
        try:
            held = yield _Call(self.backend.get, record.key)
            if held is None or held.owner != record.owner or held.token != record.token:
                return
            now = self.backend.now()
            note = "the store did not answer the claim; the body never started"
            released = held.evolve(
                Event(now, "fail", held.token, _label(held), note),
                status=Status.FAILED, error=note, updated_at=now, lease_expires_at=None,
            )  # fmt: skip
            if (yield _Call(self.backend.replace, held, released)):
                self._rooms.publish(released.key, released)
        except LedgerUnavailable:
            pass  # still unreachable: a claim that landed lapses and is treated as stale

    def _check_fingerprint(self, held: Record, o: _Options) -> None:
        if held.fingerprint != o.fingerprint:
            self._emit("conflict", held)
            raise IdempotencyKeyConflict(held.key, held.fingerprint, o.fingerprint)

    def _take_over(self, held: Record, o: _Options, kind: str, note: str) -> Step[_Claim | None]:
        now = self.backend.now()
        owner = Owner.current()
        token = held.token + 1
        new = held.evolve(
            Event(now, kind, token, owner.label, note),
            status=Status.PENDING,
            fingerprint=o.fingerprint,
            token=token,
            owner=owner,
            attempts=1 if kind == "expire" else held.attempts + 1,
            updated_at=now,
            lease_expires_at=now + o.lease_s,
            expires_at=None,
            result=None,
            error=None,
        )
        if (yield _Call(self.backend.replace, held, new, claims=new)):
            self._rooms.publish(new.key, new)
            self._emit("claim", new)
            return _Claim(new, o)
        return None

    def _mark_uncertain(self, held: Record, reason: str) -> Step[None]:
        now = self.backend.now()
        new = held.evolve(
            Event(now, "uncertain", held.token, _this_process(), reason),
            status=Status.UNCERTAIN,
            updated_at=now,
            lease_expires_at=None,
            error=reason,
        )
        if (yield _Call(self.backend.replace, held, new)):
            self._rooms.publish(new.key, new)
            self._emit("uncertain", new)
            raise OutcomeUncertain(held.key, new, reason)

    def _reconcile(self, held: Record, o: _Options, why: str) -> Step[Outcome[Any] | _Claim | None]:
        assert o.reconcile is not None
        verdict = yield _Ask(o.reconcile, held.key, o.args)
        now = self.backend.now()
        if isinstance(verdict, Found):
            new = held.evolve(
                Event(now, "reconcile", held.token, _this_process(), f"{why}; reconciler found it"),
                status=Status.COMMITTED,
                updated_at=now,
                lease_expires_at=None,
                expires_at=now + o.ttl if o.ttl else None,
                result=encode(verdict.result),
                error=None,
            )
            if (yield _Call(self.backend.replace, held, new)):
                self._rooms.publish(new.key, new)
                self._emit("reconciled", new)
                return Outcome(verdict.result, True, new)
            return None
        if isinstance(verdict, Absent):
            return (yield from self._take_over(held, o, "takeover", f"{why}; reconciler: absent"))
        assert isinstance(verdict, Unknown)
        yield from self._mark_uncertain(held, f"{why}; {verdict.reason}")
        return None

    def _unrecorded(self, claim: _Claim, value: Any) -> Outcome[Any]:
        # The effect happened and its receipt is in hand, so the caller gets it. The record
        # stays PENDING; once its lease lapses the next attempt sees an unknown outcome and
        # reconciles or stops, which is the truth: the ledger cannot prove this commit.
        log.error(
            "the body of %r ran but its commit could not be stored; the record stays PENDING "
            "and becomes uncertain when its lease lapses",
            claim.record.key,
            exc_info=True,
        )
        return Outcome(value, False, claim.record)

    def _settle_failure(self, claim: _Claim, exc: BaseException) -> BodyFailed:
        status, reason = classify_failure(exc)
        try:
            outcome = self._drive(self._finish(claim, status, reason=reason))
        except Exception as error:  # noqa: BLE001 - the body's own exception is raised
            return self._unsettled(claim, status, reason, error)
        return BodyFailed(claim.record.key, status, reason, _settled(outcome, status))

    async def _settle_failure_async(self, claim: _Claim, exc: BaseException) -> BodyFailed:
        status, reason = classify_failure(exc)
        try:
            outcome = await self._adrive(
                self._finish(claim, status, reason=reason), self._lanes.settle
            )
        except Exception as error:  # noqa: BLE001 - the body's own exception is raised
            return self._unsettled(claim, status, reason, error)
        return BodyFailed(claim.record.key, status, reason, _settled(outcome, status))

    def _unsettled(
        self, claim: _Claim, status: Status, reason: str, error: Exception
    ) -> BodyFailed:
        log.error("could not record %s for %r", status, claim.record.key, exc_info=error)
        record = error.record if isinstance(error, OutcomeUncertain) else None
        return BodyFailed(claim.record.key, status, reason, record)

    def _finish(
        self, claim: _Claim, status: Status, *, value: Any = _MISSING, reason: str | None = None
    ) -> Step[Outcome[Any]]:
        if claim.pid != os.getpid():
            # A child forked while the body ran: the claim is its parent's to settle.
            raise LedgerUnavailable(
                f"the claim on {claim.record.key!r} belongs to process {claim.pid}, which "
                f"forked this one ({os.getpid()}); only its owner records its outcome"
            )
        with claim.lock:  # no renewal may write after this point
            claim.done = True
            current = claim.record
        now = self.backend.now()
        owner = claim.by
        if status is Status.COMMITTED:
            payload = encode(value)
            kind = "commit"
            new = current.settled(
                Event(now, kind, current.token, owner, ""),
                status,
                now,
                result=payload,
                expires_at=now + claim.ttl if claim.ttl else None,
            )
        else:
            payload = None
            kind = "fail" if status is Status.FAILED else "uncertain"
            new = current.settled(
                Event(now, kind, current.token, owner, reason or ""),
                status,
                now,
                error=reason,
                expires_at=current.expires_at,
            )
        deadline = time.monotonic() + self.commit_retry_s
        delay = 0.05
        while True:
            try:
                stored = yield _Call(self.backend.replace, current, new)
                break
            except LedgerUnavailable:
                # Keep trying for a while; past that the record stays PENDING, its lease
                # lapses, and the next attempt treats it as uncertain (never a blind re-run).
                if time.monotonic() + delay > deadline:
                    raise
                log.warning(
                    "ledger unavailable while recording %s for %r; retrying", kind, current.key
                )
                yield _Sleep(delay)
                delay = min(delay * 2, 1.0)
        if stored:
            self._rooms.publish(new.key, new)
            self._emit(kind, new)
            return Outcome(value, False, new)
        if status is Status.FAILED:
            log.warning("claim on %r was taken over while its body failed", current.key)
            return Outcome(None, False, current)
        try:
            settled = yield from self._fenced(current, kind, payload, reason)
        except LedgerUnavailable as exc:
            raise OutcomeUncertain(
                current.key, None, f"the claim was taken over and the ledger is unavailable: {exc}"
            ) from exc
        return Outcome(value, False, settled)

    def _fenced(self, mine: Record, kind: str, payload: Any, reason: str | None) -> Step[Record]:
        """Our commit was refused: someone else wrote the record while our body ran.

        If the token is still ours, nobody took the claim over: a reconciler or an operator
        committed it from this very execution while we were slow. One execution happened;
        the record stays COMMITTED (a differing receipt of ours is kept as evidence) and the
        settled record is returned. Otherwise two executions may have happened: the record
        becomes UNCERTAIN with needs_operator, and OutcomeUncertain is raised.
        """
        note = (
            f"worker {_label(mine)} (token {mine.token}) finished ({kind}) after its claim was "
            "taken over: two executions may have happened"
        )
        evidence = {
            "token": mine.token,
            "owner": _label(mine),
            "outcome": kind,
            "result": payload,
            "error": reason,
            "at": self.backend.now(),
        }
        while True:
            held = yield _Call(self.backend.get, mine.key)
            now = self.backend.now()
            if held is not None and held.token == mine.token and not held.needs_operator:
                settled = yield from self._late(held, mine, kind, payload, reason, evidence, now)
                if settled is not None:
                    return settled
                continue
            if held is None:
                new = mine.evolve(
                    Event(now, "fenced", mine.token, _label(mine), note),
                    status=Status.UNCERTAIN, updated_at=now, lease_expires_at=None,
                    error=note, needs_operator=True, evidence=(*mine.evidence, evidence),
                )  # fmt: skip
                if (yield _Call(self.backend.insert, new)) is None:
                    self._rooms.publish(new.key, new)
                    break
                continue
            new = held.evolve(
                Event(now, "fenced", held.token, _label(mine), note),
                status=Status.UNCERTAIN, updated_at=now, lease_expires_at=None,
                error=note, needs_operator=True, evidence=(*held.evidence, evidence),
            )  # fmt: skip
            if (yield _Call(self.backend.replace, held, new)):
                self._rooms.publish(new.key, new)
                break
        self._emit("uncertain", new)
        raise OutcomeUncertain(mine.key, new, note)

    def _late(
        self,
        held: Record,
        mine: Record,
        kind: str,
        payload: Any,
        reason: str | None,
        evidence: dict[str, Any],
        now: float,
    ) -> Step[Record | None]:
        """The token is still ours: one execution happened, and this owner knows its outcome.

        Someone settled the record while this execution was slow (a reconciler found it, an
        operator resolved it, a retry marked the lapsed claim uncertain). What the owner
        saw is the best evidence there is, so it wins unless it disagrees with a receipt.
        """
        if held.status is Status.COMMITTED:
            if kind != "commit" or held.result == payload:
                return held
            late = "late commit of the same execution with a different receipt (evidence)"
            new = held.evolve(
                Event(now, "late", held.token, _label(mine), late),
                evidence=(*held.evidence, evidence),
            )
        elif kind == "commit":
            note = f"late commit: the owner finished after the record became {held.status}"
            new = held.evolve(
                Event(now, "commit", held.token, _label(mine), note),
                status=Status.COMMITTED, result=payload, error=None, updated_at=now,
                lease_expires_at=None, evidence=(*held.evidence, evidence),
            )  # fmt: skip
        elif held.status is Status.UNCERTAIN:
            return held
        else:
            new = held.evolve(
                Event(now, "uncertain", held.token, _label(mine), reason or ""),
                status=Status.UNCERTAIN, error=reason, updated_at=now, lease_expires_at=None,
            )  # fmt: skip
        if (yield _Call(self.backend.replace, held, new)):
            self._rooms.publish(new.key, new)
            self._emit("commit" if new.status is Status.COMMITTED else "uncertain", new)
            return new
        return None

    def _resolve(self, key: str, result: Any, absent: bool, by: str, reason: str) -> Step[Record]:
        while True:
            held = yield _Call(self.backend.get, key)
            if held is None:
                raise ResolutionRefused(f"no record for idempotency key {key!r}")
            now = self.backend.now()
            stale = held.status is Status.PENDING and not held.lease_live(now)
            if held.status is not Status.UNCERTAIN and not stale:
                raise ResolutionRefused(
                    f"idempotency key {key!r} is {held.status}"
                    + (" with a live lease" if held.status is Status.PENDING else "")
                    + "; only UNCERTAIN records, or PENDING ones whose lease expired, are resolved"
                )
            verdict = "absent" if absent else "happened"
            event = Event(now, "resolve", held.token, by, f"{verdict}: {reason}".rstrip(": "))
            if absent:
                new = held.evolve(
                    event, status=Status.FAILED, updated_at=now, lease_expires_at=None,
                    error=f"resolved absent by {by}: {reason}", needs_operator=False,
                )  # fmt: skip
            else:
                new = held.evolve(
                    event, status=Status.COMMITTED, updated_at=now, lease_expires_at=None,
                    result=encode(result), error=None, needs_operator=False,
                    expires_at=now + self.ttl if self.ttl else None,  # as a commit would
                )  # fmt: skip
            if (yield _Call(self.backend.replace, held, new)):
                self._rooms.publish(new.key, new)
                self._emit("resolve", new)
                return new

    def _read(self, key: str) -> Step[Record | None]:
        return (yield _Call(self.backend.get, key))

    def _scan(self, status: Status | None) -> Step[Any]:
        return (yield _Call(lambda: list(self.backend.scan(status))))

    def _delete(self, record: Record) -> Step[bool]:
        deleted = yield _Call(self.backend.delete, record)
        if deleted:
            self._rooms.publish(record.key, None)
        return bool(deleted)

    def _release_unstarted(self, claim: Record) -> Step[None]:
        # The body never started, so nothing can have happened: FAILED lets the next
        # attempt run (a CancelledError from inside a body would make it UNCERTAIN).
        note = "cancelled before the body started"
        now = self.backend.now()
        released = claim.evolve(
            Event(now, "fail", claim.token, _label(claim), note),
            status=Status.FAILED, error=note, updated_at=now, lease_expires_at=None,
        )  # fmt: skip
        if (yield _Call(self.backend.replace, claim, released)):
            self._rooms.publish(claim.key, released)
            self._emit("fail", released)

    # -- performing the steps ----------------------------------------------------------

    def _drive(self, steps: Step[T]) -> T:
        """Perform the steps in this thread."""
        reply: Any = None
        error: BaseException | None = None
        try:
            while True:
                try:
                    step = steps.send(reply) if error is None else steps.throw(error)
                except StopIteration as stop:
                    return stop.value
                reply = error = None
                if type(step) is _Call:
                    try:
                        reply = step.fn(*step.args)
                    except IdempotencyError as exc:
                        error = exc
                    except Exception as exc:  # noqa: BLE001 - fail closed on anything a store raises
                        error = self._unavailable(exc)
                elif type(step) is _Park:
                    self._rooms.park(step.room, step.seen, step.seconds)
                elif type(step) is _Sleep:
                    time.sleep(max(step.seconds, 0.0))
                else:
                    assert type(step) is _Ask
                    reply = _ask(step)
        finally:
            steps.close()  # a member that leaves early still leaves its room

    async def _adrive(self, steps: Step[T], lane: Callable[[], concurrent.futures.Executor]) -> T:
        """Perform the steps on the event loop: waits are asyncio waits, backend calls run
        on `lane`, one of this ledger's thread pools."""
        backend = self.backend
        reply: Any = None
        error: BaseException | None = None
        try:
            while True:
                if backend.now_blocks():
                    # Decisions read the store's clock; a server clock that needs a round
                    # trip is read on the lane, not on the loop.
                    try:
                        await asyncio.wrap_future(lane().submit(backend.now))
                    except IdempotencyError:
                        raise
                    except Exception as exc:
                        raise self._unavailable(exc) from exc
                try:
                    step = steps.send(reply) if error is None else steps.throw(error)
                except StopIteration as stop:
                    return stop.value
                reply = error = None
                if type(step) is _Call:
                    try:
                        reply = await self._acall(step, lane)
                    except IdempotencyError as exc:
                        error = exc
                    except Exception as exc:  # noqa: BLE001 - fail closed on anything a store raises
                        error = self._unavailable(exc)
                elif type(step) is _Park:
                    await self._rooms.apark(step.room, step.seen, step.seconds)
                elif type(step) is _Sleep:
                    await asyncio.sleep(max(step.seconds, 0.0))
                else:
                    assert type(step) is _Ask
                    reply = await _aask(step, self._lanes.io)
        finally:
            steps.close()

    async def _acall(self, step: _Call, lane: Callable[[], concurrent.futures.Executor]) -> Any:
        future = lane().submit(step.fn, *step.args)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if step.claims is not None:
                # The claim may land after this task is gone: release it then.
                future.add_done_callback(lambda done: self._release_landed(step, done))
            raise

    def _release_landed(self, step: _Call, done: concurrent.futures.Future[Any]) -> None:
        if done.cancelled() or done.exception() is not None:
            return  # it never ran, or it did not store anything we know of
        claim = step.claims
        assert claim is not None
        inserted = step.args[0] is claim
        if (done.result() is None) if inserted else (done.result() is True):
            self._lanes.settle().submit(self._release_quietly, claim)

    def _release_quietly(self, claim: Record) -> None:
        try:
            self._drive(self._release_unstarted(claim))
        except Exception:  # the caller is gone; the lease lapses and the next one decides
            log.exception("could not release the unstarted claim on %r", claim.key)

    def _unavailable(self, exc: Exception) -> LedgerUnavailable:
        error = LedgerUnavailable(f"{self.backend!r}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error

    def _emit(self, kind: str, record: Record) -> None:
        if not self._listeners:
            return
        for listener in self._listeners:
            try:
                listener(kind, record)
            except Exception:
                log.exception("idempotency listener %r failed on %s", listener, kind)


class _LockedAcrossFork:
    """Fork hooks for an object whose state `_lock` guards: the lock is held across fork(),
    so the child copies that state whole, never mid-change. The child gets a new lock and
    forgets what belongs to the parent's threads (`_forget_in_child`)."""

    _lock: threading.Lock

    def before_fork(self) -> None:
        self._lock.acquire()

    def after_fork_in_parent(self) -> None:
        self._lock.release()

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._forget_in_child()

    def _forget_in_child(self) -> None:
        raise NotImplementedError


class _Room:
    """The callers of one key in one process (threads and tasks alike), and what they
    last learnt about it. Guarded by the `_Rooms` lock."""

    __slots__ = (
        "delay", "error", "event", "futures", "generation", "held", "held_at", "key",
        "latest", "members", "poller",
    )  # fmt: skip

    def __init__(self, key: str) -> None:
        self.key = key
        self.latest: Any = _UNKNOWN  # the newest record known here (None: absent)
        self.error: LedgerUnavailable | None = None  # the last answer was this failure
        self.generation = 0  # grows with every piece of news
        self.held = False  # a member is asking the store or writing
        self.held_at = 0
        self.members = 0
        self.poller: object | None = None  # the member that polls the store for the others
        self.delay = 0.002  # the poller's pause; doubles up to 0.2 s
        self.event: threading.Event | None = None  # parked threads
        self.futures: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}


class _Rooms(_LockedAcrossFork):
    """One room per key with callers waiting in this process; none when nobody waits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rooms: dict[str, _Room] = {}
        _fork.register(self)

    def __len__(self) -> int:
        return len(self._rooms)

    def enter(self, key: str, *, hold: bool = False) -> tuple[_Room, bool]:
        """The key's room, and whether this member holds it: with `hold`, the member
        that opens a new room holds it at once."""
        with self._lock:
            room = self._rooms.get(key)
            holding = False
            if room is None:
                room = self._rooms[key] = _Room(key)
                if hold:
                    room.held, room.held_at, holding = True, room.generation, True
            room.members += 1
            return room, holding

    def leave(self, room: _Room, member: object) -> None:
        with self._lock:
            room.members -= 1
            if room.members <= 0:
                if self._rooms.get(room.key) is room:
                    del self._rooms[room.key]
            elif room.poller is member:
                room.poller = None
                self._wake(room)  # the others need a new poller

    def news(self, room: _Room) -> tuple[int, Any]:
        with self._lock:
            return room.generation, room.latest

    def hold(self, room: _Room, seen: int) -> bool:
        """Become the member that talks to the store, unless one is or news came in."""
        with self._lock:
            if room.held or room.generation != seen:
                return False
            room.held, room.held_at = True, room.generation
            return True

    def release(self, room: _Room, *, wake: bool = True) -> None:
        with self._lock:
            room.held = False
            if wake and room.generation == room.held_at:
                self._wake(room)  # nothing learnt: a parked member takes over

    def publish(self, key: str, record: Record | None, *, read: bool = False) -> None:
        """News of `key`: a record this process wrote (or read, or None: absent)."""
        if key not in self._rooms:
            # Nobody waits on the key. One who enters after this look has a new room
            # and asks the store, which already holds what this news would say.
            return
        with self._lock:
            room = self._rooms.get(key)
            if room is None:
                return
            known = room.latest
            if read and isinstance(known, Record) and record is not None:
                # A read that started before a write of ours must not hide it, and one
                # that saw nothing new is no news.
                if (known.token, known.revision) >= (record.token, record.revision):
                    return
            elif read and known is None and record is None:
                return
            room.latest, room.error = record, None
            self._wake(room)

    def publish_error(self, key: str, error: LedgerUnavailable) -> None:
        with self._lock:
            room = self._rooms.get(key)
            if room is not None:
                room.error = error
                self._wake(room)

    def park(self, room: _Room, seen: int, seconds: float) -> None:
        if seconds <= 0:
            return
        with self._lock:
            if room.generation != seen:
                return
            event = room.event
            if event is None:
                event = room.event = threading.Event()
        event.wait(seconds)

    async def apark(self, room: _Room, seen: int, seconds: float) -> None:
        if seconds <= 0:
            return
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if room.generation != seen:
                return
            room.futures.setdefault(loop, []).append(future)
        timer = loop.call_later(seconds, _resolve, future)
        try:
            await future  # cancelling this task cancels only its own future
        finally:
            timer.cancel()

    def _wake(self, room: _Room) -> None:
        room.generation += 1
        if room.event is not None:
            room.event.set()
            room.event = None
        if room.futures:
            running = asyncio._get_running_loop()
            for loop, futures in room.futures.items():
                if loop is running:
                    _resolve_batches(futures)
                else:
                    with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits
                        loop.call_soon_threadsafe(_resolve_batches, futures)
            room.futures = {}

    def _forget_in_child(self) -> None:
        # The waiters are the parent's threads and tasks; none of them exist here.
        self._rooms = {}


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _resolve_batches(futures: list[asyncio.Future[None]], start: int = 0) -> None:
    end = start + _WAKE_BATCH
    for future in futures[start:end]:
        _resolve(future)
    if end < len(futures):
        asyncio.get_running_loop().call_soon(_resolve_batches, futures, end)


class _Lanes(_LockedAcrossFork):
    """The async path's thread pools, created on first use and again after fork().

    `io` carries claims and reads; `settle` carries commits, failures and releases, so
    an owner's commit never waits behind the claims of a crowd of waiters.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._io: concurrent.futures.ThreadPoolExecutor | None = None
        self._settle: concurrent.futures.ThreadPoolExecutor | None = None
        _fork.register(self)

    def io(self) -> concurrent.futures.ThreadPoolExecutor:
        return self._io or self._make("io", IO_THREADS)

    def settle(self) -> concurrent.futures.ThreadPoolExecutor:
        return self._settle or self._make("settle", SETTLE_THREADS)

    def _make(self, lane: str, threads: int) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            pool: concurrent.futures.ThreadPoolExecutor | None = getattr(self, f"_{lane}")
            if pool is None:
                pool = concurrent.futures.ThreadPoolExecutor(
                    threads, thread_name_prefix=f"crewai-idempotent-{lane}"
                )
                setattr(self, f"_{lane}", pool)
            return pool

    def close(self) -> None:
        with self._lock:
            pools, self._io, self._settle = (self._io, self._settle), None, None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=False)

    def _forget_in_child(self) -> None:
        # The pools' threads stayed in the parent; dropped, never shut down from here.
        self._io = self._settle = None


class _LeaseKeeper(_LockedAcrossFork):
    """One daemon thread per ledger that renews the leases of the claims this process runs.

    Across fork() the child starts with an empty table: the claims are the parent's, and
    renewing them from the child would keep a dead parent's claim alive as long as the
    child lives. The child's own claims start the child's own thread.
    """

    def __init__(self, backend: CacheBackend) -> None:
        self._backend = backend
        self._claims: dict[int, _Claim] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        _fork.register(self)

    def add(self, claim: _Claim) -> None:
        claim.due = time.monotonic() + claim.lease_s / 3
        with self._lock:
            self._claims[id(claim)] = claim
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="crewai-idempotent-leases", daemon=True
                )
                self._thread.start()
            elif claim.lease_s < 3.0:
                self._wake.set()

    def remove(self, claim: _Claim) -> None:
        with self._lock:
            self._claims.pop(id(claim), None)

    def claims(self) -> list[Record]:
        """The claims whose leases this process renews."""
        with self._lock:
            return [claim.record for claim in self._claims.values()]

    def _forget_in_child(self) -> None:
        self._claims = {}
        self._wake = threading.Event()
        self._thread = None

    def _loop(self) -> None:
        idle_since = time.monotonic()
        me = threading.current_thread()
        while True:
            with self._lock:
                if self._thread is not me:  # a fork() child's copy of the table
                    return
                claims = list(self._claims.values())
                now = time.monotonic()
                if not claims and now - idle_since > 5.0:
                    self._thread = None
                    return
            if claims:
                idle_since = now
            due = min((c.due for c in claims), default=now + 1.0)
            if due > now:
                self._wake.wait(min(due - now, 1.0))
                self._wake.clear()
                continue
            for claim in claims:
                if claim.due <= time.monotonic():
                    self._renew(claim)

    def _renew(self, claim: _Claim) -> None:
        with claim.lock:
            if claim.done or claim.lost:
                claim.due = float("inf")
                return
            current = claim.record
            try:
                now = self._backend.now()
                new = current.evolve(None, lease_expires_at=now + claim.lease_s, updated_at=now)
                stored = self._backend.replace(current, new)
            except Exception:
                log.warning("could not renew the lease on %r", current.key, exc_info=True)
                claim.due = time.monotonic() + min(1.0, claim.lease_s / 10)
                return
            if stored:
                claim.record = new
                claim.due = time.monotonic() + claim.lease_s / 3
            else:
                claim.lost = True
                claim.due = float("inf")
                log.warning("lease on %r was taken over by another worker", current.key)


def _ask(step: _Ask) -> Verdict:
    """Call a reconciler from the sync path and normalise what it says."""
    try:
        answer = step.reconcile(step.key, step.args)
        if inspect.isawaitable(answer):
            close = getattr(answer, "close", None)
            if close:
                close()
            return Unknown("an async reconciler cannot be used from the sync run()")
    except Exception as exc:  # noqa: BLE001
        return Unknown(f"reconciler raised {type(exc).__name__}: {exc}")
    return _verdict(answer)


async def _aask(step: _Ask, lane: Callable[[], concurrent.futures.Executor]) -> Verdict:
    """Await an async reconciler on the loop; run a sync one on the lane."""
    try:
        if inspect.iscoroutinefunction(step.reconcile):
            answer = await step.reconcile(step.key, step.args)
        else:
            submitted = lane().submit(step.reconcile, step.key, step.args)
            answer = await asyncio.wrap_future(submitted)
            if inspect.isawaitable(answer):
                answer = await answer
    except Exception as exc:  # noqa: BLE001
        return Unknown(f"reconciler raised {type(exc).__name__}: {exc}")
    return _verdict(answer)


def _verdict(answer: Any) -> Verdict:
    if answer is Absent:
        return Absent()
    if answer is Unknown:
        return Unknown()
    if isinstance(answer, Found | Absent | Unknown):
        return answer
    return Unknown(f"reconciler returned {answer!r}, not Found(result), Absent or Unknown")


def _settled(outcome: Outcome[Any], status: Status) -> Record | None:
    """The record a failure was stored as, or None if a takeover got there first."""
    return outcome.record if outcome.record.status is status else None


def _observe(task: asyncio.Future[Any]) -> None:
    # A commit outlives a cancelled caller; its failure is logged where it happens.
    if not task.cancelled() and task.exception() is not None:
        log.debug("ledger write finished after its caller left", exc_info=task.exception())


def classify_failure(exc: BaseException) -> tuple[Status, str]:
    if isinstance(exc, OutcomeUnknown):
        return Status.UNCERTAIN, f"the tool reported an unknown outcome: {exc}"
    if isinstance(exc, TimeoutError | asyncio.CancelledError) or _looks_like_timeout(exc):
        return Status.UNCERTAIN, (
            f"the body was interrupted ({type(exc).__name__}: {exc}); a timeout or "
            "cancellation does not prove the effect did not happen"
        )
    if not isinstance(exc, Exception):
        return Status.UNCERTAIN, f"the body was interrupted by {type(exc).__name__}"
    return Status.FAILED, f"{type(exc).__name__}: {exc}"


def _looks_like_timeout(exc: BaseException) -> bool:
    # HTTP clients' timeouts (requests' ReadTimeout, httpx's TimeoutException, urllib3's
    # ReadTimeoutError) do not subclass TimeoutError; a request that timed out may still
    # have been carried out, so treat them as unknown rather than as a safe failure.
    return any("timeout" in cls.__name__.lower() for cls in type(exc).__mro__)


def _label(record: Record) -> str:
    return record.owner.label if record.owner else "unknown owner"


def _whoami() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        user = "unknown"
    return f"{user}@{_HOST}"


def _this_process() -> str:
    """Who wrote an automatic transition (a stale claim marked uncertain, a reconciliation)."""
    return f"{_whoami()}:{os.getpid()}"


def _check_durations(**values: float | None) -> None:
    for name, value in values.items():
        if value is None and name == "ttl":
            continue
        if not isinstance(value, int | float) or value < 0 or value != value:
            raise ValueError(f"{name} must be a non-negative number of seconds, not {value!r}")
    if (values.get("lease_s") or 0) <= 0:
        raise ValueError("lease_s must be greater than 0")
    if values.get("ttl") == 0:
        raise ValueError("ttl must be more than 0 seconds, or None: receipts that never expire")
