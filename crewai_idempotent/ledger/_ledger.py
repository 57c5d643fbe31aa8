"""The guard: claim a key durably before the body runs, replay its receipt afterwards.

`Ledger` is the public face: `run`/`execute` in the calling thread and `arun`/`aexecute`
on the event loop, and the operator's `get`, `records`, `resolve` and `purge`. What to do
with what the store holds is decided once, in `_machine`, as generators that yield the
blocking steps they need; the two drivers here perform those steps: `_drive` in the
calling thread, `_adrive` on the event loop, where sleeping and waiting are `asyncio`
waits and backend calls run on the ledger's own bounded thread pools (`_rooms._Lanes`).

The sync and async entries (`execute` and `aexecute`, `_drive` and `_adrive`) sit side by
side, each pair on one screen: a difference between the two paths is then visible where
it is made, and they cannot drift apart unnoticed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from .._errors import BodyFailed, IdempotencyError, LedgerUnavailable, OutcomeUncertain
from ..notifications import _incidents
from . import _resolutions
from ._backend import CacheBackend, ledger_option, url_of
from ._keys import validate_key
from ._leases import _Claim, _LeaseKeeper
from ._machine import _Machine
from ._policy import (
    STALE_POLICIES,
    Clock,
    Listener,
    Reconciler,
    StalePolicy,
    _Options,
    check_durations,
    check_reconcile_timeout,
    check_seconds,
    classify_failure,
)
from ._reconcile import aask, ask, named, path_of
from ._record import Record, Status, _whoami
from ._rooms import _Lanes, _Rooms
from ._select import Order, Select
from ._steps import _MISSING, Outcome, Settled, Stage, Step, _Ask, _Call, _Park, _Sleep

if TYPE_CHECKING:
    from ..signing._keyfile import Signer
    from ..signing._trusted import TrustedKeys

# Names other modules import from here: the guard's public face in one place.
__all__ = [
    "Clock",
    "Ledger",
    "LedgerStats",
    "Listener",
    "Outcome",
    "Reconciler",
    "Settled",
    "Stage",
    "StalePolicy",
    "classify_failure",
    "current_claim",
    "streamed",
]

log = logging.getLogger("crewai_idempotent")

T = TypeVar("T")

_current_claim: ContextVar[Record | None] = ContextVar(
    "crewai_idempotent_current_claim", default=None
)


def current_claim() -> Record | None:
    """The claim (PENDING record) whose body is running in this context, if any.

    Set by `Ledger.run`/`arun` around the body, so a body (or an event it emits) can
    name the token it runs under. Each asyncio task sees its own.
    """
    return _current_claim.get()


@dataclass(frozen=True, slots=True)
class LedgerStats:
    """What a ledger holds in this process right now (`Ledger.stats()`).

    `rooms`: the keys that callers in this process are claiming or waiting on, one room
    per key (0 once every call has returned). `held`: the keys whose claims this process
    holds while their bodies run, whose leases it renews (a forked child starts with none:
    its parent's claims are not its own).
    """

    rooms: int
    held: tuple[str, ...]


class Ledger(_Machine):
    """Claim-before-execute, replay-after-commit, over any `CacheBackend`.

    `run(key, fn)` runs `fn` at most once per key across threads, processes and (with a
    shared backend) hosts, returning the stored result on every later call. See the
    README for the state machine.

    `backend` is the store the records live in. The defaults of every call (each call may
    give its own): `wait_s`, how long a call waits for another worker's live claim before
    `OperationInProgress`; `lease_s`, how long a claim lives without a renewal (renewed
    every `lease_s / 3` while its body runs); `ttl`, how long a receipt replays (None: for
    ever); `on_stale`, what a lapsed lease gets ("uncertain", "reconcile" or "retry"; by
    default "reconcile" when a call has a reconciler, else "uncertain").

    `listener(kind, record)` is called on every claim, replay, commit, failure, conflict
    and uncertain outcome (more with `add_listener`). `commit_retry_s` is how long a
    commit is retried while the store is down before the record is left PENDING.

    `clock` (a `_policy.Clock`) measures this ledger's waits: `wait_s` on a live claim,
    the pauses between polls and between commit retries, the lease keeper's schedule, and
    a sync call's wait for its reconciler. Tests and simulations give one they move; by
    default `time.monotonic` and `time.sleep`, looked up once, here.

    `reconcile_timeout_s` bounds how long a call waits for its reconciler's answer; past
    it the answer is `Unknown` (the record turns UNCERTAIN) and a late one is ignored.
    None waits without bound.

    `trusted_keys` (`signing.TrustedKeys`, also a settable attribute): the keys a
    resolution must be signed with before it is obeyed. With them, a FAILED record a
    resolution settled as absent is taken over, and a COMMITTED one a resolution settled
    as found is replayed, only once the resolution's signature verifies (role resolve, or
    sweeper for a sweeper's) and the decision is about the record as stored; else
    `DecisionRefused` and nothing runs. `resolve` then needs a signer. None (the default):
    resolutions are obeyed as written.

    Raises `TypeError` for a `backend` that is not a `CacheBackend`, a duration that is
    not a number or `trusted_keys` that are not `TrustedKeys`, `ValueError` for a
    duration out of range.
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
        clock: Clock | None = None,
        reconcile_timeout_s: float | None = 30.0,
        trusted_keys: TrustedKeys | None = None,
    ) -> None:
        if not isinstance(backend, CacheBackend):
            raise TypeError(f"backend must be a CacheBackend, not {type(backend).__name__}")
        check_durations(wait_s, lease_s, ttl)
        check_seconds("commit_retry_s", commit_retry_s)
        self.reconcile_timeout_s = _bound(reconcile_timeout_s)
        self.backend = backend
        self.wait_s = wait_s
        self.lease_s = lease_s
        self.ttl = ttl
        self.on_stale = on_stale
        self.commit_retry_s = commit_retry_s
        self._listeners: list[Listener] = [listener] if listener else []
        self._clock = clock
        self._monotonic = time.monotonic if clock is None else clock.monotonic
        self._sleep = time.sleep if clock is None else clock.sleep
        waits = getattr(clock, "wait", None)
        self._wait: Callable[[threading.Event, float], bool] | None = waits
        self._host = backend.host_clock
        self._keeper = _LeaseKeeper(backend, clock)
        self._rooms = _Rooms(clock)
        self._lanes = _Lanes()
        self._trusted = None
        self.trusted_keys = trusted_keys

    def __repr__(self) -> str:
        return f"Ledger({self.backend!r})"

    @property
    def trusted_keys(self) -> TrustedKeys | None:
        """The keys resolutions must be signed with before they are obeyed (see the
        class); None: resolutions are obeyed as written. Setting anything but
        `TrustedKeys` or None raises `TypeError`."""
        return self._trusted

    @trusted_keys.setter
    def trusted_keys(self, trusted: TrustedKeys | None) -> None:
        if trusted is not None:
            from ..signing._trusted import TrustedKeys

            if not isinstance(trusted, TrustedKeys):
                raise TypeError(
                    "trusted_keys must be signing.TrustedKeys (TrustedKeys.load(path or "
                    f"lines)) or None, not {type(trusted).__name__}"
                )
        self._trusted = trusted

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(kind, record)` on claim, replay, commit, fail, conflict, uncertain…

        A listener that raises is logged; the call it reports on goes on. Raises nothing."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling `listener`. Raises `ValueError` if it was not added."""
        self._listeners.remove(listener)

    # -- the guard ---------------------------------------------------------------------

    def run(self, key: str, fn: Callable[[], T], **options: Any) -> T:
        """Run `fn()` once for `key`; later calls return its stored result.

        `options` are `execute`'s keywords. Raises what `execute` raises."""
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
        reconcile: Reconciler | str | None = None,
        on_stale: StalePolicy | None = None,
        wrap_errors: bool = False,
        reconcile_timeout_s: float | None = _MISSING,
        stage: Stage | None = None,
    ) -> Outcome[T]:
        """Like `run`, but says whether the value was replayed and returns the record.

        `key` names the operation (`validate_key`'s rules); `fn` is the body, called with
        no arguments at most once while its outcome is known. `fingerprint` says what the
        arguments were (`crewai_idempotent.fingerprint`): a later call under the same key
        with another fingerprint is a conflict; `args` are handed to the reconciler.
        `wait_s`, `lease_s`, `ttl`, `on_stale` and `reconcile_timeout_s` override this
        ledger's defaults for the call; `reconcile(key, args)` answers `Found(result)`,
        `Absent()` or `Unknown()` for a claim whose owner stopped renewing its lease.

        Raises `InvalidIdempotencyKey` (a bad key), `IdempotencyKeyConflict` (the key was
        used with other arguments), `OperationInProgress` (another worker holds a live
        claim past `wait_s`), `OutcomeUncertain` (the outcome is unknown), `LedgerUnavailable`
        (the claim could not be stored; the body did not run), whatever the body raises
        (recorded FAILED, or UNCERTAIN for a timeout or `OutcomeUnknown`), and
        `TypeError`/`ValueError` for an option that cannot be used.

        With `wrap_errors=True` an exception from the body is raised as `BodyFailed`
        (the body's exception is its `__cause__`) carrying how it was recorded.

        `reconcile` is a callable or its import path (`"myapp.payments:find_charge"`);
        with one, the claim records the call's arguments (and the path, when it has one),
        so that a sweeper in another process can ask it (`crewai_idempotent.reconciliation`).

        `stage` (a `Stage`: the approval and spend-cap gates) runs once the claim is
        durable and before the body starts; what it raises is raised as it is, with the
        claim recorded FAILED, since the body never started.
        """
        validate_key(key)
        options = self._options(fingerprint, args, wait_s, lease_s, ttl, reconcile, on_stale)
        if reconcile_timeout_s is not _MISSING:
            options.reconcile_timeout_s = _bound(reconcile_timeout_s)
        return self._execute(key, fn, options, stage, wrap_errors)

    def _execute(
        self,
        key: str,
        fn: Callable[[], T],
        options: _Options,
        stage: Stage | None = None,
        wrap_errors: bool = False,
    ) -> Outcome[T]:
        """`execute` with its options resolved and checked (the crewAI guard resolves a
        tool's once, not on every call)."""
        if self.backend.read_first:
            # The replay's fast path without a trip through the driver: the same peek
            # and the same decision (`_replay`) that `_acquire` makes on the async path.
            peeked = self._perform(self.backend.peek, key)
            replay = self._replay(peeked, options)
            if replay is not None:
                return replay
            acquired = self._drive(self._acquire(key, options, peeked))
        else:
            acquired = self._drive(self._acquire(key, options))
        if isinstance(acquired, Outcome):
            return acquired
        claim: _Claim = acquired
        self._keeper.add(claim)
        try:
            entered = None if stage is None else self._enter(claim, stage)
            token = _current_claim.set(claim.record)
            try:
                value = fn()
            except BaseException as exc:
                failed = self._settle_failure(claim, exc)
                if stage is not None:
                    self._settle_stage(
                        stage, entered, Settled(Status(failed.status), failed.record, failed.reason)
                    )
                if wrap_errors and isinstance(exc, Exception):
                    raise failed from exc
                raise
            finally:
                _current_claim.reset(token)
            try:
                outcome = self._drive(self._finish(claim, Status.COMMITTED, value=value))
            except LedgerUnavailable:
                outcome = self._unrecorded(claim, value)
            except OutcomeUncertain as exc:  # taken over while the body ran
                if stage is not None:
                    self._settle_stage(stage, entered, Settled(Status.COMMITTED, exc.record))
                raise
            if stage is not None:
                self._settle_stage(stage, entered, _committed(claim, outcome))
            return outcome
        finally:
            self._keeper.remove(claim)

    async def arun(self, key: str, fn: Callable[[], Awaitable[T]], **options: Any) -> T:
        """Async twin of `run`: `fn()` returns an awaitable; `key` and `options` as for
        `execute`. Raises what `execute` raises."""
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
        reconcile: Reconciler | str | None = None,
        on_stale: StalePolicy | None = None,
        wrap_errors: bool = False,
        reconcile_timeout_s: float | None = _MISSING,
        stage: Stage | None = None,
    ) -> Outcome[T]:
        """Async twin of `execute`, with the same `key`, `fn` (returning an awaitable),
        `fingerprint`, `args`, `wait_s`, `lease_s`, `ttl`, `reconcile` (sync or async),
        `on_stale`, `wrap_errors`, `reconcile_timeout_s` and `stage`. Waiting happens on
        the event loop; backend calls (the stage's too) run on this ledger's own small
        thread pools, never the loop's default executor. A body cancelled while it runs
        is recorded UNCERTAIN. Raises what `execute` raises."""
        validate_key(key)
        options = self._options(fingerprint, args, wait_s, lease_s, ttl, reconcile, on_stale)
        if reconcile_timeout_s is not _MISSING:
            options.reconcile_timeout_s = _bound(reconcile_timeout_s)
        return await self._aexecute(key, fn, options, stage, wrap_errors)

    async def _aexecute(
        self,
        key: str,
        fn: Callable[[], Awaitable[T]],
        options: _Options,
        stage: Stage | None = None,
        wrap_errors: bool = False,
    ) -> Outcome[T]:
        acquired = await self._adrive(self._acquire(key, options), self._lanes.io)
        if isinstance(acquired, Outcome):
            return acquired
        claim: _Claim = acquired
        self._keeper.add(claim)
        try:
            entered = None if stage is None else await self._aenter(claim, stage)
            token = _current_claim.set(claim.record)
            try:
                value = await fn()
            except BaseException as exc:
                # Recorded even if this task is cancelled again meanwhile: a cancelled
                # body may have had its effect, and that must not be forgotten.
                failed = await self._unstoppable(self._settle_failure_async(claim, exc))
                if stage is not None:
                    settled = Settled(Status(failed.status), failed.record, failed.reason)
                    await self._asettle_stage(stage, entered, settled)
                if wrap_errors and isinstance(exc, Exception):
                    raise failed from exc
                raise
            finally:
                _current_claim.reset(token)
            finish = self._finish(claim, Status.COMMITTED, value=value)
            try:
                outcome = await self._unstoppable(self._adrive(finish, self._lanes.settle))
            except LedgerUnavailable:
                outcome = self._unrecorded(claim, value)
            except OutcomeUncertain as exc:  # taken over while the body ran
                if stage is not None:
                    await self._asettle_stage(stage, entered, Settled(Status.COMMITTED, exc.record))
                raise
            if stage is not None:
                await self._asettle_stage(stage, entered, _committed(claim, outcome))
            return outcome
        finally:
            self._keeper.remove(claim)

    # -- the stage between the claim and the body ------------------------------------

    def _enter(self, claim: _Claim, stage: Stage) -> Any:
        try:
            steps = stage.enter(claim.record, self.backend, self._monotonic)
            return None if steps is None else self._drive(steps)
        except BaseException as exc:
            self._refused(claim, exc)
            raise

    async def _aenter(self, claim: _Claim, stage: Stage) -> Any:
        try:
            steps = stage.enter(claim.record, self.backend, self._monotonic)
            return None if steps is None else await self._adrive(steps, self._lanes.io)
        except BaseException as exc:
            # Recorded even if this task is cancelled meanwhile, like a failed body.
            await self._unstoppable(self._arefused(claim, exc))
            raise

    def _refused(self, claim: _Claim, exc: BaseException) -> None:
        """The stage refused (or was interrupted): the body never started, so the claim
        is FAILED and the next attempt may run (after an approval, once a budget allows)."""
        try:
            self._drive(self._finish(claim, Status.FAILED, reason=_refusal(exc)))
        except Exception:  # the stage's own exception is raised; the lease lapses
            log.exception("could not record the refusal of %r", claim.record.key)

    async def _arefused(self, claim: _Claim, exc: BaseException) -> None:
        finish = self._finish(claim, Status.FAILED, reason=_refusal(exc))
        try:
            await self._adrive(finish, self._lanes.settle)
        except Exception:
            log.exception("could not record the refusal of %r", claim.record.key)

    def _settle_stage(self, stage: Stage, entered: Any, settled: Settled) -> None:
        steps = self._settling(stage, entered, settled)
        if steps is not None:
            try:
                self._drive(steps)
            except Exception:
                log.exception("the stage could not settle %r", settled.record or "a claim")

    async def _asettle_stage(self, stage: Stage, entered: Any, settled: Settled) -> None:
        """`_settle_stage` on the event loop, finished even if the caller is cancelled."""
        steps = self._settling(stage, entered, settled)
        if steps is not None:
            await self._unstoppable(self._adrive_logged(steps, settled))

    def _settling(self, stage: Stage, entered: Any, settled: Settled) -> Step[None] | None:
        # Never lets book-keeping change an outcome that is already recorded.
        try:
            return stage.settle(entered, settled, self.backend)
        except Exception:
            log.exception("the stage could not settle %r", settled.record or "a claim")
            return None

    async def _adrive_logged(self, steps: Step[None], settled: Settled) -> None:
        try:
            await self._adrive(steps, self._lanes.settle)
        except Exception:
            log.exception("the stage could not settle %r", settled.record or "a claim")

    async def _unstoppable(self, work: Awaitable[T]) -> T:
        """Finish `work` (a commit or a failure record) even if the caller is cancelled."""
        task = asyncio.ensure_future(work)
        task.add_done_callback(_observe)
        return await asyncio.shield(task)

    # -- inspection and resolution -----------------------------------------------------

    def get(self, key: str) -> Record | None:
        """The record stored under `key`, or None. Raises `LedgerUnavailable` if the store
        cannot be read."""
        return self._drive(self._read(key))

    def records(self, status: Status | None = None) -> list[Record]:
        """Every record (or every record in `status`), oldest update first: a list, so it
        holds them all; `scan` streams them instead. Raises `LedgerUnavailable` if the store
        cannot be read."""
        found: list[Record] = self._drive(self._scan(status))
        # The stores stream in key order (`CacheBackend.scan`); a person reads oldest first.
        return sorted(found, key=lambda record: (record.updated_at, record.key))

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        """Every record (or every record in `status`), streamed in key order in the store's
        batches: memory stays flat however large the ledger is, and a record that stays is
        yielded once however often it is written meanwhile (`CacheBackend.scan`). Raises
        `LedgerUnavailable` while it is iterated, if the store cannot be read."""
        return self.backend.scan(status)

    def select(self, query: Select) -> Iterator[Record]:
        """The records `query` selects (`Select`: a status, the needs-operator flag, a key
        prefix, a time range, expired receipts, documents by state), in its order and page,
        streamed from the store's indexes: a listing costs what it finds, not what the
        ledger holds (`CacheBackend.select`). Raises `LedgerUnavailable` while it is
        iterated, if the store cannot be read."""
        return self.backend.select(query)

    def stats(self) -> LedgerStats:
        """What this ledger holds in this process: see `LedgerStats`. A read of in-process
        state only; the store is not asked. Raises nothing."""
        return LedgerStats(len(self._rooms), tuple(r.key for r in self._keeper.claims()))

    def is_stale(self, record: Record) -> bool:
        """True for a PENDING `record` whose owner stopped renewing its lease, by the store's
        clocks. Raises `LedgerUnavailable` for a live lease another host holds on a ledger
        only one host may use (`Record.lease_left`)."""
        return record.status is Status.PENDING and not record.lease_live(
            self.backend.now(), self._host
        )

    def resolve(
        self,
        key: str,
        *,
        result: Any = _MISSING,
        absent: bool = False,
        by: str | None = None,
        reason: str = "",
        signer: Signer | None = None,
        via: str = "api",
    ) -> Record:
        """Settle an UNCERTAIN (or stale PENDING) record after checking the outside system.

        `result=...` says the operation happened: the record under `key` is COMMITTED and
        `result` is replayed from now on. `absent=True` says it did not: the record is
        FAILED and the next attempt runs. Who (`by`, by default this user at this host, or
        the signer's identity) and why (`reason`) are kept in its history.

        `signer` (a `signing.Signer`): the resolution is signed, as a `signing.Decision`
        (found with the digest of the receipt, or absent; the key and the record's fencing
        token; made `via` api, cli or console), and the decision and its signature are kept
        on the record, bound into its history's chain. A signer may also replace a
        resolution already made (one a ledger with trusted keys refuses). A ledger with
        `trusted_keys` refuses a resolution without one, and one whose key it does not
        trust for resolve, before writing anything.

        Raises `ValueError` unless exactly one of `result` and `absent` is given, for a
        `by` that is not the signer's identity, or a `via` a decision cannot name,
        `InvalidIdempotencyKey` for a bad key, `ResolutionRefused` for a record that is
        neither UNCERTAIN nor PENDING with a lapsed lease (nor, with a signer, settled by a
        resolution) or is missing, `DecisionRefused` on a ledger with trusted keys without
        a signer or with one it does not trust, `TypeError` for a receipt with no canonical
        form to sign, and `LedgerUnavailable` if the store cannot be written.
        """
        if (result is _MISSING) == (not absent):
            raise ValueError("pass exactly one of result=... or absent=True")
        validate_key(key)
        if signer is None and self._trusted is not None:
            raise _resolutions.refuse_unsigned(key, self._trusted)
        if signer is not None:
            if by is not None and by != signer.identity:
                raise ValueError(
                    f"the signer signs as {signer.identity!r}: a resolution by {by!r} cannot "
                    "be signed with it (leave by= out)"
                )
            if via not in ("api", "cli", "console", "slack"):
                raise ValueError(f"via must be api, cli, console or slack, not {via!r}")
            by = signer.identity
        by = by or _whoami()
        return self._drive(self._resolve(key, result, absent, by, reason, signer, via))

    def purge(self, *, expired_only: bool = True) -> int:
        """Delete COMMITTED records whose TTL has passed (or, with `expired_only=False`,
        every COMMITTED and FAILED record). UNCERTAIN and PENDING records are never purged.
        Returns how many were deleted; raises `LedgerUnavailable` if the store cannot be
        read or written."""
        removed = 0
        now = self.backend.now()
        # What a purge reads is what it deletes: the receipts whose expiry passed by the
        # wall clock (the store's index of expiries), each judged again by the host's
        # clock too (`Record.expired`), or the COMMITTED and FAILED records by status.
        # Streamed in the store's batches and deleted _PURGE_BATCH at a time, each batch
        # one short write (one commit where the store can): a purge of millions keeps its
        # memory flat, pays one commit per batch rather than per record (SQLite's fsync,
        # PostgreSQL's WAL flush), and holds a claim back for one batch at most.
        queries = (
            [Select(expired_by=now)]
            if expired_only
            else [Select(status=Status.COMMITTED), Select(status=Status.FAILED)]
        )
        for query in queries:
            batch: list[Record] = []
            for record in streamed(self.backend, query):
                if expired_only and not record.expired(now, self._host):
                    continue
                batch.append(record)
                if len(batch) == _PURGE_BATCH:
                    removed += self._delete_yielding(batch)
                    batch = []
            removed += self._delete_yielding(batch) if batch else 0
        return removed

    def _delete_yielding(self, records: list[Record]) -> int:
        """Delete `records` for a purge, asking again after a pause when the store says it
        is unavailable: under a stream of claims SQLite's write lock can stay taken past a
        busy timeout, and a purge is what should wait, not stop half-way."""
        for attempt in range(_PURGE_TRIES):
            try:
                return int(self._drive(self._delete(records)))
            except LedgerUnavailable:
                if attempt == _PURGE_TRIES - 1:
                    raise
                time.sleep(_PURGE_PAUSE_S * 2**attempt * random.uniform(0.5, 1.0))
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        """Stop this ledger's thread pools and close its backend. Raises nothing."""
        self._lanes.close()
        self.backend.close()

    # -- a call's options, and its outcome when the body is done ---------------------

    def _options(
        self,
        fingerprint: str,
        args: Any,
        wait_s: float | None,
        lease_s: float | None,
        ttl: float | None,
        reconcile: Reconciler | str | None,
        on_stale: StalePolicy | None,
    ) -> _Options:
        if wait_s is None and lease_s is None and ttl is _MISSING:
            wait_s, lease_s, ttl = self.wait_s, self.lease_s, self.ttl  # checked in __init__
        else:
            wait_s = self.wait_s if wait_s is None else wait_s
            lease_s = self.lease_s if lease_s is None else lease_s
            ttl = self.ttl if ttl is _MISSING else ttl
            check_durations(wait_s, lease_s, ttl)
        policy = on_stale or self.on_stale or ("reconcile" if reconcile else "uncertain")
        if policy not in STALE_POLICIES:
            raise ValueError(f"on_stale must be one of {', '.join(STALE_POLICIES)}, not {policy!r}")
        if policy == "reconcile" and reconcile is None:
            raise ValueError("on_stale='reconcile' needs a reconcile= callable")
        if not isinstance(fingerprint, str):
            raise TypeError("fingerprint must be a str (see crewai_idempotent.fingerprint)")
        call = None
        if reconcile is not None:
            if isinstance(reconcile, str):
                reconcile = named(reconcile)
            # What a sweeper in another process reads to ask the same reconciler.
            path = path_of(reconcile)
            call = {"ttl": ttl} if path is None else {"reconciler": path, "ttl": ttl}
        return _Options(
            fingerprint, args, wait_s, lease_s, ttl, reconcile, policy, self.reconcile_timeout_s,
            call,
        )  # fmt: skip

    def _call_options(
        self,
        wait_s: float | None,
        lease_s: float | None,
        ttl: float | None,
        reconcile: Reconciler | str | None,
        on_stale: StalePolicy | None,
        reconcile_timeout_s: float | None = None,
        tool: str | None = None,
    ) -> _Options:
        """The options of every call made with these settings, checked once (None: this
        ledger's own); a call fills in its fingerprint and arguments (`_Options.of_call`).
        `tool`: the tool's name, recorded with every claim (with the receipt's ttl), so that
        a sweeper finds a reconciler registered for the tool by its name; the arguments
        are recorded only for a tool that has a reconciler of its own."""
        ttl_or_own = _MISSING if ttl is None else ttl
        options = self._options("", None, wait_s, lease_s, ttl_or_own, reconcile, on_stale)
        if reconcile_timeout_s is not None:
            options.reconcile_timeout_s = _bound(reconcile_timeout_s)
        if tool is not None:
            # One dict for every claim of a tool without a reconciler: records never
            # change what they hold, and the claim path builds nothing more for it.
            recorded = options.call if options.call is not None else {"ttl": options.ttl}
            options.call = {"tool": tool, **recorded}
        return options

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
                        reply = self._perform(step.fn, *step.args)
                    except IdempotencyError as exc:
                        error = exc
                elif type(step) is _Park:
                    self._rooms.park(step.room, step.seen, step.seconds)
                elif type(step) is _Sleep:
                    self._sleep(max(step.seconds, 0.0))
                else:
                    assert type(step) is _Ask
                    reply = ask(
                        step.reconcile, step.key, step.args, step.timeout, self._wait, step.record
                    )
        except OutcomeUncertain as uncertain:
            self._name_ledger(uncertain)
            raise
        finally:
            steps.close()  # a member that leaves early still leaves its room

    def _perform(self, fn: Callable[..., T], *args: Any) -> T:
        """A backend call in this thread. The ledger's own errors pass as they are;
        anything else a store raises becomes LedgerUnavailable (fail closed)."""
        try:
            return fn(*args)
        except LedgerUnavailable as exc:
            _incidents.noted(self.backend, exc)  # said to a person once the store answers
            raise
        except IdempotencyError:
            raise
        except Exception as exc:
            raise self._unavailable(exc) from exc

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
                        if isinstance(exc, LedgerUnavailable):
                            _incidents.noted(backend, exc)
                        error = exc
                    except Exception as exc:  # noqa: BLE001 - fail closed on anything a store raises
                        error = self._unavailable(exc)
                elif type(step) is _Park:
                    await self._rooms.apark(step.room, step.seen, step.seconds)
                elif type(step) is _Sleep:
                    if self._clock is None:
                        await asyncio.sleep(max(step.seconds, 0.0))
                    else:
                        self._clock.sleep(max(step.seconds, 0.0))
                else:
                    assert type(step) is _Ask
                    reply = await aask(
                        step.reconcile, step.key, step.args, step.timeout, step.record
                    )
        except OutcomeUncertain as uncertain:
            self._name_ledger(uncertain)
            raise
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

    def _name_ledger(self, uncertain: OutcomeUncertain) -> None:
        """An uncertain outcome says which ledger holds the record: its `resolve` command
        names this ledger with --ledger unless it is the CLI's default."""
        if uncertain.ledger is None:
            uncertain.name_ledger(ledger_option(self.backend))

    def _unavailable(self, exc: Exception) -> LedgerUnavailable:
        error = LedgerUnavailable(f"{url_of(self.backend)}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        _incidents.noted(self.backend, error)
        return error


def _committed(claim: _Claim, outcome: Outcome[Any]) -> Settled:
    """The body returned: its commit as stored, or None when the record is still the
    claim (the commit could not be stored)."""
    record = outcome.record
    return Settled(Status.COMMITTED, None if record is claim.record else record)


def _refusal(exc: BaseException) -> str:
    if isinstance(exc, Exception):
        return f"{type(exc).__name__}: {exc}"
    return f"interrupted by {type(exc).__name__} before the body started"


def _bound(reconcile_timeout_s: Any) -> float | None:
    """A call's `reconcile_timeout_s`, checked; infinity is no bound, as None."""
    check_reconcile_timeout(reconcile_timeout_s)
    return None if reconcile_timeout_s == float("inf") else reconcile_timeout_s


def _settled(outcome: Outcome[Any], status: Status) -> Record | None:
    """The record a failure was stored as, or None if a takeover got there first."""
    return outcome.record if outcome.record.status is status else None


def _observe(task: asyncio.Future[Any]) -> None:
    # A commit outlives a cancelled caller; its failure is logged where it happens.
    if not task.cancelled() and task.exception() is not None:
        log.debug("ledger write finished after its caller left", exc_info=task.exception())


#: How often a purge asks a store that said it is unavailable to delete a batch, and its
#: first pause (doubled each time): about 6 s of patience beside a 5 s busy timeout.
_PURGE_TRIES = 6
_PURGE_PAUSE_S = 0.2
#: Records a purge deletes in one write: one commit for many, while a claim waiting for
#: SQLite's write lock waits for a hundred deletes at most.
_PURGE_BATCH = 100


def streamed(backend: CacheBackend, query: Select) -> Iterator[Record]:
    """The records `query` selects, streamed whatever the store, for a reader that takes
    them all and needs no order but the store's (`export`, `purge`): a store that answers
    `select` itself (from its indexes, in batches) is asked; one that does not (the
    default `CacheBackend.select`, which sorts what it matched and so holds it all) is read
    by the scan of the query's prefix or status, filtered as it streams, in the scan's
    order (the key's, for the package's stores); a wrapper with a `select` of its own that
    passes the query on to a store without one holds what matched. Raises `ValueError` for
    a query with an order other than the key's, an `after` or a `limit` (a page: ask
    `select`), and what the scan raises while it is iterated."""
    if query.order is not Order.KEY or query.after is not None or query.limit is not None:
        raise ValueError(f"streamed() reads a whole select in the store's order, not {query!r}")
    if type(backend).select is not CacheBackend.select:
        return backend.select(query)
    source = backend.scan_prefix(query.prefix) if query.prefix else backend.scan(query.status)
    return (record for record in source if query.matches(record))
