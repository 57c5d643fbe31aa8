"""A record's history as a hash chain: each event carries the digest of the chain up to it.

    digest(0) = SHA-256(TAG, the key, event 0)
    digest(i) = SHA-256(digest(i - 1), event i [, the digest of the decision signed with it])

An event is the JSON array of its five fields (at, kind, token, by, note) and the digest
of the decision signed with it, if any (written by pydantic-core's encoder, the one the
record itself is written with: the same values give the same bytes wherever they are
read back, from a store or an export); a signed decision (a resolution) is its RFC 8785
JSON with its signature envelope. The digests are
stored beside the history (`Record.chain`, one per event) rather than inside it: the
previous release reads each event as exactly five fields.

The history is bounded (`HISTORY_LIMIT`: the first event and the last ones): when events
are cut, the digest of the last one cut stays as the `anchor` the next one links to, with
how many were cut, so the events that remain still verify. A record written by a release
that kept no chain (or whose chain was stripped) is chained again by the next write of
this one, which marks where it started (`chain_from`): `crewai-idempotent verify` says so
instead of passing it.

What a chain proves: an event edited, removed or moved by a writer who did not also
recompute every digest after it. Anyone who can write the ledger can recompute them (there
is no secret here); an earlier export (`verify --against`) catches that, and a decision's
signature (`crewai_idempotent.signing`) cannot be recomputed without its key.

`check` reads a stored document (a record's JSON, or a line of `export`) and says what is
wrong with its chain; it imports nothing of the package, so that `_record` can use the
rest of this module.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic_core
import rfc8785

TAG = b"crewai-idempotent/chain/v1\x00"
_HEX = re.compile(r"^[0-9a-f]{64}$")
_sha256 = hashlib.sha256


def _field(text: str) -> bytes:
    # backslashreplace: a lone surrogate is stored escaped (`Record.to_json`), and the
    # escaped text encodes to these same bytes, so the digest survives the round trip.
    data = text.encode("utf-8", "backslashreplace")
    return len(data).to_bytes(4, "big") + data


def start(key: str) -> bytes:
    """What the first event of `key`'s history links to: the chain belongs to its key."""
    return TAG + _field(key)


def link(
    prev: bytes, at: float, kind: str, token: int, by: str, note: str, signed: bytes | None = None
) -> str:
    """The digest (hex) of an event after `prev` (the digest before it, as bytes, or
    `start(key)` for the first), covering `signed` (`decision_digest`) when the event
    carries a signed decision."""
    fields = [at, kind, token, by, note, None if signed is None else signed.hex()]
    try:
        data = pydantic_core.to_json(fields)
    except pydantic_core.PydanticSerializationError:
        # A lone surrogate: the record stores it escaped (`Record.to_json`), so is it here.
        data = pydantic_core.to_json([_escaped(value) for value in fields])
    return _sha256(prev + data).hexdigest()


