"""One record per idempotency key, and the states it moves through.

`Status`, `Owner`, `Event` and `Record` are the shapes of one stored document, `Peek` the
light view a replay reads of it, and `read_record`/`read_peek` the one way every store
reads a document back: the writer (`to_json`) and its readers are kept side by side, so
a field added to one is seen added to the other.
"""

from __future__ import annotations

import enum
import getpass
import itertools
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import pydantic_core

from .._error_base import CorruptRecord, LedgerUnavailable
from . import _chain
from ._chain import Signed, seq_of
from ._hostclock import HostClock
from ._results import decode


class Status(enum.StrEnum):
    PENDING = "PENDING"  # claimed; the body is running (or its owner died)
    COMMITTED = "COMMITTED"  # done; `result` holds the receipt to replay
    FAILED = "FAILED"  # the body raised before any effect; the next attempt may run
    UNCERTAIN = "UNCERTAIN"  # the effect may or may not have happened; resolve first


@dataclass(frozen=True, slots=True, init=False)
class Owner:
    """Who holds (or held) a claim: host, process and a random id per claim."""

    host: str
    pid: int
    id: str

    def __init__(self, host: str, pid: int, id: str) -> None:
        set_host, set_pid, set_id = _OWNER_SETTERS
        set_host(self, host)
        set_pid(self, pid)
        set_id(self, id)

    @property
    def label(self) -> str:
        return f"{self.host}:{self.pid}:{self.id}"

    @classmethod
    def current(cls) -> Owner:
        # A random prefix per process plus a counter: unique per claim, without a syscall.
        return cls(_HOST, os.getpid(), f"{_nonce}{next(_claims):x}")


_HOST = socket.gethostname()
_nonce = secrets.token_hex(4)
_claims = itertools.count(1)


def _reseed() -> None:
    global _nonce, _claims
    _nonce, _claims = secrets.token_hex(4), itertools.count(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reseed)


def _whoami() -> str:
    """The user and host an operator action or an outcome is credited to."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        user = "unknown"
    return f"{user}@{_HOST}"


def _this_process() -> str:
    """Who wrote an automatic transition (a stale claim marked uncertain, a reconciliation)."""
    return f"{_whoami()}:{os.getpid()}"


def _label(record: Record) -> str:
    return record.owner.label if record.owner else "unknown owner"


@dataclass(frozen=True, slots=True, init=False)
class Event:
    """One line of a record's history: what happened, when, under which token, by whom."""

    at: float
    kind: str  # claim, takeover, commit, fail, uncertain, fenced, reconcile, resolve, expire
    token: int
    by: str
    note: str = ""

    def __init__(self, at: float, kind: str, token: int, by: str, note: str = "") -> None:
        set_at, set_kind, set_token, set_by, set_note = _EVENT_SETTERS
        set_at(self, at)
        set_kind(self, kind)
        set_token(self, token)
        set_by(self, by)
        set_note(self, note)


HISTORY_LIMIT = 200  # bounded so that a key retried forever cannot grow without limit

#: A deadline on the host's clock (`_hostclock`): the boot it was read in, and the
#: seconds on that boot's clock.
HostDeadline = tuple[str, float]


