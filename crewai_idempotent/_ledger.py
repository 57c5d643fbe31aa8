"""The guard: claim a key durably before the body runs, replay its receipt afterwards.

The decisions are written once, as generators that yield the blocking steps they need
(`_Call` a backend, `_Sleep`, `_Ask` a reconciler) and receive their results; `_drive`
performs those steps. The sync and async entry points share every decision that way.
"""

from __future__ import annotations

import asyncio
import getpass
import inspect
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from ._backend import CacheBackend
from ._errors import (
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
from ._record import _HOST, Event, Owner, Record, Status
from ._results import encode

log = logging.getLogger("crewai_idempotent")

T = TypeVar("T")
StalePolicy = Literal["uncertain", "reconcile", "retry"]
Reconciler = Callable[[str, Any], Any]
Listener = Callable[[str, Record], None]

_MISSING: Any = object()


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T]):
    """What `Ledger.execute` returns: the value, whether it was replayed, and the record."""

    value: T
    replayed: bool
    record: Record


@dataclass(frozen=True, slots=True)
class _Options:
    fingerprint: str
    args: Any
    wait_s: float
    lease_s: float
    ttl: float | None
    reconcile: Reconciler | None
    on_stale: StalePolicy


class _Call:
    __slots__ = ("args", "fn")

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args


class _Sleep:
    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class _Ask:
    __slots__ = ("args", "key", "reconcile")

    def __init__(self, reconcile: Reconciler, key: str, args: Any) -> None:
        self.reconcile, self.key, self.args = reconcile, key, args


Step = Generator[_Call | _Sleep | _Ask, Any, T]