def _escaped(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def decision_digest(decision: Mapping[str, Any], signature: Mapping[str, Any] | None) -> bytes:
    """The digest of a decision and its signature envelope as stored (their JSON)."""
    stored = [dict(decision), None if signature is None else dict(signature)]
    return _sha256(rfc8785.dumps(stored)).digest()


#: A decision stored on a record: the sequence number of the event it was made with, the
#: decision's JSON (`signing.Decision.to_json`) and its envelope's (None: unsigned).
Signed = tuple[int, dict[str, Any], dict[str, Any] | None]


def signed_digests(signed: Sequence[Signed]) -> dict[int, bytes]:
    return {seq: decision_digest(decision, signature) for seq, decision, signature in signed}


def seq_of(index: int, cut: tuple[int, str] | None) -> int:
    """The sequence number (from 0, over every event ever written) of the event at
    `index` of a history whose cut is `cut` (how many were cut after the first, anchor)."""
    return index if index == 0 or cut is None else index + cut[0]


def digests(
    key: str,
    history: Sequence[Any],
    cut: tuple[int, str] | None = None,
    signed: Sequence[Signed] = (),
) -> tuple[str, ...]:
    """The chain of a whole history (events with at, kind, token, by, note)."""
    attached = signed_digests(signed) if signed else {}
    out: list[str] = []
    prev = start(key)
    for index, event in enumerate(history):
        if index == 1 and cut is not None:
            prev = bytes.fromhex(cut[1])
        digest = link(
            prev, event.at, event.kind, event.token, event.by, event.note,
            attached.get(seq_of(index, cut)),
        )  # fmt: skip
        out.append(digest)
        prev = bytes.fromhex(digest)
    return tuple(out)


# -- checking a stored document ------------------------------------------------------------

#: What `check` may find wrong, in one word each.
PROBLEMS = (
    "edited", "removed", "inserted", "reordered", "truncated", "cut", "unchained", "malformed",
    "unsigned", "signature", "subject", "rewritten", "deleted",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a record's history: `kind` (one of `PROBLEMS`) and what, as a
    person reads it."""

    kind: str
    detail: str


@dataclass(frozen=True, slots=True)
class _Event:
    at: float
    kind: str
    token: int
    by: str
    note: str


def events_of(doc: Mapping[str, Any]) -> list[_Event]:
    """A stored document's history: lists of five (a record) or objects (an export).
    Raises `ValueError` for one that is neither."""
    history = doc.get("history")
    if not isinstance(history, list):
        raise ValueError("its history is not a list")
    out = []
    for number, item in enumerate(history, 1):
        fields: list[Any]
        if isinstance(item, Mapping):
            fields = [item.get(name) for name in ("at", "kind", "token", "by", "note")]
        elif isinstance(item, list) and len(item) == 5:
            fields = list(item)
        else:
            raise ValueError(f"event #{number} is not an event: {item!r:.80}")
        at, kind, token, by, note = fields
        if (
            isinstance(at, bool)
            or not isinstance(at, int | float)
            or isinstance(token, bool)
            or not isinstance(token, int)
            or not all(isinstance(text, str) for text in (kind, by, note))
        ):
            raise ValueError(f"event #{number} has a field of the wrong type: {item!r:.80}")
        out.append(_Event(at, str(kind), token, str(by), str(note)))
    return out


@dataclass(frozen=True, slots=True)
class Chain:
    """A document's chain as stored: digests, cut, where it started, signed decisions."""

    digests: list[str]
    cut: tuple[int, str] | None
    started: tuple[int, float] | None  # chain_from
    signed: list[Signed]
    resolved: int | None

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> Chain | None:
        """The chain `doc` stores, None when it stores none. Raises `ValueError` for one
        that is malformed."""
        stored = doc.get("chain")
        if stored is None:
            if any(doc.get(name) is not None for name in ("chain_cut", "chain_from")):
                raise ValueError("its chain's cut or start is there, its digests are not")
            return None
        if not isinstance(stored, list) or not all(
            isinstance(d, str) and _HEX.match(d) for d in stored
        ):
            raise ValueError("its chain is not a list of SHA-256 digests")
        cut = _cut(doc.get("chain_cut"))
        started = _started(doc.get("chain_from"))
        signed = _signed(doc.get("signed"))
        resolved = doc.get("resolved")
        if resolved is not None and (isinstance(resolved, bool) or not isinstance(resolved, int)):
            raise ValueError(f"its resolution mark is not an event's number: {resolved!r:.40}")
        return cls(list(stored), cut, started, signed, resolved)


def _cut(stored: Any) -> tuple[int, str] | None:
    if stored is None:
        return None
    if (
        isinstance(stored, list | tuple)
        and len(stored) == 2
        and isinstance(stored[0], int)
        and not isinstance(stored[0], bool)
        and stored[0] > 0
        and isinstance(stored[1], str)
        and _HEX.match(stored[1])
    ):
        return (stored[0], stored[1])
    raise ValueError(f"not a chain's cut (events cut, anchor digest): {stored!r:.100}")


def _started(stored: Any) -> tuple[int, float] | None:
    if stored is None:
        return None
    if (
        isinstance(stored, list | tuple)
        and len(stored) == 2
        and isinstance(stored[0], int)
        and not isinstance(stored[0], bool)
        and stored[0] >= 0
        and isinstance(stored[1], int | float)
        and not isinstance(stored[1], bool)
    ):
        return (stored[0], float(stored[1]))
    raise ValueError(f"not where a chain started (event, time): {stored!r:.100}")


def _signed(stored: Any) -> list[Signed]:
    if stored is None:
        return []
    if not isinstance(stored, list):
        raise ValueError("its signed decisions are not a list")
    out: list[Signed] = []
    for item in stored:
        if (
            isinstance(item, list | tuple)
            and len(item) == 3
            and isinstance(item[0], int)
            and not isinstance(item[0], bool)
            and isinstance(item[1], dict)
            and (item[2] is None or isinstance(item[2], dict))
        ):
            out.append((item[0], item[1], item[2]))
        else:
            raise ValueError(f"not a signed decision (event, decision, signature): {item!r:.100}")
    return out


def check(
    doc: Mapping[str, Any], *, since: float | None = None, limit: int | None = None
) -> list[Problem]:
    """What is wrong with the chain of the stored record `doc` (its JSON decoded, or an
    `export` line): an event edited, inserted, removed or moved, a history cut short, a
    chain that is missing or starts part-way (accepted when what it does not cover was
    written before `since`, seconds since the epoch). `limit`: the history limit a cut
    history must be at (`HISTORY_LIMIT`). An empty list: nothing found. Raises nothing."""
    key = doc.get("key")
    if not isinstance(key, str):
        return [Problem("malformed", "it names no key")]
    try:
        events = events_of(doc)
        chain = Chain.of(doc)
    except ValueError as exc:
        return [Problem("malformed", str(exc))]
    if chain is None:
        if not events:
            return []  # a document (an approval, a budget, an outbox entry): no history
        last = max([e.at for e in events] + [_number(doc.get("updated_at"))])
        if since is not None and last < since:
            return []
        return [
            Problem(
                "unchained",
                f"its {len(events)} event(s) carry no chain: it was last written by a release "
                "that keeps none (during a rolling upgrade), or its chain was stripped"
                + (f"; its last write is not before --since ({_stamp(last)})" if since else ""),
            )
        ]
    problems = _links(key, events, chain)
    cut = chain.cut
    if cut is not None and limit is not None and len(events) != limit:
        problems.append(
            Problem(
                "cut",
                f"its history says {cut[0]} event(s) were cut, but it holds {len(events)}, not "
                f"the {limit} a history is cut at: events were removed",
            )
        )
    seqs = {seq_of(index, cut) for index in range(len(events))}
    for seq, decision, _ in chain.signed:
        if seq not in seqs:
            problems.append(
                Problem(
                    "inserted",
                    f"a signed decision ({decision.get('kind')!r:.40}) is attached to event "
                    f"{seq}, which its history does not hold",
                )
            )
    if chain.resolved is not None and chain.resolved not in seqs:
        problems.append(
            Problem("inserted", f"it is marked resolved by event {chain.resolved}, which it lacks")
        )
    started = chain.started
    if started is not None and (since is None or started[1] >= since):
        problems.append(
            Problem(
                "unchained",
                f"its events before #{started[0] + 1} carry no chain of their own: written by "
                "a release that keeps none, or their chain was stripped, and chained again by "
                "a later write" + (f" (the last of them at {_stamp(started[1])})" if since else ""),
            )
        )
    return problems


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _stamp(at: float) -> str:
    try:
        return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    except (OverflowError, OSError, ValueError):
        return repr(at)


def _links(key: str, events: list[_Event], chain: Chain) -> list[Problem]:
    """Each event against the digest at its place; where they disagree, which events
    match which places, to say what was done: edited, removed, inserted or moved."""
    stored, cut = chain.digests, chain.cut
    attached = signed_digests(chain.signed)

    def prev(place: int) -> bytes:
        if place == 0:
            return start(key)
        if place == 1 and cut is not None:
            return bytes.fromhex(cut[1])
        return bytes.fromhex(stored[place - 1])

    def fits(event: _Event, place: int) -> bool:
        signed = attached.get(seq_of(place, cut))
        digest = link(prev(place), event.at, event.kind, event.token, event.by, event.note, signed)
        return digest == stored[place]

    if len(stored) == len(events) and all(fits(e, i) for i, e in enumerate(events)):
        return []
    # Something moved: find each event's place (n is at most the history limit).
    places: list[int | None] = []
    taken: set[int] = set()
    for index, event in enumerate(events):
        order = [p for p in range(len(stored)) if p != index]
        if index < len(stored):
            order.insert(0, index)  # its own place first: an untouched event is found at once
        place = next((p for p in order if p not in taken and fits(event, p)), None)
        if place is not None:
            taken.add(place)
        places.append(place)
    problems: list[Problem] = []

    def name(index: int) -> str:
        event = events[index]
        return f"event #{index + 1} ({event.kind} by {event.by}, {_stamp(event.at)})"

    found = [(index, place) for index, place in enumerate(places) if place is not None]
    moved = [
        f"{name(index)} is in place {index + 1}, not {place + 1}"
        for (index, place), (_, before) in zip(found[1:], found, strict=False)
        if place < before
    ]
    if moved:
        problems.append(Problem("reordered", "its events are out of order: " + "; ".join(moved)))
    lost = [place for place in range(len(stored)) if place not in taken]
    strays = [index for index, place in enumerate(places) if place is None]
    for index in strays:
        if lost:
            place = lost.pop(0)
            what = "it"
            if seq_of(place, cut) in attached:
                what = "it or the decision signed with it (a signature replaced?)"
            problems.append(
                Problem(
                    "edited",
                    f"{name(index)} does not match its digest: {what} was edited, or an "
                    "event before it removed",
                )
            )
        else:
            problems.append(Problem("inserted", f"{name(index)} has no place in its chain"))
    if lost:
        tail = all(place >= len(events) for place in lost) and not strays
        problems.append(
            Problem(
                "truncated" if tail else "removed",
                f"{len(lost)} event(s) its chain holds are missing from its history "
                f"(place(s) {', '.join(str(p + 1) for p in lost)} of {len(stored)})",
            )
        )
    return problems