@dataclass(frozen=True, slots=True, init=False)
class Record:
    key: str
    status: Status
    fingerprint: str
    token: int  # fencing token: grows on every claim or takeover
    revision: int  # grows on every write; backends compare-and-set on (token, revision)
    owner: Owner | None
    attempts: int
    created_at: float
    updated_at: float
    lease_expires_at: float | None = None
    expires_at: float | None = None  # TTL of a committed receipt
    result: Any = None  # encoded by _results.encode; use Record.value() to decode
    error: str | None = None
    needs_operator: bool = False  # set when two executions may have happened
    evidence: tuple[dict[str, Any], ...] = ()
    history: tuple[Event, ...] = field(default=())
    # The same deadlines on the host's step-free clock, written by the embedded ledgers
    # (`CacheBackend.host_clock`) next to the wall-clock ones, which stay what people and
    # older readers see. `lease_expires_at` on `running()`, `expires_at` on `elapsed()`.
    host_lease: HostDeadline | None = None
    host_expires: HostDeadline | None = None
    # What a reconciler in another process needs to ask about the call: the tool's name
    # and the receipt's ttl (written with every claim of a crewAI tool), the reconciler's
    # import path and the call's arguments, encoded as a receipt is (only with the claim
    # of a call that has a reconciler: a claim without "args" recorded none). Kept while
    # the outcome is open; a write that settles the record (COMMITTED, FAILED) drops it.
    call: dict[str, Any] | None = None
    # A sweeper asking the record's reconciler: (who, until, on the store's clock). Other
    # sweepers leave the record alone until then; any later write drops the mark.
    reconciling: tuple[str, float] | None = None
    # The history's hash chain (`_chain`): one digest per event of `history`; None while
    # not yet computed (a record built without one, or one an older release wrote, which
    # the next write chains). `chain_cut`: how many events the history limit cut after the
    # first, and the digest of the last one cut. `chain_from`: the chain was started by a
    # later write at this event (its sequence number, and when the last event before it
    # was written): the events before it were written unchained.
    chain: tuple[str, ...] | None = None
    chain_cut: tuple[int, str] | None = None
    chain_from: tuple[int, float] | None = None
    # Decisions made with events of the history (resolutions), bound into the chain:
    # (the event's sequence number, the decision's JSON, its signature envelope's or None).
    signed: tuple[Signed, ...] = ()
    # The record's status is what the resolution made with this event (its sequence
    # number) decided: a ledger with trusted keys verifies it before obeying it. Any write
    # that changes the status drops the mark.
    resolved: int | None = None

    def __init__(
        self,
        key: str,
        status: Status,
        fingerprint: str,
        token: int,
        revision: int,
        owner: Owner | None,
        attempts: int,
        created_at: float,
        updated_at: float,
        lease_expires_at: float | None = None,
        expires_at: float | None = None,
        result: Any = None,
        error: str | None = None,
        needs_operator: bool = False,
        evidence: tuple[dict[str, Any], ...] = (),
        history: tuple[Event, ...] = (),
        host_lease: HostDeadline | None = None,
        host_expires: HostDeadline | None = None,
        call: dict[str, Any] | None = None,
        reconciling: tuple[str, float] | None = None,
        chain: tuple[str, ...] | None = None,
        chain_cut: tuple[int, str] | None = None,
        chain_from: tuple[int, float] | None = None,
        signed: tuple[Signed, ...] = (),
        resolved: int | None = None,
    ) -> None:
        (
            set_key, set_status, set_fingerprint, set_token, set_revision, set_owner,
            set_attempts, set_created_at, set_updated_at, set_lease_expires_at,
            set_expires_at, set_result, set_error, set_needs_operator, set_evidence,
            set_history, set_host_lease, set_host_expires, set_call, set_reconciling,
            set_chain, set_chain_cut, set_chain_from, set_signed, set_resolved,
        ) = _RECORD_SETTERS  # fmt: skip
        set_key(self, key)
        set_status(self, status)
        set_fingerprint(self, fingerprint)
        set_token(self, token)
        set_revision(self, revision)
        set_owner(self, owner)
        set_attempts(self, attempts)
        set_created_at(self, created_at)
        set_updated_at(self, updated_at)
        set_lease_expires_at(self, lease_expires_at)
        set_expires_at(self, expires_at)
        set_result(self, result)
        set_error(self, error)
        set_needs_operator(self, needs_operator)
        set_evidence(self, evidence)
        set_history(self, history)
        set_host_lease(self, host_lease)
        set_host_expires(self, host_expires)
        set_call(self, call)
        set_reconciling(self, reconciling)
        set_chain(self, chain)
        set_chain_cut(self, chain_cut)
        set_chain_from(self, chain_from)
        set_signed(self, signed)
        set_resolved(self, resolved)

    @property
    def resolution(self) -> Signed | None:
        """The decision stored with the resolution this record's status comes from (see
        `resolved`): (its event's sequence number, the decision, the signature or None);
        None when the status comes from no resolution, or its decision was not stored."""
        seq = self.resolved
        if seq is None:
            return None
        return next((entry for entry in self.signed if entry[0] == seq), None)

    def last_seq(self) -> int:
        """The sequence number of the history's last event (-1 for no history)."""
        return seq_of(len(self.history) - 1, self.chain_cut) if self.history else -1

    def value(self) -> Any:
        """The stored result, decoded to what the body returned."""
        return decode(self.result)

    def lease_live(self, now: float, host: HostClock | None = None) -> bool:
        """A PENDING record whose owner still renews its lease, judged at the store's time
        `now` and, for a lease written on this host's boot, by the host's clock (`host`).

        Raises `LedgerUnavailable` for a live lease another host holds on a ledger that
        only one host may use (see `lease_left`)."""
        return (
            self.status is Status.PENDING
            and self.lease_expires_at is not None
            and self.lease_left(now, host) > 0
        )

    def lease_left(self, now: float, host: HostClock | None = None) -> float:
        """Seconds until the lease lapses; 0 or less once it has.

        A lease with a deadline on the host's clock is judged by that clock when it was
        read on this boot, so no wall-clock step can make a live lease look lapsed (or a
        lapsed one live). Without one (a server store, a record an older version wrote,
        a process with no host clock) it is judged by the wall clock at `now`, as written.
        A deadline read on another boot cannot be compared: the wall-clock lease decides
        if it has lapsed; if not, and the owner is this host and wrote it before this boot
        began, the host restarted under it (lapsed). Anything else is another host
        renewing it now: a ledger folder shared between hosts, which an embedded store
        cannot judge, so `LedgerUnavailable` is raised (fail closed).
        """
        if self.lease_expires_at is None:
            return 0.0
        wall = self.lease_expires_at - now
        stamp = self.host_lease
        if stamp is None or host is None:
            return wall
        boot, until = stamp
        if boot == host.boot:
            return until - host.running()
        if wall <= 0 or self._written_before_boot(host):
            return min(wall, 0.0)
        raise LedgerUnavailable(
            f"idempotency key {self.key!r} is held by {_label(self)} under a lease read on "
            f"boot {boot} of its host, and this host ({host.name}) is on boot {host.boot}: "
            "the ledger is shared between hosts (a network filesystem?), and an embedded "
            "ledger cannot judge another host's lease. Nothing was run (docs/backends.md, "
            "'Clocks', covers ledgers shared by hosts and ledgers moved between them)"
        )

    def restarted_under(self, host: HostClock | None) -> bool:
        """The lease was read on an earlier boot of this host: the owner died with it."""
        stamp = self.host_lease
        return (
            stamp is not None
            and host is not None
            and stamp[0] != host.boot
            and self._written_before_boot(host)
        )

    def _written_before_boot(self, host: HostClock) -> bool:
        owner = self.owner
        return owner is not None and owner.host == host.name and self.updated_at < host.booted_at()

    def expired(self, now: float, host: HostClock | None = None) -> bool:
        """A COMMITTED receipt whose TTL has passed: by the wall clock (a TTL is a calendar
        promise) and, on the boot it was written in, by the host's clock as well, so a
        forward step of the wall clock never expires a receipt early."""
        return (
            self.status is Status.COMMITTED
            and self.expires_at is not None
            and self.expires_at <= now
            and _passed(self.host_expires, host)
        )

    def settled(
        self,
        event: Event,
        status: Status,
        now: float,
        *,
        result: Any = None,
        error: str | None = None,
        expires_at: float | None = None,
        host_expires: HostDeadline | None = None,
    ) -> Record:
        """The owner's own commit or failure of this claim: `evolve` for the hot path.

        The next revision, `event` appended, the lease gone; the fields passed replace
        `result`, `error`, `expires_at` and `host_expires`. The call's arguments stay only
        on an UNCERTAIN record, whose outcome is still open.
        """
        history, chain, cut, signed, started = self._extended(event)
        return Record(
            self.key, status, self.fingerprint, self.token, self.revision + 1, self.owner,
            self.attempts, self.created_at, now, None, expires_at, result, error,
            self.needs_operator, self.evidence, history, None,
            host_expires, self.call if status is Status.UNCERTAIN else None, None,
            chain, cut, started, signed, None,
        )  # fmt: skip

    def _extended(
        self, event: Event, decision: tuple[dict[str, Any], dict[str, Any] | None] | None = None
    ) -> tuple[
        tuple[Event, ...],
        tuple[str, ...],
        tuple[int, str] | None,
        tuple[Signed, ...],
        tuple[int, float] | None,
    ]:
        """The history with `event` appended (and `decision`, a decision's JSON and its
        signature's, made with it), its chain, cut, signed decisions and start, within the
        limit. A history with no chain to extend (written by a release that keeps none, or
        a chain damaged) is chained again from its first event, and the start marks where
        (`chain_from`)."""
        history, chain, cut, signed = self.history, self.chain, self.chain_cut, self.signed
        started = self.chain_from
        seq = seq_of(len(history), cut)
        prev = _prev(self.key, chain, len(history))
        if prev is None:  # no chain to extend: chain the history again, from its first event
            if history:
                started = (seq, float(history[-1].at))
            chain = _chain.digests(self.key, history, cut, signed)
            prev = bytes.fromhex(chain[-1]) if chain else _chain.start(self.key)
        assert chain is not None
        attached = None
        if decision is not None:
            attached = _chain.decision_digest(*decision)
            signed = (*signed, (seq, *decision))
        at, kind, token, by, note = event.at, event.kind, event.token, event.by, event.note
        digest = _chain.link(prev, at, kind, token, by, note, attached)
        history, chain = (*history, event), (*chain, digest)
        over = len(history) - HISTORY_LIMIT
        if over > 0:
            # The first event stays, and the digest of the last one cut is the anchor the
            # next links to: the events that remain still verify.
            cut = ((cut[0] if cut else 0) + over, chain[over])
            history, chain = history[:1] + history[over + 1 :], chain[:1] + chain[over + 1 :]
            signed = tuple(entry for entry in signed if entry[0] == 0 or entry[0] > cut[0])
        return history, chain, cut, signed, started

    def evolve(
        self,
        event: Event | None = None,
        *,
        decision: tuple[dict[str, Any], dict[str, Any] | None] | None = None,
        **changes: Any,
    ) -> Record:
        """A copy with `changes` applied, the next revision, and `event` appended.

        A deadline on the host's clock goes with the wall-clock one it was written with:
        changing `lease_expires_at` (or `expires_at`) without giving `host_lease` (or
        `host_expires`) drops it, so a stale one never outlives its pair. A sweeper's mark
        (`reconciling`) lasts only until the next write, the call's arguments only until a
        write settles the record (COMMITTED or FAILED), and the mark of a resolution
        (`resolved`) until a write changes the status. `decision` (a decision's JSON and
        its signature envelope's, or None) is stored with `event` and bound into the chain.
        """
        changes.setdefault("revision", self.revision + 1)
        changes.setdefault("reconciling", None)
        if "call" not in changes and changes.get("status") in _SETTLED:
            changes["call"] = None
        if "resolved" not in changes and changes.get("status", self.status) is not self.status:
            changes["resolved"] = None
        if event is not None:
            history, chain, cut, signed, started = self._extended(event, decision)
            changes["history"], changes["chain"] = history, chain
            changes["chain_cut"], changes["signed"] = cut, signed
            changes["chain_from"] = started
        elif decision is not None:
            raise TypeError("a decision is stored with the event it is made with")
        if "lease_expires_at" in changes and "host_lease" not in changes:
            changes["host_lease"] = None
        if "expires_at" in changes and "host_expires" not in changes:
            changes["host_expires"] = None
        unknown = changes.keys() - _FIELDS
        if unknown:
            raise TypeError(f"Record has no field(s) {sorted(unknown)}")
        # Several times faster than dataclasses.replace, which matters on the claim path.
        new = object.__new__(Record)
        for name, set_field in zip(_FIELDS, _RECORD_SETTERS, strict=True):
            set_field(new, changes[name] if name in changes else getattr(self, name))
        return new

    def to_json(self) -> str:
        doc = self._doc()
        try:
            # pydantic-core's encoder is several times faster than json.dumps here.
            return pydantic_core.to_json(doc, inf_nan_mode="constants").decode("utf-8")
        except pydantic_core.PydanticSerializationError:
            # A lone surrogate in an error text or a note: not UTF-8. Those are diagnostics,
            # so escape them rather than fail (results are made exact by _results.encode).
            return pydantic_core.to_json(_printable(doc), inf_nan_mode="constants").decode()

    def _doc(self) -> dict[str, Any]:
        owner = self.owner
        doc: dict[str, Any] = {
            "v": 1,
            "key": self.key,
            "status": self.status.value,
            "fingerprint": self.fingerprint,
            "token": self.token,
            "revision": self.revision,
            "owner": [owner.host, owner.pid, owner.id] if owner else None,
            "attempts": self.attempts,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "lease_expires_at": self.lease_expires_at,
            "expires_at": self.expires_at,
            "result": self.result,
            "error": self.error,
            "needs_operator": self.needs_operator,
            "evidence": list(self.evidence),
            "history": [[e.at, e.kind, e.token, e.by, e.note] for e in self.history],
        }
        # New keys, written only when set: a reader of version 1 ignores keys it does not
        # know, and a writer of it drops them (with the wall-clock deadline they go with).
        if self.host_lease is not None:
            doc["host_lease"] = self.host_lease
        if self.host_expires is not None:
            doc["host_expires"] = self.host_expires
        if self.call is not None:
            doc["call"] = self.call
        if self.reconciling is not None:
            doc["reconciling"] = self.reconciling
        # Written as read: a chain is computed by the write that appends an event (a record
        # an older release wrote stays unchained until then, as `verify` should see it).
        chain = self.chain
        if chain is not None:
            doc["chain"] = chain
            if self.chain_cut is not None:
                doc["chain_cut"] = self.chain_cut
            if self.chain_from is not None:
                doc["chain_from"] = self.chain_from
        if self.signed:
            doc["signed"] = self.signed
        if self.resolved is not None:
            doc["resolved"] = self.resolved
        return doc

    @classmethod
    def from_json(cls, text: str | bytes) -> Record:
        return cls.from_doc(pydantic_core.from_json(text, allow_inf_nan=True))

    @classmethod
    def from_doc(cls, d: dict[str, Any]) -> Record:
        """The record a decoded `to_json` document describes."""
        owner = d["owner"]
        history = tuple(Event(*e) for e in d["history"])
        chain, cut, start = _stored_chain(d)
        return cls(
            key=d["key"],
            status=Status(d["status"]),
            fingerprint=d["fingerprint"],
            token=d["token"],
            revision=d["revision"],
            owner=Owner(owner[0], owner[1], owner[2]) if owner else None,
            attempts=d["attempts"],
            created_at=d["created_at"],
            updated_at=d["updated_at"],
            lease_expires_at=d["lease_expires_at"],
            expires_at=d["expires_at"],
            result=d["result"],
            error=d["error"],
            needs_operator=d["needs_operator"],
            evidence=tuple(d["evidence"]),
            history=history,
            host_lease=_deadline(d.get("host_lease")),
            host_expires=_deadline(d.get("host_expires")),
            call=_call(d.get("call")),
            reconciling=_deadline(d.get("reconciling")),
            chain=chain,
            chain_cut=cut,
            chain_from=start,
            signed=_signed(d.get("signed")),
            resolved=_resolved(d.get("resolved")),
        )


