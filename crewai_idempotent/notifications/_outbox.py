"""The outbox of what needs a person, kept in the ledger's own store.

An entry is a document under `crewai-idempotent/outbox/<id>` (a COMMITTED record that
never expires, like the approval and spend documents), so it lives wherever the records
live: every backend, every host that shares the store.

**An entry exists if and only if its transition does.** The store has no transaction over
two keys, so the entry is tied to the write that is the transition:

- the write carries the entry's *mark*: an approval request or a cap window (documents)
  lists the ids of its entries (`outbox`), and a record's transition is its history event,
  from which the entry's id is computed;
- the entry document is inserted *before* that write, naming the write it waits for (the
  key and the token and revision the write replaces). Until someone sees the mark it is
  waiting (stored as `"state": "unconfirmed"`, shown as "waiting"); once the mark is seen
  it is `due`; once the source has moved on without
  the mark, the write it waited for lost its race or never happened, and the entry is void
  (deleted, never delivered).

So a crash between the two writes leaves an entry that is never delivered, and a crash
after both leaves one that is: `confirmation` decides which, from the store alone. An
entry that needs no transition (an alert of your own, a spend-cap refusal, a ledger that
did not answer) is `due` from the start, and written once per `dedupe` key.

The entries' delivery state (attempts, the next try, the claim of the dispatcher sending
it) is kept in the entry document itself, which only dispatchers write once it exists:
delivery bookkeeping never competes with a key's own writes. `_dispatch` delivers.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._errors import CorruptRecord
from ..ledger._backend import DOCUMENTS, CacheBackend
from ..ledger._record import Record, Status
from ..ledger._results import decode, encode
from ..ledger._select import Order, Position, Select

#: Entries not yet delivered to every channel.
OUTBOX = DOCUMENTS + "outbox/"
#: Entries delivered to every channel, kept for `notifications ls` until they are pruned.
DELIVERED = DOCUMENTS + "delivered/"
#: What every document carries as its fingerprint (the same as `_gatestore`'s).
DOCUMENT = "crewai-idempotent-document"
#: Marks a document keeps (the latest): more than its entries could pile up waiting.
MARKS_KEPT = 100
#: The stored state of an entry waiting for its transition. The previous release reads and
#: writes exactly this word, and workers of both share one ledger during an upgrade, so it
#: is what is written; `Entry.state` (and everything a person reads) says "waiting", and a
#: stored "waiting" (a later release's) is read as the same state.
STORED_WAITING = "unconfirmed"
_WAITING_STATES = (STORED_WAITING, "waiting")

#: The entry types the package writes, and what each means for a person.
TYPES = {
    "approval.requested": "a call waits for approval (a new request, or a new round of one)",
    "approval.approved": "an approval request was approved",
    "approval.denied": "an approval request was denied",
    "approval.expired": "an approval was not used before its grant expired",
    "record.uncertain": "a call's outcome is unknown: someone must check and resolve it",
    "record.resolved": "an uncertain call was settled (by an operator or its reconciler)",
    "spend.refused": "a spend cap refused a call",
    "spend.threshold": "a spend cap window passed its warning share of the limit",
    "ledger.unavailable": "the ledger did not answer a process for a while",
    "alert.uncertain_too_long": "a sweeper found a record open for longer than its threshold",
    "alert.verifier_unknown": "a sweeper's reconciler keeps answering Unknown for a record",
}

_TYPE = re.compile(r"^[a-z][a-z0-9_-]*(\.[a-z0-9_-]+)+$")
_ID = re.compile(r"^ob_[0-9a-f]{24}$")


@dataclass(frozen=True, slots=True)
class Note:
    """An entry a document's change calls for: its type and what it says."""

    type: str
    data: Mapping[str, Any]


def check_type(value: Any) -> str:
    if not isinstance(value, str) or not _TYPE.match(value) or len(value) > 100:
        raise ValueError(
            "an entry type is dotted lower-case words such as 'alert.stale_uncertain', "
            f"not {value!r}"
        )
    return value


def check_id(value: Any) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise ValueError(f"not an outbox entry id (ob_ and 24 hex digits): {value!r}")
    return value


