"""How the Redis ledger answers a `Select`: from the sorted set that serves it, streamed.

Which set serves which select (docs/backends.md has the table):

- a status, a time window, NEWEST / OLDEST pages of everything: the status indexes
  (`i:<STATUS>`, scored by last update; every status's merged for no status), read in
  order from the cursor by score and rank, a batch at a time;
- needs_operator: `x:n` (and the unstamped UNCERTAIN records); expired_by: `x:e`;
- documents by state: `x:s:<bucket>` (key order) or `x:t:<bucket>` (by last update), the
  buckets of the prefix's kinds merged; by subject: `x:k:<subject>`; of a prefix:
  `docs` (key order), or the time buckets of its kinds;
- an ordinary prefix: ZSCAN MATCH of a status index, or SCAN MATCH of the records' hashes:
  the server walks the status index or the keyspace, and only the matches come back.

A set whose order is the select's is streamed in that order (`_by_time`, `_by_key`). The
others give candidate keys in no useful order, which are gathered (keys only, deduped,
held in this process) and put in order, by key or by the update time the status indexes
hold, before any record is read (`_gathered`): the records read are then the page's.

Every record read is checked against the select (`Select.matches`), so a set may hold a
key it should not have (a record that changed since, a stale entry) and the answer is
still exact. The `x:` sets are kept by this release's scripts only: a record another
release wrote (or one written before this release) carries no `x` stamp of its version,
and `heal` gives it its entries when a read meets it (and drops entries whose record is
gone or has moved on). A needs_operator select always also walks the UNCERTAIN index on
the server for unstamped records (in either release only an UNCERTAIN record is flagged,
and only `resolve`, which clears the flag, moves it on), so it is exact beside workers of
the previous release. Until the backfill has stamped every record (`ready`), the other
selects that use an `x:` set walk, the same way, the index that holds every possible
match (COMMITTED for expired_by, `docs` for a state or subject): exact, at the cost of
that walk.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ...ledger._backend import DOCUMENTS, prefix_end
from ...ledger._record import Record, Status
from ...ledger._select import Order, Select
from .._scan import BATCH, ScanCounter
from ._layout import STATUSES, Layout, kinds_under, parse_bucket, stamp
from ._scripts import HEALS, WALK, Scripts

T = TypeVar("T")


class Store(Protocol):
    """What a select needs of the store (`RedisCacheBackend`)."""

    client: Any
    layout: Layout
    lua: Scripts
    _scans: ScanCounter

    def _call(self, what: str, op: Callable[[bool], T], *, retry: bool = True) -> T: ...

    def _decode(self, doc: bytes | str) -> Record: ...


@dataclass(slots=True)
class Read:
    """A record as read for a select: None when its key holds none (or holds another
    ledger's record); `current` when its hash's `x` stamp is its version's."""

    key: str
    record: Record | None
    current: bool


def text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


# -- reading and healing ---------------------------------------------------------------


def fetch(store: Store, keys: list[str]) -> list[Read]:
    """The records under `keys`, in one round trip (one script: a batch of keys costs the
    client one reply, not one per key), counted as rows read."""
    if not keys:
        return []
    layout = store.layout

    def read(_resent: bool) -> list[Any]:
        return list(store.lua.fetch(keys=[], args=[layout.records, *keys]))

    rows = store._call("reading records", read)
    store._scans.read(len(keys))
    found = []
    for n, key in enumerate(keys):
        doc, mark = rows[2 * n], rows[2 * n + 1]
        record = None if doc is None else store._decode(doc)
        if record is None or record.key != key:  # a ledger whose prefix extends ours
            found.append(Read(key, None, False))
            continue
        found.append(Read(key, record, text(mark) == stamp(record.token, record.revision)))
    return found


def heal(store: Store, reads: Iterable[Read], secondary: Iterable[str]) -> None:
    """Make the `x:` entries of what was read right: a record with a stale stamp gets its
    version's entries (if it is still that version), and an entry of `secondary` whose
    record is gone, or whose record (stamped) does not hold it, is removed. One round trip,
    only when there is something to do."""
    layout, lua = store.layout, store.lua
    sets = list(secondary)
    drops: list[tuple[list[str], list[str]]] = []
    heals: list[Any] = []
    for read in reads:
        record = read.record
        gone = [([layout.record(read.key), s], [read.key, field(layout, s)]) for s in sets]
        if record is None:
            drops += gone
            continue
        entries = layout.entries(record)
        if not read.current:
            heals += [read.key, record.token, record.revision, repr(record.updated_at),
                      *entries]  # fmt: skip
            continue
        drops += [
            op for name, op in zip(sets, gone, strict=True) if not entries.holds(name, layout)
        ]
    if not drops and not heals:
        return
    step = 11 * HEALS

    def send(_resent: bool) -> None:
        pipe = store.client.pipeline(transaction=False)
        for keys, args in drops:
            lua.drop(keys=keys, args=args, client=pipe)
        for at in range(0, len(heals), step):
            lua.heal(keys=[layout.needs, layout.expiry, layout.buckets],
                     args=[layout.records, *heals[at : at + step]], client=pipe)  # fmt: skip
        pipe.execute()

    store._call("healing the ledger's indexes", send)


def field(layout: Layout, name: str) -> str:
    """The hash field that names the secondary set `name` when a record is in it."""
    if name == layout.needs:
        return "xn"
    if name == layout.expiry:
        return "xe"
    kind = name[len(layout.prefix) + 2]  # x:s, x:t, x:k
    return {"s": "xs", "t": "xt", "k": "xk"}[kind]


# -- the sets' own orders ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scores:
    """A range of scores: from `low` (inclusive) to `high` (exclusive, or inclusive with
    `closed`); None for no bound."""

    low: float | None = None
    high: float | None = None
    closed: bool = False

    def low_arg(self) -> str:
        return "-inf" if self.low is None else repr(float(self.low))

    def high_arg(self) -> str:
        if self.high is None:
            return "+inf"
        return repr(float(self.high)) if self.closed else "(" + repr(float(self.high))

    def holds(self, score: float) -> bool:
        if self.low is not None and score < self.low:
            return False
        if self.high is None:
            return True
        return score <= self.high if self.closed else score < self.high


def _pairs(flat: list[Any]) -> list[tuple[float, str]]:
    return [(float(flat[i + 1]), text(flat[i])) for i in range(0, len(flat), 2)]


def time_page(
    store: Store,
    name: str,
    newest: bool,
    scores: Scores,
    after: tuple[float, str] | None,
    n: int,
) -> list[tuple[float, str]]:
    """The next `n` (score, member) of the sorted set `name` within `scores`, in order
    (descending with `newest`), strictly after `after`."""
    client, low, high = store.client, scores.low_arg(), scores.high_arg()
    if after is not None:
        if _past_end(scores, after[0], newest):
            return []
        if _past_end(scores, after[0], not newest):
            after = None  # the cursor is before the range: start at its beginning
    if after is None:

        def first(_resent: bool) -> Any:
            if newest:
                return client.zrange(name, high, low, desc=True, byscore=True, offset=0, num=n,
                                     withscores=True)  # fmt: skip
            return client.zrange(name, low, high, byscore=True, offset=0, num=n, withscores=True)

        return [(float(s), text(m)) for m, s in store._call("listing records", first)]
    score, member = after
    at = repr(float(score))

    def by_rank(_resent: bool) -> Any:
        return store.lua.after(keys=[name], args=[at, member, n, 1 if newest else 0])

    found = store._call("listing records", by_rank)
    if found is not None:
        entries = _pairs(found)
    else:
        entries = _past(store, name, newest, scores, at, member, n)
    kept = []
    for entry in entries[:n]:
        if not scores.holds(entry[0]):
            break
        kept.append(entry)
    return kept


def _past_end(scores: Scores, at: float, newest: bool) -> bool:
    """True when nothing within `scores` lies after the score `at` in the order
    (descending with `newest`)."""
    if newest:
        return scores.low is not None and at < scores.low
    if scores.high is None:
        return False
    return at > scores.high or (at == scores.high and not scores.closed)


def _past(
    store: Store, name: str, newest: bool, scores: Scores, at: str, member: str, n: int
) -> list[tuple[float, str]]:
    """`time_page` when the cursor's member has moved or gone: the members tied at its score
    that sort after it (walked a batch at a time), then those strictly past its score."""
    client = store.client
    ties: list[tuple[float, str]] = []
    offset = 0
    while len(ties) < n:

        def tied(_resent: bool, offset: int = offset) -> Any:
            return client.zrange(name, at, at, desc=newest, byscore=True, offset=offset, num=n,
                                 withscores=True)  # fmt: skip

        chunk = [(float(s), text(m)) for m, s in store._call("listing records", tied)]
        ties += [e for e in chunk if (e[1] < member if newest else e[1] > member)]
        if len(chunk) < n:
            break
        offset += n
    if len(ties) >= n:
        return ties[:n]
    far = scores.low_arg() if newest else scores.high_arg()

    def rest(_resent: bool) -> Any:
        return client.zrange(name, f"({at}", far, desc=newest, byscore=True, offset=0,
                             num=n - len(ties), withscores=True)  # fmt: skip

    return ties + [(float(s), text(m)) for m, s in store._call("listing records", rest)]


def time_stream(
    store: Store,
    name: str,
    newest: bool,
    scores: Scores,
    after: tuple[float, str] | None = None,
    n: int = BATCH,
) -> Iterator[tuple[float, str]]:
    """Every (score, member) of a sorted set within `scores`, in order from `after` on,
    `n` per round trip."""
    while True:
        page = time_page(store, name, newest, scores, after, n)
        yield from page
        if len(page) < n:
            return
        after = page[-1]


def lex_stream(store: Store, name: str, low: str, high: str, n: int = BATCH) -> Iterator[str]:
    """The members of a sorted set scored all alike between ZRANGEBYLEX bounds, in key
    order, `n` per round trip, each batch after the last member read."""
    while True:

        def listing(_resent: bool, low: str = low) -> Any:
            return store.client.zrangebylex(name, low, high, start=0, num=n)

        keys = [text(k) for k in store._call("listing records", listing)]
        yield from keys
        if len(keys) < n:
            return
        low = "(" + keys[-1]


def lex_bounds(prefix: str, after: str | None = None) -> tuple[str, str]:
    low = "[" + prefix if prefix else "-"
    if after is not None and after >= prefix:
        low = "(" + after
    end = prefix_end(prefix) if prefix else None
    return low, "+" if end is None else "(" + end


# -- candidates in no useful order ------------------------------------------------------


def set_members(store: Store, name: str, match: str | None = None) -> Iterator[list[str]]:
    """Every member of a sorted set (matching a glob), a ZSCAN step at a time."""
    cursor = 0
    while True:

        def step(_resent: bool, at: int = cursor) -> Any:
            return store.client.zscan(name, at, match=match, count=BATCH)

        cursor, found = store._call("listing records", step)
        yield [text(member) for member, _score in found]
        if not cursor:
            return


def record_keys(store: Store, prefix: str) -> Iterator[list[str]]:
    """The keys of every record starting with `prefix`, by SCAN MATCH over the keyspace."""
    records = store.layout.records
    pattern = glob_escape(records + prefix) + "*"
    cursor = 0
    while True:

        def step(_resent: bool, at: int = cursor) -> Any:
            return store.client.scan(at, match=pattern, count=BATCH)

        cursor, names = store._call("listing records", step)
        yield [text(name)[len(records) :] for name in names]
        if not cursor:
            return


def stale_in_set(store: Store, name: str) -> Iterator[list[str]]:
    """The members of a sorted set whose records' stamps are stale, found on the server a
    ZSCAN step at a time (only those come back)."""
    cursor = "0"
    while True:

        def step(_resent: bool, at: str = cursor) -> Any:
            return store.lua.walk_set(keys=[name], args=[at, WALK, store.layout.records])

        found = store._call("looking for records the indexes miss", step)
        cursor = text(found[0])
        yield [text(k) for k in found[1:]]
        if cursor == "0":
            return


def stale_in_range(store: Store, name: str, low: str, high: str) -> Iterator[list[str]]:
    """As `stale_in_set`, over a ZRANGEBYLEX range of a set scored all alike."""
    while True:

        def step(_resent: bool, low: str = low) -> Any:
            return store.lua.walk_range(keys=[name], args=[low, high, WALK, store.layout.records])

        found = store._call("looking for documents the indexes miss", step)
        yield [text(k) for k in found[2:]]
        if int(found[0]) < WALK:
            return
        low = "(" + text(found[1])


def members_in(store: Store, name: str, scores: Scores) -> Iterator[list[str]]:
    """The members of a sorted set within `scores`, in batches."""
    for batch in _chunks(time_stream(store, name, False, scores), BATCH):
        yield [member for _score, member in batch]


def _chunks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def glob_escape(text: str) -> str:
    """`text` matched literally in a SCAN pattern."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


# -- answering ----------------------------------------------------------------------------


def answer(store: Store, query: Select, ready: bool) -> Iterator[Record]:
    """The records `query` selects, as `Select.apply` says, read from the sets that serve
    it. `ready`: every record carries its `x` stamp (the backfill is done)."""
    # The readers below are generators: islice stops pulling at the limit, so no batch
    # past the last record it yields is fetched.
    return itertools.islice(_matches(store, query, ready), query.limit)


def _matches(store: Store, query: Select, ready: bool) -> Iterator[Record]:
    layout = store.layout
    documents = query.prefix.startswith(DOCUMENTS)
    time_order = query.order is not Order.KEY
    window = Scores(query.updated_from, query.updated_before)
    if documents and (query.state is not None or query.subject is not None):
        return _documents(store, query, ready)
    found: Iterable[list[str]]
    if query.needs_operator:
        # Ready or not: a record the previous release flags is UNCERTAIN (in either
        # release only an UNCERTAIN record is flagged, and only resolve, which clears the
        # flag, moves it on), so the unstamped ones of that index are all it can miss.
        walk = stale_in_set(store, layout.index(Status.UNCERTAIN))
        found = itertools.chain(members_in(store, layout.needs, window), walk)
        return _gathered(store, query, found, [layout.needs])
    if query.expired_by is not None:
        due = Scores(None, query.expired_by, closed=True)
        found = members_in(store, layout.expiry, due)
        if not ready:
            found = itertools.chain(found, stale_in_set(store, layout.index(Status.COMMITTED)))
        return _gathered(store, query, found, [layout.expiry])
    if query.prefix and not documents:
        if query.status is not None:
            match = glob_escape(query.prefix) + "*"
            return _gathered(store, query, set_members(store, layout.index(query.status), match))
        return _gathered(store, query, record_keys(store, query.prefix))
    statuses = [query.status] if query.status is not None else list(STATUSES)
    indexes = [layout.index(status) for status in statuses]
    if documents:
        if not time_order:
            low, high = lex_bounds(query.prefix, query.after)  # type: ignore[arg-type]
            return _by_key(store, query, [(layout.documents, low, high)], secondary=False)
        if ready:
            groups = _buckets(store, query.prefix, None)
            return _by_time(store, query, [layout.time_set(b) for b in groups], secondary=True)
        low, high = lex_bounds(query.prefix)
        listed = _chunks(lex_stream(store, layout.documents, low, high), BATCH)
        return _gathered(store, query, listed)
    if time_order:
        return _by_time(store, query, indexes, secondary=False)
    if window.low is None and window.high is None:
        if query.status is None:
            return _gathered(store, query, record_keys(store, ""))
        return _gathered(store, query, set_members(store, indexes[0]))
    within = itertools.chain(*(members_in(store, index, window) for index in indexes))
    return _gathered(store, query, within)


def _documents(store: Store, query: Select, ready: bool) -> Iterator[Record]:
    layout = store.layout
    if query.subject is not None:
        low, high = lex_bounds(query.prefix)
        subject = layout.subject_set(query.subject)
        found: Iterable[list[str]] = _chunks(lex_stream(store, subject, low, high), BATCH)
        if not ready:
            found = itertools.chain(found, stale_in_range(store, layout.documents, low, high))
        return _gathered(store, query, found, [subject])
    groups = _buckets(store, query.prefix, query.state)
    if not ready:
        low, high = lex_bounds(query.prefix)
        sets = [layout.state_set(b) for b in groups]
        found = itertools.chain(
            *(_chunks(lex_stream(store, s, low, high), BATCH) for s in sets),
            stale_in_range(store, layout.documents, low, high),
        )
        return _gathered(store, query, found, sets)
    if query.order is Order.KEY:
        low, high = lex_bounds(query.prefix, query.after)  # type: ignore[arg-type]
        ranges = [(layout.state_set(b), low, high) for b in groups]
        return _by_key(store, query, ranges, secondary=True)
    return _by_time(store, query, [layout.time_set(b) for b in groups], secondary=True)


def _buckets(store: Store, prefix: str, state: str | None) -> list[str]:
    """The document buckets that can hold keys under `prefix` (in `state`, if given)."""
    names = store._call("listing documents", lambda _: store.client.smembers(store.layout.buckets))
    found = []
    for name in sorted(text(n) for n in names):
        kind, held = parse_bucket(name)
        if kinds_under(kind, prefix) and (state is None or held == state):
            found.append(name)
    return found


def _limit(query: Select) -> int:
    return BATCH if query.limit is None else max(1, min(BATCH, query.limit))


def _by_time(store: Store, query: Select, sets: list[str], *, secondary: bool) -> Iterator[Record]:
    """Sorted sets scored by last update whose union holds every match, merged in the
    select's order and read a batch at a time."""
    newest = query.order is Order.NEWEST
    window = Scores(query.updated_from, query.updated_before)
    after = query.after if isinstance(query.after, tuple) else None
    n = _limit(query)
    streams = [time_stream(store, name, newest, window, after, n) for name in sets]
    merged = heapq.merge(*streams, reverse=newest)
    for batch in _chunks(merged, n):
        reads = fetch(store, [key for _score, key in batch])
        heal(store, reads, sets if secondary else ())
        for (score, _key), read in zip(batch, reads, strict=True):
            record = read.record
            # An entry whose score is not the record's time is a stale one (or the record
            # moved while this select ran): the record stands where its time puts it.
            if record is None or record.updated_at != score:
                continue
            if query.matches(record) and query.beyond(record):
                yield record


def _by_key(
    store: Store, query: Select, sets: list[tuple[str, str, str]], *, secondary: bool
) -> Iterator[Record]:
    """Sorted sets scored all alike (name, low, high) whose union holds every match,
    merged in key order and read a batch at a time."""
    n = _limit(query)
    streams = [lex_stream(store, name, low, high, n) for name, low, high in sets]
    merged = (key for key, _ in itertools.groupby(heapq.merge(*streams)))
    names = [name for name, _, _ in sets] if secondary else []
    for batch in _chunks(merged, n):
        reads = fetch(store, batch)
        heal(store, reads, names)
        for read in reads:
            record = read.record
            if record is not None and query.matches(record) and query.beyond(record):
                yield record


def _gathered(
    store: Store, query: Select, found: Iterable[list[str]], secondary: list[str] | None = None
) -> Iterator[Record]:
    """Candidate keys in no useful order: gathered (keys only), put in the select's order
    (by key, or by the time the status indexes hold), then read a page at a time."""
    keys: set[str] = set()
    for batch in found:
        keys.update(k for k in batch if k.startswith(query.prefix))
    ordered: list[Any]
    if query.order is Order.KEY:
        after = query.after
        ordered = sorted(k for k in keys if after is None or k > after)  # type: ignore[operator]
    else:
        window = Scores(query.updated_from, query.updated_before)
        times = _times(store, sorted(keys))
        entries = [(s, k) for k, s in times.items() if window.holds(s)]
        if query.after is not None:
            after = query.after
            newest = query.order is Order.NEWEST
            entries = [e for e in entries if (e < after if newest else e > after)]  # type: ignore[operator]
        ordered = sorted(entries, reverse=query.order is Order.NEWEST)
    for batch in _chunks(ordered, _limit(query)):
        batch_keys = [e if isinstance(e, str) else e[1] for e in batch]
        reads = fetch(store, batch_keys)
        heal(store, reads, secondary or ())
        for entry, read in zip(batch, reads, strict=True):
            record = read.record
            if record is None or (isinstance(entry, tuple) and record.updated_at != entry[0]):
                continue
            if query.matches(record) and query.beyond(record):
                yield record


def _times(store: Store, keys: list[str]) -> dict[str, float]:
    """The last update of each key as its status index holds it (without reading a
    record); a key in no status index (deleted) is left out."""
    found: dict[str, float] = {}
    for batch in _chunks(keys, BATCH):

        def scores(_resent: bool, batch: list[str] = batch) -> list[Any]:
            pipe = store.client.pipeline(transaction=False)
            for index in store.layout.indexes:
                pipe.zmscore(index, batch)
            return list(pipe.execute())

        for column in store._call("reading update times", scores):
            for key, score in zip(batch, column, strict=True):
                if score is not None:
                    found.setdefault(key, float(score))
    return found