_SETTLED = (Status.COMMITTED, Status.FAILED)


def _setters(cls: type) -> tuple[Callable[[Any, Any], None], ...]:
    """The slot descriptors' setters of a frozen dataclass's fields, in order.

    A frozen dataclass's generated __init__ assigns each field through
    object.__setattr__; a slot's own setter is about twice as fast, and a guarded call
    builds two records and two events. The __init__ methods above use these, so a
    record is still immutable once built (assignment raises FrozenInstanceError).
    """
    return tuple(getattr(cls, f.name).__set__ for f in fields(cls))


_OWNER_SETTERS = _setters(Owner)
_EVENT_SETTERS = _setters(Event)
_RECORD_SETTERS = _setters(Record)
_FIELDS = tuple(f.name for f in fields(Record))


def _deadline(stored: Any) -> HostDeadline | None:
    if stored is None:
        return None
    boot, at = stored
    if not isinstance(boot, str) or isinstance(at, bool) or not isinstance(at, int | float):
        raise ValueError(f"not a host clock deadline: {stored!r}")
    return (boot, float(at))


def _call(stored: Any) -> dict[str, Any] | None:
    if stored is None:
        return None
    if not isinstance(stored, dict):
        raise ValueError(f"not a call: {stored!r}")
    return stored


def _passed(deadline: HostDeadline | None, host: HostClock | None) -> bool:
    """Whether a deadline on the host's clock has passed, as far as it can tell: one read
    on another boot (or with no host clock to read) does not hold anything back."""
    return (
        deadline is None
        or host is None
        or deadline[0] != host.boot
        or deadline[1] <= (host.elapsed())
    )


