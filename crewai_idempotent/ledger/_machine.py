"""The decisions: what a call does with what the store holds, written once for both drivers.

Each decision is a generator that yields the blocking steps it needs (`_steps`) and
receives their results, so the sync and the async driver share every rule. `_Machine` is
the half of `Ledger` that decides; `Ledger` (`_ledger`) adds the public calls and the
drivers that perform the steps.

Before the body: replay a live receipt, wait for a live claim (one poller per key per
process, in its `_Room`), claim an absent key, take over a failed or expired one, and
for a lapsed lease apply `on_stale` (mark UNCERTAIN, reconcile, or take over). After
the body: commit or record the failure, retrying a while if the store is down; if the
claim was taken over meanwhile, settle by the fencing token (`_fenced`, `_late`). An
operator's `resolve`, and a sweeper's look at a record (`_sweep`), which settles it by its
reconciler's answer through the same compare-and-set as everything else.

These are the transitions of one state machine, kept together because each is only
right next to the ones it races with (a takeover against a late commit, a reconciliation
against a fenced owner): a reader checks one against the other on the same page.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._errors import (
    IdempotencyKeyConflict,
    LedgerUnavailable,
    OperationInProgress,
    OutcomeUncertain,
    ResolutionRefused,
)
from ..notifications import _outbox
from . import _resolutions
from ._backend import CacheBackend, ledger_option
from ._chain import link, start
from ._hostclock import HostClock
from ._leases import _Claim
from ._policy import Listener, _Options
from ._reconcile import Absent, Found, Unanswered, Unknown
from ._record import Event, HostDeadline, Owner, Peek, Record, Status, _label, _this_process
from ._results import decode, encode
from ._rooms import _UNKNOWN, _Room, _Rooms
from ._steps import _MISSING, Outcome, Step, Swept, _Ask, _Call, _Park, _Sleep

if TYPE_CHECKING:
    from ..signing._keyfile import Signer
    from ..signing._trusted import TrustedKeys

log = logging.getLogger("crewai_idempotent")

# How long a member waits for the one holding its room before looking again; the holder
# wakes it sooner when it learns something or lets go.
_HOLDER_PAUSE = 0.2


class _Machine:
    """The decisions of a `Ledger`, over the state the ledger gives them."""

    backend: CacheBackend
    ttl: float | None
    commit_retry_s: float
    _listeners: list[Listener]
    _rooms: _Rooms
    _monotonic: Callable[[], float]
    # The host's clock when every process using the store runs on this host (the
    # backend's `host_clock`): leases and TTLs are judged by it as well as by `now()`.
    _host: HostClock | None
    # The keys resolutions must be signed with before they are obeyed (None: any is).
    _trusted: TrustedKeys | None

    def _replay(self, peeked: Peek | None, o: _Options) -> Outcome[Any] | None:
        """The replay of a peeked record, if it is a live receipt for these arguments.

        A replay is a read: no write lock, no claim record, no room, and only the result
        decoded. Anything else goes the full way (`_acquire`), which decides (and writes)
        with the whole record. The sync driver peeks in the caller's thread and asks this
        before it starts `_acquire`; the async one peeks inside `_acquire`, on a lane.
        """
        if peeked is not None and peeked.replayable(o.fingerprint, self.backend.now(), self._host):
            if self._trusted is not None and peeked.resolved:
                self._obeyed(peeked.record())  # a receipt a resolution found: signed?
            if self._listeners:
                self._emit("replay", peeked.record())
            return Outcome(decode(peeked.result), True, peeked)
        return None

    def _acquire(
        self, key: str, o: _Options, peeked: Peek | None = _MISSING
    ) -> Step[_Claim | Outcome[Any]]:
        """Replay, wait, claim or take over. `peeked`: what a peek the caller made already
        found (then `_replay` has refused it), else the peek is made here when the store
        reads first."""
        if peeked is _MISSING:
            peeked = None
            if self.backend.read_first:
                peeked = yield _Call(self.backend.peek, key)
                replay = self._replay(peeked, o)
                if replay is not None:
                    return replay
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
        started = self._monotonic()
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
                        yield from self._look(key)
                finally:
                    rooms.release(room)
                seen, held = rooms.news(room)
                continue

            now = self.backend.now()
            status = held.status if held is not None else None
            if held is not None and status is not Status.PENDING and status is not Status.FAILED:
                if status is Status.COMMITTED and not held.expired(now, self._host):
                    self._check_fingerprint(held, o)
                    if self._trusted is not None and held.resolved is not None:
                        self._obeyed(held)
                    self._emit("replay", held)
                    return Outcome(held.value(), True, held)
                if status is Status.UNCERTAIN:
                    self._check_fingerprint(held, o)
                    # A reconciler that did not answer for another member of this room a
                    # moment ago is not asked again for the ones who waited for it.
                    if o.reconcile is None or held.needs_operator or held is room.unanswered:
                        self._emit("uncertain", held)
                        raise OutcomeUncertain(key, held, held.error or "the outcome is unknown")
            lease_left = 0.0
            if held is not None and status is Status.PENDING:
                lease_left = held.lease_left(now, self._host)
            if lease_left > 0:
                assert held is not None
                self._check_fingerprint(held, o)
                waited = self._monotonic() - started
                if waited >= o.wait_s:
                    self._emit("in_progress", held)
                    raise OperationInProgress(key, held, waited)
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
                            yield from self._look(key)
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

    def _look(self, key: str) -> Step[None]:
        """Read the key's record for everyone in its room: the record, or the failure to
        read it, is news for every member."""
        try:
            found = yield _Call(self.backend.get, key)
        except LedgerUnavailable as exc:
            self._rooms.publish_error(key, exc)
            raise
        self._rooms.publish(key, found, read=True)

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
        key = room.key
        record = Record(
            key, Status.PENDING, o.fingerprint, 1, 1, owner, 1, now, now, now + o.lease_s,
            None, None, None, False, (), (Event(now, "claim", 1, label),),
            self._host_lease(o.lease_s), None, _call(o), None,
            (link(start(key), now, "claim", 1, label, ""),),
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
            if self._trusted is not None and _resolutions.needs_check(held):
                self._obeyed(held)  # FAILED by a resolution: the next attempt runs if signed
            return (yield from self._take_over(held, o, "takeover", "previous attempt failed"))
        if status is Status.UNCERTAIN:  # with a reconciler
            return (yield from self._reconcile(room, held, o, "uncertain"))
        # PENDING whose owner stopped renewing the lease
        lapse = self._lapse(held, now)
        if o.on_stale == "retry":
            return (yield from self._take_over(held, o, "takeover", f"{lapse}; on_stale=retry"))
        if o.on_stale == "reconcile":
            return (yield from self._reconcile(room, held, o, lapse))
        yield from self._mark_uncertain(
            held,
            f"its owner {_label(held)} stopped renewing its lease ({lapse}) "
            "before committing: the effect may or may not have happened",
        )
        return None

    def _lapse(self, held: Record, now: float) -> str:
        """How a PENDING record's lease lapsed, for its history."""
        if held.restarted_under(self._host):
            return "the host restarted since its owner renewed the lease"
        return f"lease expired {-held.lease_left(now, self._host):.1f} s ago"

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

    def _host_lease(self, lease_s: float) -> HostDeadline | None:
        """A lease of `lease_s` from now on the host's clock, if the store has one."""
        host = self._host
        return None if host is None else (host.boot, host.running() + lease_s)

    def _host_expiry(self, ttl: float | None) -> HostDeadline | None:
        """A receipt's TTL from now on the host's clock, if the store has one."""
        host = self._host
        return None if host is None or not ttl else (host.boot, host.elapsed() + ttl)

    def _obeyed(self, held: Record) -> None:
        """Raise `DecisionRefused` unless the resolution `held`'s status comes from is
        signed by a trusted key and is about `held` as stored (`_resolutions.check`)."""
        assert self._trusted is not None
        _resolutions.check(held, self._trusted, ledger_option(self.backend))

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
            host_lease=self._host_lease(o.lease_s),
            expires_at=None,
            result=None,
            error=None,
            call=_call(o),
        )
        if held.status is Status.UNCERTAIN:  # a reconciler found it absent
            yield from self._noted(held, new)
        if (yield _Call(self.backend.replace, held, new, claims=new)):
            self._rooms.publish(new.key, new)
            self._emit("claim", new)
            return _Claim(new, o)
        return None

    def _mark_uncertain(
        self, held: Record, reason: str, unanswered: _Room | None = None
    ) -> Step[None]:
        """Record UNCERTAIN and raise OutcomeUncertain. `unanswered`: the room whose
        members waited for a reconciler that did not answer; they get the same answer."""
        now = self.backend.now()
        new = held.evolve(
            Event(now, "uncertain", held.token, _this_process(), reason),
            status=Status.UNCERTAIN,
            updated_at=now,
            lease_expires_at=None,
            error=reason,
        )
        yield from self._noted(held, new)
        if (yield _Call(self.backend.replace, held, new)):
            if unanswered is not None:
                unanswered.unanswered = new
            self._rooms.publish(new.key, new)
            self._emit("uncertain", new)
            raise OutcomeUncertain(held.key, new, reason)

    def _reconcile(
        self, room: _Room, held: Record, o: _Options, why: str
    ) -> Step[Outcome[Any] | _Claim | None]:
        assert o.reconcile is not None
        verdict = yield _Ask(o.reconcile, held.key, o.args, o.reconcile_timeout_s, held)
        if isinstance(verdict, Found):
            new = self._found(held, verdict, f"{why}; reconciler found it", _this_process(), o.ttl)
            yield from self._noted(held, new)
            if (yield _Call(self.backend.replace, held, new)):
                self._rooms.publish(new.key, new)
                self._emit("reconciled", new)
                return Outcome(verdict.result, True, new)
            return None
        if isinstance(verdict, Absent):
            return (yield from self._take_over(held, o, "takeover", f"{why}; reconciler: absent"))
        assert isinstance(verdict, Unknown)
        unanswered = room if isinstance(verdict, Unanswered) else None
        yield from self._mark_uncertain(held, f"{why}; {verdict.reason}", unanswered)
        return None

    def _found(
        self,
        held: Record,
        verdict: Found,
        note: str,
        by: str,
        ttl: float | None,
        decision: tuple[dict[str, Any], dict[str, Any]] | None = None,
    ) -> Record:
        """`held` COMMITTED with the receipt a reconciler found, expiring as a commit would;
        `decision`: a sweeper's signed decision, stored with the event (and the record
        marked as resolved by it)."""
        now = self.backend.now()
        return held.evolve(
            Event(now, "reconcile", held.token, by, note),
            decision=decision,
            resolved=None if decision is None else held.last_seq() + 1,
            status=Status.COMMITTED,
            updated_at=now,
            lease_expires_at=None,
            expires_at=now + ttl if ttl else None,
            host_expires=self._host_expiry(ttl),
            result=encode(verdict.result),
            error=None,
        )

    def _sweep(
        self,
        key: str,
        pick: Callable[[Record], _Ask | str],
        by: str,
        hold_s: float,
        dry_run: bool = False,
        signer: Signer | None = None,
    ) -> Step[Swept]:
        """A sweeper's look at one record, and the settlement its reconciler's answer calls
        for when the record is a sweeper's to settle: UNCERTAIN, or PENDING with a lapsed
        lease; never one that needs an operator, one whose owner renews its lease, or one
        another sweeper (`reconciling`) is asking about.

        `pick(record)` is the sweeper's choice: the `_Ask` to make, or why not now (no
        reconciler, backing off). The record is first marked as this sweeper's (`by`) for
        `hold_s`, so other sweepers leave it alone; then Found commits the receipt, Absent
        marks it FAILED so that the next call runs, Unknown leaves (or makes) it UNCERTAIN
        with the attempt in its history. Each write is a compare-and-set, like any other:
        an owner that renewed or finished meanwhile wins, and the answer is written to a
        record that changed only while it is still open under the same token.

        With `signer`, a settlement is signed (`_resolutions`): the decision, via the
        sweeper, is stored with its event. Without one, on a ledger with trusted keys, an
        Absent answer is not written (workers would not obey it): the record stays
        UNCERTAIN, its history saying why.
        """
        held = yield _Call(self.backend.get, key)
        while True:
            now = self.backend.now()
            why = self._sweepable(held, now, by)
            if held is None or why is None:
                return Swept("skipped", held, self._unsweepable(held, now))
            ask = pick(held)
            if isinstance(ask, str):
                return Swept("left", held, ask)
            if dry_run:
                return Swept("due", held, why)
            marked = held.evolve(None, reconciling=(by, now + hold_s))
            if (yield _Call(self.backend.replace, held, marked)):
                break
            held = yield _Call(self.backend.get, key)
        verdict = yield _Ask(ask.reconcile, key, ask.args, ask.timeout, marked)
        if isinstance(verdict, Absent) and signer is None and self._trusted is not None:
            verdict = Unknown(
                "its reconciler found no trace of it, but this ledger obeys only signed "
                "settlements and this sweeper has no signing key (Sweeper(..., signer=...)), "
                "so the next attempt would not run: settle it with `crewai-idempotent resolve "
                "... --absent --key FILE`, or give the sweeper a key trusted for the sweeper role"
            )
        while True:
            new, outcome, kind = self._swept(marked, verdict, why, by, signer)
            yield from self._noted(marked, new)
            if (yield _Call(self.backend.replace, marked, new)):
                self._rooms.publish(key, new)
                self._emit(kind, new)
                reason = verdict.reason if isinstance(verdict, Unknown) else why
                return Swept(outcome, new, reason)
            current = yield _Call(self.backend.get, key)
            now = self.backend.now()
            if (
                current is None
                or current.token != marked.token
                or self._sweepable(current, now, by) is None
            ):
                return Swept("overtaken", current, self._unsweepable(current, now))
            marked = current  # still open under the same token: the answer still holds

    def _sweepable(self, held: Record | None, now: float, by: str) -> str | None:
        """What made `held` a sweeper's to settle (the note its history gets), or None."""
        if held is None or held.needs_operator:
            return None
        mark = held.reconciling
        if mark is not None and mark[0] != by and mark[1] > now:
            return None
        if held.status is Status.UNCERTAIN:
            return "uncertain"
        if held.status is not Status.PENDING:
            return None
        try:
            if held.lease_live(now, self._host):
                return None
        except LedgerUnavailable:
            return None  # a live lease another host renews, on a ledger only one host may use
        return self._lapse(held, now)

    def _unsweepable(self, held: Record | None, now: float) -> str:
        """Why a sweeper leaves `held` alone (`_sweepable` said None)."""
        if held is None:
            return "no record"
        if held.needs_operator:
            return "two executions may have happened: only resolve settles it"
        mark = held.reconciling
        if mark is not None and mark[1] > now and held.status in (Status.UNCERTAIN, Status.PENDING):
            return f"{mark[0]} is asking its reconciler"
        if held.status is Status.PENDING:
            try:
                held.lease_live(now, self._host)
            except LedgerUnavailable as exc:
                return str(exc)
            return "its owner renews its lease"
        return f"it is {held.status.value}"

    def _swept(
        self,
        held: Record,
        verdict: Found | Absent | Unknown,
        why: str,
        by: str,
        signer: Signer | None = None,
    ) -> tuple[Record, str, str]:
        """The record a sweeper writes for a reconciler's answer: (record, outcome, the
        listeners' kind). Signed by `signer` when given."""
        ttl = (held.call or {}).get("ttl", self.ttl)
        if isinstance(verdict, Found):
            note = f"{why}; reconciler found it"
            decision = None
            if signer is not None:
                decision = _resolutions.signed(
                    held, absent=False, result=encode(verdict.result), signer=signer,
                    via="sweeper", reason=note, at=self.backend.now(),
                )  # fmt: skip
            found = self._found(held, verdict, note, by, ttl, decision)
            return found, "found", "reconciled"
        now = self.backend.now()
        if isinstance(verdict, Absent):
            note = f"{why}; reconciler: absent"
            decision = None
            if signer is not None:
                decision = _resolutions.signed(
                    held, absent=True, result=None, signer=signer, via="sweeper", reason=note,
                    at=now,
                )  # fmt: skip
            new = held.evolve(
                Event(now, "absent", held.token, by, note), decision=decision,
                status=Status.FAILED, updated_at=now, lease_expires_at=None,
                error=f"{by}: its reconciler found no trace of it; the next attempt runs it",
                resolved=held.last_seq() + 1,
            )  # fmt: skip
            return new, "absent", "fail"
        error = held.error
        if held.status is Status.PENDING:
            error = (
                f"its owner {_label(held)} stopped renewing its lease ({why}) before committing: "
                f"the effect may or may not have happened; its reconciler could not tell: "
                f"{verdict.reason}"
            )
        new = held.evolve(
            Event(now, "unknown", held.token, by, f"{why}; {verdict.reason}"),
            status=Status.UNCERTAIN, updated_at=now, lease_expires_at=None, error=error,
        )  # fmt: skip
        return new, "unknown", "uncertain"

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
                host_expires=self._host_expiry(claim.ttl),
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
                host_expires=current.host_expires,
            )
        # A commit from PENDING is never news for a person; an unknown outcome is.
        noted = () if status is Status.COMMITTED else _outbox.of_transition(current, new)
        deadline = self._monotonic() + self.commit_retry_s
        delay = 0.05
        while True:
            try:
                if noted:
                    yield _Call(_outbox.put_entries, self.backend, noted)
                stored = yield _Call(self.backend.replace, current, new)
                break
            except LedgerUnavailable:
                # Keep trying for a while; past that the record stays PENDING, its lease
                # lapses, and the next attempt treats it as uncertain (never a blind re-run).
                if self._monotonic() + delay > deadline:
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
                yield from self._noted(None, new)
                if (yield _Call(self.backend.insert, new)) is None:
                    self._rooms.publish(new.key, new)
                    break
                continue
            new = held.evolve(
                Event(now, "fenced", held.token, _label(mine), note),
                status=Status.UNCERTAIN, updated_at=now, lease_expires_at=None,
                error=note, needs_operator=True, evidence=(*held.evidence, evidence),
            )  # fmt: skip
            yield from self._noted(held, new)
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
        yield from self._noted(held, new)
        if (yield _Call(self.backend.replace, held, new)):
            self._rooms.publish(new.key, new)
            self._emit("commit" if new.status is Status.COMMITTED else "uncertain", new)
            return new
        return None

    def _resolve(
        self,
        key: str,
        result: Any,
        absent: bool,
        by: str,
        reason: str,
        signer: Signer | None = None,
        via: str = "api",
    ) -> Step[Record]:
        """Settle `key`'s record as an operator says (`Ledger.resolve`): signed by `signer`
        when given, which may also replace a resolution already made (one that a ledger
        with trusted keys refuses, say)."""
        payload = None if absent else encode(result)
        while True:
            held = yield _Call(self.backend.get, key)
            if held is None:
                raise ResolutionRefused(f"no record for idempotency key {key!r}")
            now = self.backend.now()
            stale = held.status is Status.PENDING and not held.lease_live(now, self._host)
            again = signer is not None and _resolutions.needs_check(held)
            if held.status is not Status.UNCERTAIN and not stale and not again:
                raise ResolutionRefused(
                    f"idempotency key {key!r} is {held.status}"
                    + (" with a live lease" if held.status is Status.PENDING else "")
                    + "; only UNCERTAIN records, or PENDING ones whose lease expired, are "
                    "resolved (and, with a signing key, records a resolution settled)"
                )
            decision = None
            if signer is not None:
                decision = _resolutions.signed(
                    held, absent=absent, result=payload, signer=signer, via=via, reason=reason,
                    at=now,
                )  # fmt: skip
                if self._trusted is not None:
                    from ..signing._verify import verify

                    verify(*decision, self._trusted)  # an untrusted signer: refused, unwritten
            verdict = "absent" if absent else "happened"
            event = Event(now, "resolve", held.token, by, f"{verdict}: {reason}".rstrip(": "))
            mark = held.last_seq() + 1
            if absent:
                new = held.evolve(
                    event, decision=decision, resolved=mark,
                    status=Status.FAILED, updated_at=now, lease_expires_at=None,
                    error=f"resolved absent by {by}: {reason}", needs_operator=False,
                )  # fmt: skip
            else:
                new = held.evolve(
                    event, decision=decision, resolved=mark,
                    status=Status.COMMITTED, updated_at=now, lease_expires_at=None,
                    result=payload, error=None, needs_operator=False,
                    expires_at=now + self.ttl if self.ttl else None,  # as a commit would
                    host_expires=self._host_expiry(self.ttl),
                )  # fmt: skip
            yield from self._noted(held, new)
            if (yield _Call(self.backend.replace, held, new)):
                self._rooms.publish(new.key, new)
                self._emit("resolve", new)
                return new

    def _read(self, key: str) -> Step[Record | None]:
        return (yield _Call(self.backend.get, key))

    def _scan(self, status: Status | None) -> Step[Any]:
        return (yield _Call(lambda: list(self.backend.scan(status))))

    def _delete(self, records: list[Record]) -> Step[int]:
        deleted = yield _Call(self.backend.delete_many, records)
        for record, gone in zip(records, deleted, strict=True):
            if gone:
                self._rooms.publish(record.key, None)
        return sum(1 for gone in deleted if gone)

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

    def _noted(self, held: Record | None, new: Record) -> Step[None]:
        """What the write of `new` over `held` means for a person goes to the outbox
        before `new` is written: its entry is delivered if and only if the write lands."""
        entries = _outbox.of_transition(held, new)
        if entries:
            yield _Call(_outbox.put_entries, self.backend, entries)

    def _emit(self, kind: str, record: Record) -> None:
        if not self._listeners:
            return
        for listener in self._listeners:
            try:
                listener(kind, record)
            except Exception:
                log.exception("idempotency listener %r failed on %s", listener, kind)


def _call(o: _Options) -> dict[str, Any] | None:
    """What a claim records for a reconciler asked from another process: the tool's name
    (every tool's claims), and the arguments only when the tool has a reconciler."""
    call = o.call
    if call is None or o.reconcile is None:
        return call
    return {**call, "args": encode(o.args)}