class _Claim:
    """A claim this process holds; the lease keeper renews it until `done`."""

    __slots__ = ("done", "due", "lease_s", "lock", "lost", "record", "ttl")

    def __init__(self, record: Record, options: _Options) -> None:
        self.record = record
        self.lease_s = options.lease_s
        self.ttl = options.ttl
        self.lock = threading.Lock()
        self.done = False
        self.lost = False
        self.due = 0.0


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
    ) -> Outcome[T]:
        """Like `run`, but says whether the value was replayed and returns the record."""
        validate_key(key)
        options = self._options(fingerprint, args, wait_s, lease_s, ttl, reconcile, on_stale)
        acquired = self._drive(self._acquire(key, options))
        if isinstance(acquired, Outcome):
            return acquired
        claim: _Claim = acquired
        self._keeper.add(claim)
        try:
            try:
                value = fn()
            except BaseException as exc:
                self._settle_failure(claim, exc)
                raise
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
    ) -> Outcome[T]:
        validate_key(key)
        options = self._options(fingerprint, args, wait_s, lease_s, ttl, reconcile, on_stale)
        loop = asyncio.get_running_loop()
        # Backend calls block; they run in a worker thread. The claim is shielded: if this
        # task is cancelled while the claim is landing, the claim is released as FAILED
        # (the body never started) instead of being left to go stale.
        pending = loop.run_in_executor(None, self._drive, self._acquire(key, options), loop)
        try:
            acquired = await asyncio.shield(pending)
        except asyncio.CancelledError:
            pending.add_done_callback(self._release_unstarted)
            raise
        if isinstance(acquired, Outcome):
            return acquired
        claim: _Claim = acquired
        self._keeper.add(claim)
        try:
            try:
                value = await fn()
            except BaseException as exc:
                await _unstoppable(loop, self._settle_failure, claim, exc)
                raise
            finish = self._finish(claim, Status.COMMITTED, value=value)
            try:
                return await _unstoppable(loop, self._drive, finish)
            except LedgerUnavailable:
                return self._unrecorded(claim, value)
        finally:
            self._keeper.remove(claim)

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
        backend = self.backend
        held: Record | None = None
        waited_from = time.monotonic()
        delay = 0.002
        while True:
            if held is None:
                now = backend.now()
                owner = Owner.current()
                record = Record(
                    key=key,
                    status=Status.PENDING,
                    fingerprint=o.fingerprint,
                    token=1,
                    revision=1,
                    owner=owner,
                    attempts=1,
                    created_at=now,
                    updated_at=now,
                    lease_expires_at=now + o.lease_s,
                    history=(Event(now, "claim", 1, owner.label),),
                )
                try:
                    held = yield _Call(backend.insert, record)
                except LedgerUnavailable:
                    yield from self._release_unanswered(record)
                    raise
                if held is None:
                    self._emit("claim", record)
                    return _Claim(record, o)
                continue

            now = backend.now()
            status = held.status
            if status is Status.COMMITTED and held.expired(now):
                claim = yield from self._take_over(held, o, "expire", "TTL passed; new operation")
            elif status is Status.COMMITTED:
                self._check_fingerprint(held, o)
                self._emit("replay", held)
                return Outcome(held.value(), True, held)
            elif status is Status.FAILED:
                claim = yield from self._take_over(held, o, "takeover", "previous attempt failed")
            elif status is Status.PENDING and held.lease_live(now):
                self._check_fingerprint(held, o)
                waited = time.monotonic() - waited_from
                if waited >= o.wait_s:
                    self._emit("in_progress", held)
                    raise OperationInProgress(key, held, waited)
                lease_left = (held.lease_expires_at or now) - now
                yield _Sleep(min(delay, o.wait_s - waited, lease_left + 0.001))
                delay = min(delay * 2, 0.2)
                held = yield _Call(backend.get, key)
                continue
            elif status is Status.PENDING:  # its owner stopped renewing the lease
                self._check_fingerprint(held, o)
                lapse = f"lease expired {now - (held.lease_expires_at or now):.1f} s ago"
                if o.on_stale == "retry":
                    claim = yield from self._take_over(
                        held, o, "takeover", f"{lapse}; on_stale=retry"
                    )
                elif o.on_stale == "reconcile":
                    answer = yield from self._reconcile(held, o, lapse)
                    if answer is not None:
                        return answer
                    claim = None
                else:
                    yield from self._mark_uncertain(
                        held,
                        f"its owner {_label(held)} stopped renewing its lease ({lapse}) "
                        "before committing: the effect may or may not have happened",
                    )
                    claim = None
            else:  # UNCERTAIN
                self._check_fingerprint(held, o)
                if o.reconcile is None or held.needs_operator:
                    self._emit("uncertain", held)
                    raise OutcomeUncertain(key, held, held.error or "the outcome is unknown")
                answer = yield from self._reconcile(held, o, "uncertain")
                if answer is not None:
                    return answer
                claim = None
            if claim is not None:
                return claim
            held = yield _Call(backend.get, key)  # lost a race: look again

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
            yield _Call(self.backend.replace, held, released)
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
        if (yield _Call(self.backend.replace, held, new)):
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

    def _settle_failure(self, claim: _Claim, exc: BaseException) -> None:
        status, reason = classify_failure(exc)
        try:
            self._drive(self._finish(claim, status, reason=reason))
        except Exception:
            log.exception("could not record %s for %r", status, claim.record.key)

    def _finish(
        self, claim: _Claim, status: Status, *, value: Any = _MISSING, reason: str | None = None
    ) -> Step[Outcome[Any]]:
        with claim.lock:  # no renewal may write after this point
            claim.done = True
            current = claim.record
        now = self.backend.now()
        owner = current.owner.label if current.owner else _whoami()
        changes: dict[str, Any] = {"status": status, "updated_at": now, "lease_expires_at": None}
        if status is Status.COMMITTED:
            payload = encode(value)
            kind = "commit"
            changes.update(result=payload, error=None)
            changes["expires_at"] = now + claim.ttl if claim.ttl else None
        else:
            payload = None
            kind = "fail" if status is Status.FAILED else "uncertain"
            changes["error"] = reason
        new = current.evolve(Event(now, kind, current.token, owner, reason or ""), **changes)
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
            self._emit(kind, new)
            return Outcome(value, False, new)
        if status is Status.FAILED:
            log.warning("claim on %r was taken over while its body failed", current.key)
            return Outcome(None, False, new)
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
                    break
                continue
            new = held.evolve(
                Event(now, "fenced", held.token, _label(mine), note),
                status=Status.UNCERTAIN, updated_at=now, lease_expires_at=None,
                error=note, needs_operator=True, evidence=(*held.evidence, evidence),
            )  # fmt: skip
            if (yield _Call(self.backend.replace, held, new)):
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
                self._emit("resolve", new)
                return new

    def _read(self, key: str) -> Step[Record | None]:
        return (yield _Call(self.backend.get, key))

    def _scan(self, status: Status | None) -> Step[Any]:
        return (yield _Call(lambda: list(self.backend.scan(status))))

    def _delete(self, record: Record) -> Step[bool]:
        return (yield _Call(self.backend.delete, record))

    # -- performing the steps ----------------------------------------------------------

    def _drive(self, steps: Step[T], loop: asyncio.AbstractEventLoop | None = None) -> T:
        reply: Any = None
        error: BaseException | None = None
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
                    error = LedgerUnavailable(f"{self.backend!r}: {type(exc).__name__}: {exc}")
                    error.__cause__ = exc
            elif type(step) is _Sleep:
                time.sleep(max(step.seconds, 0.0))
            else:
                assert type(step) is _Ask
                reply = _ask(step, loop)

    def _release_unstarted(self, pending: asyncio.Future[Any]) -> None:
        if pending.cancelled() or pending.exception() is not None:
            return
        acquired = pending.result()
        if isinstance(acquired, _Claim):
            # The body never started, so nothing can have happened: FAILED lets the next
            # attempt run (a CancelledError from inside a body would make it UNCERTAIN).
            unstarted = "cancelled before the body started"
            try:
                self._drive(self._finish(acquired, Status.FAILED, reason=unstarted))
            except Exception:  # the caller is gone; the lease lapses and the next one decides
                log.exception("could not release the unstarted claim on %r", acquired.record.key)

    def _emit(self, kind: str, record: Record) -> None:
        for listener in self._listeners:
            try:
                listener(kind, record)
            except Exception:
                log.exception("idempotency listener %r failed on %s", listener, kind)