def _digest_id(*parts: Any) -> str:
    text = "\x00".join(str(part) for part in parts)
    return "ob_" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _entry(
    entry_id: str,
    type_: str,
    at: float,
    subject: str | None,
    data: Mapping[str, Any],
    source: Mapping[str, Any] | None,
    seq: int = 0,
) -> Record:
    doc = {
        "kind": "outbox", "v": 1, "id": entry_id, "type": type_, "at": at, "seq": seq,
        "subject": subject, "data": dict(data), "source": dict(source) if source else None,
        "state": STORED_WAITING if source else "due", "confirmed_at": None if source else at,
        "deliveries": {}, "log": [], "tries": 0, "claim": None, "watch": _watch(type_, data),
    }  # fmt: skip
    return Record(
        OUTBOX + entry_id, Status.COMMITTED, DOCUMENT, 1, 1, None, 0, at, at, result=encode(doc)
    )


def _watch(type_: str, data: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a dispatcher checks again later: a granted approval, when its grant ends."""
    if type_ != "approval.approved" or data.get("grant_expires_at") is None:
        return None
    return {"id": data["id"], "round": data["round"], "at": data["grant_expires_at"]}


def put_entries(backend: CacheBackend, entries: Iterable[Record]) -> None:
    """Insert entries (insert-if-absent: one already there is the same entry)."""
    for entry in entries:
        backend.insert(entry)
    _wake(backend)


def _wake(backend: CacheBackend) -> None:
    # Only where this process runs a dispatcher of its own (`_inprocess`): never loaded here.
    running = sys.modules.get("crewai_idempotent.notifications._inprocess")
    if running is not None:
        running.wake(backend)


# -- what a record's transition means (the ledger's machine) ----------------------------


def of_transition(held: Record | None, new: Record) -> list[Record]:
    """The entries the write of `new` over `held` calls for: a record turned UNCERTAIN (or
    flagged for an operator), or settled after being UNCERTAIN (or resolved by hand).
    Their ids come from the transition's history event, which is the mark."""
    if not new.history:
        return []
    before = held.status if held is not None else None
    event = new.history[-1]
    if new.status is Status.UNCERTAIN:
        flagged = new.needs_operator and not (held is not None and held.needs_operator)
        if before is Status.UNCERTAIN and not flagged:
            return []  # still uncertain, nothing new for a person
        type_ = "record.uncertain"
    elif before is Status.UNCERTAIN or event.kind == "resolve":
        type_ = "record.resolved"
    else:
        return []
    mark = [event.at, event.kind, event.token, event.by]
    entry_id = _digest_id(new.key, *mark)
    data = {
        "key": new.key, "status": new.status.value, "previous": before.value if before else None,
        "token": new.token, "attempts": new.attempts, "fingerprint": new.fingerprint,
        "needs_operator": new.needs_operator, "event": event.kind, "by": event.by,
        "note": event.note, "error": new.error,
        "owner": new.owner.label if new.owner is not None else None,
    }  # fmt: skip
    source = {
        "key": new.key, "token": held.token if held is not None else 0,
        "revision": held.revision if held is not None else 0, "event": mark,
    }  # fmt: skip
    return [_entry(entry_id, type_, event.at, new.key, data, source)]


# -- what a document's change means (`_gatestore.update`) -------------------------------


def of_document(
    key: str, current: Record | None, notes: Iterable[Note], now: float
) -> list[Record]:
    """Entries for the notes of one attempt at changing the document `key` (stored as
    `current`); each attempt gets ids of its own, and only the attempt whose write lands
    leaves its marks (`doc["outbox"]`) in the document."""
    source = {
        "key": key, "token": current.token if current is not None else 0,
        "revision": current.revision if current is not None else 0,
    }  # fmt: skip
    entries = []
    for seq, note in enumerate(notes):
        entry_id = "ob_" + secrets.token_hex(12)
        mark = {**source, "mark": entry_id}
        entries.append(_entry(entry_id, check_type(note.type), now, key, note.data, mark, seq))
    return entries


def marked(doc: dict[str, Any], entries: Iterable[Record]) -> dict[str, Any]:
    """`doc` carrying the marks of `entries`, after the ones it had (the latest kept)."""
    marks = [*doc.get("outbox", ()), *(entry.key[len(OUTBOX) :] for entry in entries)]
    return {**doc, "outbox": marks[-MARKS_KEPT:]}


# -- entries that need no transition ----------------------------------------------------


def put(
    backend: CacheBackend,
    type: str,
    data: Mapping[str, Any],
    *,
    subject: str | None = None,
    dedupe: str | None = None,
) -> Entry:
    """Put an entry of `type` in the outbox of `backend`'s ledger, due at once.

    `data` is what it says (a value JSON cannot hold is kept as its repr), `subject` the
    idempotency key it is about, if any. `dedupe` makes it once-only: the same `type` and
    `dedupe` name the same entry, which is written once however many processes put it
    (insert-if-absent) and returned as it is stored. Without it every call is a new entry.

    Raises `ValueError` for a `type` that is not dotted lower-case words, `TypeError` for
    `data` that is not a mapping or a `dedupe` that is not a str, and `LedgerUnavailable`
    if the store cannot be read or written."""
    check_type(type)
    if dedupe is not None and not isinstance(dedupe, str):
        raise TypeError(f"dedupe must be a str, not {dedupe!r}")
    entry_id = _digest_id("put", type, dedupe) if dedupe else "ob_" + secrets.token_hex(12)
    if dedupe:
        sent = backend.get(DELIVERED + entry_id)
        if sent is not None:  # delivered already (a dispatcher that meets it again skips it)
            return Entry.of(_doc(sent))
    record = _entry(entry_id, type, backend.now(), subject, _json(data), None)
    held = backend.insert(record)
    _wake(backend)
    return Entry.of(_doc(record if held is None else held))


def alert(
    backend: CacheBackend,
    type: str,
    title: str,
    text: str = "",
    *,
    subject: str | None = None,
    fields: Mapping[str, Any] | None = None,
    dedupe: str | None = None,
) -> Entry:
    """Tell a person something the ledger's transitions do not: an entry of `type`
    (e.g. "alert.stale_uncertain") with a one-line `title`, a `text`, and `fields` shown
    as name: value. `subject` is the idempotency key it is about, if any; `dedupe`, as for
    `put`, makes the alert once-only ("stale:<key>:<token>"). It goes in the outbox of
    `backend`'s ledger. Raises `ValueError` for a blank `title`, `TypeError` for a `text`
    that is not a str, and what `put` raises."""
    if not isinstance(title, str) or not title.strip():
        raise ValueError("an alert needs a title: a non-blank line")
    if not isinstance(text, str):
        # `type` is the entry's type here (the public parameter's name), not the builtin.
        raise TypeError(f"text must be a str, not {text.__class__.__name__}")
    data = {"title": title, "text": text, "fields": dict(fields or {})}
    return put(backend, type, data, subject=subject, dedupe=dedupe)


def _json(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` as JSON the entry can carry: values JSON cannot hold by their repr."""
    if not isinstance(data, Mapping):
        raise TypeError(f"an entry's data is a mapping of names to values, not {data!r}")

    def plain(value: Any) -> Any:
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        return repr(value)

    return {str(name): plain(value) for name, value in data.items()}


# -- reading ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delivery:
    """Where one entry stands with one channel."""

    channel: str  # the channel's name
    state: str  # "pending" or "delivered"
    attempts: int = 0  # tries to this channel so far
    next_at: float | None = None  # when the next try is due (store's clock), if one is
    delivered_at: float | None = None  # when it was delivered (store's clock)
    last_error: str | None = None  # why the latest failed try failed


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of the outbox, as `notifications ls` shows it.

    `state`: "waiting" (written before its transition, which has not been seen yet),
    "due" (to be delivered: not yet delivered to every channel, `undelivered`) or
    "delivered" (to every channel; a granted approval stays in the outbox until its grant
    ends, delivered). `id` is the delivery id a receiver deduplicates on: the same on every
    try, to every channel. `log` holds the latest tries, failed ones included; `tries`
    counts them all."""

    id: str  # the delivery id, `ob_` and 24 hex digits
    type: str  # the entry type: one of `TYPES`, or an alert's own
    at: float  # when it was written (store's clock)
    subject: str | None  # the record's or document's key it is about, if any
    data: dict[str, Any]  # what it says: the fields of its type
    state: str  # "waiting", "due" or "delivered"
    confirmed_at: float | None = None  # when its transition was seen (`at` if none needed)
    deliveries: tuple[Delivery, ...] = ()  # where it stands with each channel, by name
    log: tuple[dict[str, Any], ...] = ()  # the latest tries, failed ones included
    tries: int = 0  # every try so far
    claimed_by: str | None = None  # the dispatcher whose claim it carries, if any
    # The write it waits for (key, token, revision, mark); None when it needs none.
    source: dict[str, Any] | None = field(default=None, repr=False)
    seq: int = field(default=0, repr=False)  # the order of entries one write made
    # Where a delivered entry stands in `Outbox.delivered`'s order: give it as `after` for
    # the next page. None for one not read by that listing.
    position: Position | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, doc: Mapping[str, Any], position: Position | None = None) -> Entry:
        claim = doc.get("claim")
        return cls(
            id=doc["id"], type=doc["type"], at=doc["at"], subject=doc.get("subject"),
            data=dict(doc.get("data") or {}),
            state="waiting" if waits(doc) else doc["state"],
            confirmed_at=doc.get("confirmed_at"),
            deliveries=tuple(
                Delivery(name, d["state"], d.get("attempts", 0), d.get("next_at"),
                         d.get("delivered_at"), d.get("last_error"))
                for name, d in sorted((doc.get("deliveries") or {}).items())
            ),
            log=tuple(doc.get("log") or ()), tries=int(doc.get("tries") or 0),
            claimed_by=claim.get("by") if isinstance(claim, dict) else None,
            source=doc.get("source"), seq=int(doc.get("seq") or 0), position=position,
        )  # fmt: skip

    @property
    def undelivered(self) -> bool:
        """Whether it is still to be delivered: due, and not yet delivered to every channel
        that wants it. The one definition `notify`, `notifications ls --state pending`,
        `doctor` and the `notifications.pending` gauge count by; an entry waiting for its
        transition is not (yet) one, and an approval delivered everywhere but kept in the
        outbox until its grant ends is delivered."""
        return self.state == "due"

    @property
    def failing(self) -> bool:
        """Whether a try to a channel that does not have it yet failed (and none since
        succeeded)."""
        return any(d.last_error and d.state != "delivered" for d in self.deliveries)

    @property
    def summary(self) -> str:
        """One line saying what the entry is about."""
        data = self.data
        if self.type.startswith("approval."):
            return f"{data.get('tool')} {data.get('id')} (round {data.get('round')})"
        if "title" in data:
            return str(data["title"])
        return str(self.subject or TYPES.get(self.type, self.type))


def is_entry(record: Record) -> bool:
    return record.fingerprint == DOCUMENT and record.key.startswith((OUTBOX, DELIVERED))


def _doc(record: Record) -> dict[str, Any]:
    value = decode(record.result)
    if not isinstance(value, dict) or value.get("kind") != "outbox":
        raise CorruptRecord("the ledger", f"the outbox entry under {record.key!r} is not one")
    return value


def waits(doc: Mapping[str, Any]) -> bool:
    """Whether a stored entry document waits for its transition (either word for it)."""
    return doc.get("state") in _WAITING_STATES


def doc_of(record: Record) -> dict[str, Any]:
    """The entry document a record holds."""
    return _doc(record)


def pending(backend: CacheBackend) -> list[tuple[Record, dict[str, Any]]]:
    """Every entry not yet delivered to every channel, with its document: the outbox's
    prefix alone, which a dispatcher keeps small by moving what it delivered."""
    found = backend.select(Select(prefix=OUTBOX))
    return [(r, _doc(r)) for r in found if r.fingerprint == DOCUMENT]


def delivered(
    backend: CacheBackend,
    *,
    before: float | None = None,
    order: Order = Order.KEY,
    after: Position | None = None,
    limit: int | None = None,
) -> Iterator[tuple[Record, dict[str, Any]]]:
    """The entries delivered to every channel (moved out of the outbox; they grow with
    every notification until they are pruned), with their documents, streamed from the
    store's index of them: those moved `before` a time (the store's clock), in `order`
    from `after` on, at most `limit`."""
    query = Select(prefix=DELIVERED, updated_before=before, order=order, after=after, limit=limit)
    for record in backend.select(query):
        if record.fingerprint == DOCUMENT:
            yield record, _doc(record)


#: What `confirmation` finds: the transition happened, may still happen, or never will.
HAPPENED, WAITING, VOID = "happened", "waiting", "void"


def confirmation(backend: CacheBackend, doc: Mapping[str, Any]) -> str:
    """Whether the transition a waiting entry waits for has happened (its mark is in
    the source), may still happen (the source is still what the write would replace), or
    never will (the source moved on without the mark: that write lost its race, or its
    writer died before it and someone else wrote)."""
    source = doc.get("source")
    if not source or not waits(doc):
        return HAPPENED
    held = backend.get(source["key"])
    if held is not None and _marks(held, source):
        return HAPPENED
    if held is None:
        return WAITING if source["revision"] == 0 else VOID
    if (held.token, held.revision) == (source["token"], source["revision"]):
        return WAITING
    return VOID


def _marks(held: Record, source: Mapping[str, Any]) -> bool:
    mark = source.get("mark")
    if mark is not None:  # a document: its marks list
        if held.fingerprint != DOCUMENT:
            return False
        value = decode(held.result)
        return isinstance(value, dict) and mark in (value.get("outbox") or ())
    wanted = source.get("event")
    return any(
        [e.at, e.kind, e.token, e.by] == wanted for e in reversed(held.history)
    )  # a record: the transition's history event


class Outbox:
    """The outbox of the ledger kept in `backend`: what needs a person, and how each
    entry's deliveries went. Reading only; `Dispatcher` delivers. Making one raises
    nothing; its methods raise `LedgerUnavailable` if the store cannot be read."""

    def __init__(self, backend: CacheBackend) -> None:
        self.backend = backend

    def entries(self, *, include_delivered: bool = True, waiting: bool = False) -> list[Entry]:
        """Every entry whose transition happened, oldest first: a waiting one is looked
        up, and shown as due once its transition is seen. With `waiting`, those whose
        transition has not happened yet (and may never) too, as "waiting". With
        `include_delivered` (the default), the entries delivered to every channel and not
        pruned yet too: a list of them all, which grows with every notification
        (`outstanding` and `delivered` read the outbox and a page of the delivered ones
        instead). Raises `LedgerUnavailable` if the store cannot be read (or holds an
        entry document that is not one: `CorruptRecord`)."""
        found = self.outstanding(waiting=waiting)
        if include_delivered:
            # Read after the outbox, so an entry moving meanwhile is in one or both; a
            # dispatcher copies an entry here before deleting the outbox's, and between
            # the two writes (or after dying between them) both exist: one entry, delivered.
            moved = {doc["id"]: Entry.of(doc) for _record, doc in delivered(self.backend)}
            found = [e for e in found if e.id not in moved] + list(moved.values())
        return sorted(found, key=lambda e: (e.at, e.seq, e.id))

    def outstanding(self, *, waiting: bool = False) -> list[Entry]:
        """The entries still in the outbox whose transition happened, oldest first: those
        not yet delivered to every channel, and granted approvals delivered everywhere and
        kept until their grant ends. With `waiting`, those whose transition has not
        happened yet (and may never) too, as "waiting". Few, however many were delivered
        before: the outbox's prefix alone is read. Raises what `entries` raises."""
        found = []
        for _record, doc in pending(self.backend):
            if waits(doc):
                verdict = confirmation(self.backend, doc)
                if verdict == VOID or (verdict == WAITING and not waiting):
                    continue
                if verdict == HAPPENED:
                    doc = {**doc, "state": "due"}
            found.append(Entry.of(doc))
        return sorted(found, key=lambda e: (e.at, e.seq, e.id))

    def delivered(
        self, *, after: Position | None = None, limit: int | None = None
    ) -> Iterator[Entry]:
        """The entries delivered to every channel and moved out of the outbox, the last
        moved first, from `after` on (the `position` of the last entry of the previous
        page), at most `limit`: a page of them read from the store's index, however many
        there are (they are kept until a dispatcher prunes them, 30 days by default).
        Raises `ValueError` for a `limit` below 1 or an `after` that is not a position
        (an (updated_at, key) pair), and `LedgerUnavailable` while it is iterated, if the
        store cannot be read."""
        query = Select(order=Order.NEWEST)
        found = delivered(self.backend, order=Order.NEWEST, after=after, limit=limit)
        for record, doc in found:
            yield Entry.of(doc, query.position(record))

    def position(self, entry_id: str) -> Position | None:
        """Where the delivered entry `entry_id` stands in `delivered`'s order (to list the
        ones after it), or None when no delivered entry has that id. Raises `ValueError`
        for an `entry_id` that is not `ob_` and 24 hex digits, and `LedgerUnavailable` if
        the store cannot be read."""
        record = self.backend.get(DELIVERED + check_id(entry_id))
        return None if record is None else Select(order=Order.NEWEST).position(record)

    def get(self, entry_id: str) -> Entry | None:
        """The entry, if its transition happened (or if it waits for one: "waiting").
        Raises `ValueError` for an `entry_id` that is not `ob_` and 24 hex digits, and
        `LedgerUnavailable` if the store cannot be read."""
        check_id(entry_id)
        for prefix in (OUTBOX, DELIVERED):
            record = self.backend.get(prefix + entry_id)
            if record is not None:
                doc = _doc(record)
                if waits(doc):
                    verdict = confirmation(self.backend, doc)
                    if verdict == VOID:
                        return None
                    if verdict == HAPPENED:
                        doc = {**doc, "state": "due"}
                return Entry.of(doc)
        return None

    def undelivered(self) -> list[Entry]:
        """The entries still to be delivered (`Entry.undelivered`), oldest first: what
        `doctor` counts and `notifications ls --state pending` lists. Raises what
        `entries` raises."""
        return [e for e in self.outstanding() if e.undelivered]