def _stored_chain(
    d: dict[str, Any],
) -> tuple[tuple[str, ...] | None, tuple[int, str] | None, tuple[int, float] | None]:
    """The chain a document stores (digests, cut, start) as it stores them, so that it is
    written back the same (and `verify` sees what was stored); a part that is not even of
    its shape is left out. Never raises: a damaged chain is `crewai-idempotent verify`'s to
    report, not a reason to stop the guard (the next write that appends an event chains a
    history it cannot extend again, and marks where: `Record._extended`)."""
    stored = d.get("chain")
    chain = None
    if type(stored) is list and all(type(digest) is str for digest in stored):
        chain = tuple(stored)
    try:
        cut = _chain._cut(d.get("chain_cut"))
    except ValueError:
        cut = None
    try:
        started = _chain._started(d.get("chain_from"))
    except ValueError:
        started = None
    return chain, cut, started


def _prev(key: str, chain: tuple[str, ...] | None, events: int) -> bytes | None:
    """What the next event of a history of `events` links to, or None if `chain` cannot
    be extended (missing, not one digest per event, its last one malformed)."""
    if chain is None or len(chain) != events:
        return None
    if not chain:
        return _chain.start(key)
    last = chain[-1]
    if len(last) != 64:
        return None
    try:
        return bytes.fromhex(last)
    except ValueError:
        return None


