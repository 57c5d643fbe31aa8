"""One record per idempotency key, and the states it moves through."""

from __future__ import annotations

import getpass
import itertools
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import pydantic_core

from ._errors import LedgerUnavailable
from ._results import decode
from ._status import Status


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
    ) -> None:
        (
            set_key, set_status, set_fingerprint, set_token, set_revision, set_owner,
            set_attempts, set_created_at, set_updated_at, set_lease_expires_at,
            set_expires_at, set_result, set_error, set_needs_operator, set_evidence,
            set_history,
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

    def value(self) -> Any:
        """The stored result, decoded to what the body returned."""
        return decode(self.result)

    def lease_live(self, now: float) -> bool:
        return (
            self.status is Status.PENDING
            and self.lease_expires_at is not None
            and self.lease_expires_at > now
        )

    def expired(self, now: float) -> bool:
        return (
            self.status is Status.COMMITTED
            and self.expires_at is not None
            and self.expires_at <= now
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
    ) -> Record:
        """The owner's own commit or failure of this claim: `evolve` for the hot path.

        The next revision, `event` appended, the lease gone; the fields passed replace
        `result`, `error` and `expires_at`.
        """
        return Record(
            self.key, status, self.fingerprint, self.token, self.revision + 1, self.owner,
            self.attempts, self.created_at, now, None, expires_at, result, error,
            self.needs_operator, self.evidence, _appended(self.history, event),
        )  # fmt: skip

    def evolve(self, event: Event | None = None, **changes: Any) -> Record:
        """A copy with `changes` applied, the next revision, and `event` appended."""
        changes.setdefault("revision", self.revision + 1)
        if event is not None:
            changes["history"] = _appended(self.history, event)
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
        return {
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

    @classmethod
    def from_json(cls, text: str | bytes) -> Record:
        return cls.from_doc(pydantic_core.from_json(text, allow_inf_nan=True))

    @classmethod
    def from_doc(cls, d: dict[str, Any]) -> Record:
        """The record a decoded `to_json` document describes."""
        owner = d["owner"]
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
            history=tuple(Event(*e) for e in d["history"]),
        )


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


def _appended(history: tuple[Event, ...], event: Event) -> tuple[Event, ...]:
    history = (*history, event)
    if len(history) > HISTORY_LIMIT:
        history = history[:1] + history[-(HISTORY_LIMIT - 1) :]
    return history


_STATUS = {status.value: status for status in Status}


class Peek:
    """A light view of a stored record: what a replay needs, the rest decoded on demand.

    `CacheBackend.peek` returns one so that a replay reads the row without the write
    lock and without building the record and its history; `record()` builds the full
    `Record` only when someone asks (a listener, `Outcome.record`, a slow path).
    """

    __slots__ = ("_doc", "_record", "expires_at", "fingerprint", "result", "status")

    def __init__(
        self,
        status: Status,
        fingerprint: str,
        expires_at: float | None,
        result: Any,
        *,
        doc: dict[str, Any] | None = None,
        record: Record | None = None,
    ) -> None:
        if (doc is None) == (record is None):
            raise TypeError("a Peek needs exactly one of doc= or record=")
        self.status = status
        self.fingerprint = fingerprint
        self.expires_at = expires_at
        self.result = result  # encoded, as in Record.result
        self._doc = doc
        self._record = record

    @classmethod
    def of(cls, record: Record) -> Peek:
        """A view of a record already in hand (the default `CacheBackend.peek`)."""
        return cls(
            record.status, record.fingerprint, record.expires_at, record.result, record=record
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Peek:
        """A view of a `Record.to_json` document: one parse, no Record, no history."""
        d = pydantic_core.from_json(text, allow_inf_nan=True)
        return cls(_STATUS[d["status"]], d["fingerprint"], d["expires_at"], d["result"], doc=d)

    def replayable(self, fingerprint: str, now: float) -> bool:
        """A committed, unexpired receipt for these arguments: replay it as it is."""
        return (
            self.status is Status.COMMITTED
            and self.fingerprint == fingerprint
            and (self.expires_at is None or self.expires_at > now)
        )

    def record(self) -> Record:
        record = self._record
        if record is None:
            assert self._doc is not None
            try:
                record = self._record = Record.from_doc(self._doc)
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                raise LedgerUnavailable(f"the ledger holds a corrupt record: {exc!r}") from exc
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