class _LeaseKeeper:
    """One daemon thread per ledger that renews the leases of the claims this process runs."""

    def __init__(self, backend: CacheBackend) -> None:
        self._backend = backend
        self._claims: dict[int, _Claim] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def add(self, claim: _Claim) -> None:
        claim.due = time.monotonic() + claim.lease_s / 3
        with self._lock:
            self._claims[id(claim)] = claim
            if self._thread is None or self._pid != os.getpid():  # after fork(): no thread
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._loop, name="crewai-idempotent-leases", daemon=True
                )
                self._thread.start()
            elif claim.lease_s < 3.0:
                self._wake.set()

    def remove(self, claim: _Claim) -> None:
        with self._lock:
            self._claims.pop(id(claim), None)

    def _loop(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self._lock:
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


def _ask(step: _Ask, loop: asyncio.AbstractEventLoop | None) -> Verdict:
    """Call a reconciler and normalise what it says; raising means Unknown."""
    try:
        answer = step.reconcile(step.key, step.args)
        if inspect.isawaitable(answer):
            if loop is None:
                close = getattr(answer, "close", None)
                if close:
                    close()
                return Unknown("an async reconciler cannot be used from the sync run()")
            answer = asyncio.run_coroutine_threadsafe(_await(answer), loop).result()
    except Exception as exc:  # noqa: BLE001
        return Unknown(f"reconciler raised {type(exc).__name__}: {exc}")
    if answer is Absent:
        return Absent()
    if answer is Unknown:
        return Unknown()
    if isinstance(answer, Found | Absent | Unknown):
        return answer
    return Unknown(f"reconciler returned {answer!r}, not Found(result), Absent or Unknown")


async def _await(awaitable: Awaitable[T]) -> T:
    return await awaitable


async def _unstoppable(loop: asyncio.AbstractEventLoop, fn: Callable[..., T], *args: Any) -> T:
    """Run a ledger write in a thread that a cancellation of the caller cannot interrupt."""
    return await asyncio.shield(loop.run_in_executor(None, fn, *args))


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