def _signed(stored: Any) -> tuple[Signed, ...]:
    if not stored:
        return ()
    try:
        return tuple(_chain._signed(stored))
    except ValueError:
        return ()  # unreadable decisions are no decisions: a ledger with trusted keys refuses


def _resolved(stored: Any) -> int | None:
    if stored is None or isinstance(stored, bool) or not isinstance(stored, int):
        return None if stored is None else -1  # a mark that names no event: never obeyed
    return stored


_STATUS = {status.value: status for status in Status}

#: What reading a damaged document raises: not JSON, a field missing or of the wrong type.
_DAMAGE = (ValueError, KeyError, TypeError, IndexError)


def read_record(text: str | bytes, where: str) -> Record:
    """The record a stored `Record.to_json` document describes. Every store reads its
    records through this or `read_peek`, so a damaged one is reported the same way
    everywhere: `CorruptRecord` naming `where` (the file, table or key prefix)."""
    try:
        return Record.from_json(text)
    except _DAMAGE as exc:
        raise CorruptRecord(where, repr(exc)) from exc


def read_peek(text: str | bytes, where: str) -> Peek:
    """`Peek.from_json` of a stored document; `CorruptRecord` naming `where` if it is
    damaged, now or when the rest of it is decoded."""
    try:
        return Peek.from_json(text, where)
    except _DAMAGE as exc:
        raise CorruptRecord(where, repr(exc)) from exc


class Peek:
    """A light view of a stored record: what a replay needs, the rest decoded on demand.

    `CacheBackend.peek` returns one so that a replay reads the row without the write
    lock and without building the record and its history; `record()` builds the full
    `Record` only when someone asks (a listener, `Outcome.record`, a slow path).
    """

    __slots__ = ("_doc", "_record", "_where", "expires_at", "fingerprint", "result", "status")

    def __init__(
        self,
        status: Status,
        fingerprint: str,
        expires_at: float | None,
        result: Any,
        *,
        doc: dict[str, Any] | None = None,
        record: Record | None = None,
        where: str = "the ledger",
    ) -> None:
        if (doc is None) == (record is None):
            raise TypeError("a Peek needs exactly one of doc= or record=")
        self.status = status
        self.fingerprint = fingerprint
        self.expires_at = expires_at
        self.result = result  # encoded, as in Record.result
        self._doc = doc
        self._record = record
        self._where = where  # named if the rest of the document turns out damaged

    @classmethod
    def of(cls, record: Record) -> Peek:
        """A view of a record already in hand (the default `CacheBackend.peek`)."""
        return cls(
            record.status, record.fingerprint, record.expires_at, record.result, record=record
        )

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "the ledger") -> Peek:
        """A view of a `Record.to_json` document: one parse, no Record, no history.
        `where` is what a `CorruptRecord` raised later names (see `read_peek`)."""
        d = pydantic_core.from_json(text, allow_inf_nan=True)
        return cls(
            _STATUS[d["status"]], d["fingerprint"], d["expires_at"], d["result"], doc=d,
            where=where,
        )  # fmt: skip

    def replayable(self, fingerprint: str, now: float, host: HostClock | None = None) -> bool:
        """A committed, unexpired receipt for these arguments: replay it as it is.
        Expired as `Record.expired` says: the host's clock is read only once the wall
        clock says the TTL has passed."""
        return (
            self.status is Status.COMMITTED
            and self.fingerprint == fingerprint
            and (
                self.expires_at is None
                or self.expires_at > now
                or not _passed(self._host_expires(), host)
            )
        )

    @property
    def resolved(self) -> bool:
        """Whether the record's status comes from a resolution (`Record.resolved`): a
        ledger with trusted keys verifies it before replaying it. One look at the
        document, not a decoding of its history."""
        if self._record is not None:
            return self._record.resolved is not None
        assert self._doc is not None
        return self._doc.get("resolved") is not None

    def _host_expires(self) -> HostDeadline | None:
        if self._record is not None:
            return self._record.host_expires
        assert self._doc is not None
        try:
            return _deadline(self._doc.get("host_expires"))
        except _DAMAGE as exc:
            raise CorruptRecord(self._where, repr(exc)) from exc

    def record(self) -> Record:
        record = self._record
        if record is None:
            assert self._doc is not None
            try:
                record = self._record = Record.from_doc(self._doc)
            except _DAMAGE as exc:
                raise CorruptRecord(self._where, repr(exc)) from exc
        return record

    def __repr__(self) -> str:
        return f"Peek({self.status.value}, fingerprint={self.fingerprint!r})"


def _printable(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_printable(k): _printable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_printable(v) for v in value]
    return value
