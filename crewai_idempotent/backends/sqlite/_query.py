"""How the SQLite ledger answers a `Select`: from which index, in what steps.

A select is read in two steps. First its *candidates*, the (updated_at, key) of the
records an index says may match, in the select's order, read from the index alone (a few
hundred entries per statement, each statement starting after the last entry read); then
the candidates' records, by key, a batch at a time, each re-checked with
`Select.matches` (an index may say "maybe") and, in a time order, dropped if it moved
since its entry was read (it was written meanwhile: a scan may or may not yield such a
record). The records are what `scan_stats()` counts, as the scans count theirs.

Which index (`_indexes` has the tables), first that applies:

1. `state` / `subject`: the documents' table, by (state, key), (state, updated_at) or
   (subject, updated_at), merged with the entries marked `AMBIGUOUS`.
2. `needs_operator`: the flagged table, (updated_at, key), status beside it.
3. `expired_by`: the expiry table, (expires, updated_at, key): every entry at or below the
   select's time, sorted by SQLite into the select's order a window at a time.
4. the key order, no time range: the primary key, or the status index (status, key),
   records read directly, as a scan reads them.
5. a prefix naming one kind of document (`crewai-idempotent/approval/`): the documents'
   (kind, updated_at).
6. anything else: per status, merged across statuses (`heapq.merge`, each read a window
   at a time): COMMITTED and FAILED from the time table (status, updated_at, key), PENDING
   and UNCERTAIN (the few in flight or waiting for a person, which a claim adds to no
   table) from the status index, sorted by SQLite in a time order.

An index that does not give the select's order (the key order from a time index, any
order from the expiry table) is sorted by SQLite, a window of `WINDOW` entries per
statement: each window reads every entry its conditions leave, so a listing of N such
records costs about N * N / WINDOW entries (index entries, not records).

Until the index tables are complete (`_indexes.ready`), a select reads the primary key
(a prefix's range) or the status index, as a scan does, filtered; a time order then holds
what matched to sort it, as `Select.apply` does.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ...ledger._backend import prefix_end
from ...ledger._record import Record, Status, read_record
from ...ledger._select import DOCUMENTS, Order, Select
from .._scan import BATCH
from . import _indexes as ix

#: Index entries per statement when SQLite sorts them into the select's order.
WINDOW = 16384

Run = Callable[[str, tuple[Any, ...]], list[Any]]
Candidate = tuple[float, str]  # (updated_at, key)

_STATUSES = tuple(Status)
# Every key under DOCUMENTS has a kind: the segment after it, with its slash.
_KIND_START = len(DOCUMENTS)


class Query:
    """One select against one ledger: `run(sql, params)` runs a statement as one
    operation of the store (its fork gate, its connection), `read(n)` counts the records
    read, `where` names the file in a corrupt record's message."""

    __slots__ = ("_after", "_limit", "_order", "_q", "_read", "_run", "_where")

    def __init__(self, query: Select, run: Run, read: Callable[[int], None], where: str) -> None:
        self._q = query
        self._run = run
        self._read = read
        self._where = where
        self._order = query.order
        self._limit = query.limit
        self._after = query.after

    # -- the answer ----------------------------------------------------------------------

    def indexed(self) -> Iterator[Record]:
        """The answer from the index tables (complete: `_indexes.ready`)."""
        q = self._q
        if q.expired_by is not None and q.status not in (None, Status.COMMITTED):
            return iter(())  # only a COMMITTED record expires
        if q.expired_by is not None and math.isnan(q.expired_by):
            return iter(())  # nothing is at or before NaN
        candidates = self._candidates()
        if candidates is None:
            return self._direct(q.status, q.prefix, self._after_key(), self._limit)
        return self._records(candidates)

    def unindexed(self) -> Iterator[Record]:
        """The answer while the index tables are being filled: a range of the primary
        key or of the status index, filtered (and, in a time order, sorted)."""
        q = self._q
        if q.order is Order.KEY:
            return self._direct(q.status, q.prefix, self._after_key(), q.limit)
        return q.apply(self._direct(q.status, q.prefix, None, None))

    # -- records -------------------------------------------------------------------------

    def _direct(
        self, status: Status | None, prefix: str, after: str | None, limit: int | None
    ) -> Iterator[Record]:
        """Records in key order, read with their documents from the primary key (or the
        status index) a batch at a time, from the key after `after`, re-checked."""
        q = self._q
        start, op = prefix, ">="
        if after is not None and after >= prefix:
            start, op = after, ">"
        end = prefix_end(prefix) if prefix else None
        if end is not None and start >= end:
            return
        head: tuple[Any, ...] = () if status is None else (status.value,)
        found = 0
        while True:
            size = BATCH if limit is None else min(BATCH, max(limit - found, 1))
            tail: tuple[Any, ...] = (size,) if end is None else (end, size)
            rows = self._run(_direct_sql(status is not None, op, end is not None),
                             (*head, start, *tail))  # fmt: skip
            self._read(len(rows))
            for _key, doc in rows:
                record = read_record(doc, self._where)
                if q.matches(record) and q.beyond(record):
                    yield record
                    found += 1
                    if limit is not None and found >= limit:
                        return
            if len(rows) < size:
                return
            start, op = rows[-1][0], ">"

    def _records(self, candidates: Iterator[Candidate]) -> Iterator[Record]:
        """The candidates' records, fetched by key a batch at a time, re-checked, in the
        candidates' order, up to the limit."""
        q, limit = self._q, self._limit
        timed = self._order is not Order.KEY
        found = 0
        previous: Candidate | None = None
        while True:
            size = BATCH if limit is None else min(BATCH, limit - found)
            batch: list[Candidate] = []
            for candidate in candidates:
                if candidate == previous:  # the same entry from two merged streams
                    continue
                previous = candidate
                batch.append(candidate)
                if len(batch) >= size:
                    break
            if not batch:
                return
            keys = [key for _at, key in batch]
            width = _width(len(keys))
            rows = self._run(_fetch_sql(width), (*keys, *([None] * (width - len(keys)))))
            self._read(len(rows))
            docs = dict(rows)
            for at, key in batch:
                doc = docs.get(key)
                if doc is None:
                    continue  # deleted since its entry was read
                record = read_record(doc, self._where)
                if timed and record.updated_at != at:
                    continue  # written since: it stands elsewhere in this order now
                if q.matches(record) and q.beyond(record):
                    yield record
                    found += 1
                    if limit is not None and found >= limit:
                        return
            if len(batch) < size:
                return

    # -- candidates ----------------------------------------------------------------------

    def _candidates(self) -> Iterator[Candidate] | None:
        """The candidates from the index that serves this select best; None when the
        primary key or the status index gives its records directly (`_direct`)."""
        q = self._q
        timed = q.order is not Order.KEY
        if q.state is not None or q.subject is not None:
            return self._documents()
        if q.needs_operator:
            where, params = ([], []) if q.status is None else (["status = ?"], [q.status.value])
            return self._stream(ix.FLAGGED, where, params, exact=timed)
        if q.expired_by is not None:
            bound = max(ix.UNSURE, min(_floor(q.expired_by), 2**63 - 1))
            return self._stream(ix.EXPIRY, ["expires <= ?"], [bound], exact=False)
        if not timed and q.updated_from is None and q.updated_before is None:
            return None
        kind = _kind(q.prefix)
        if kind is not None:
            source = f"{ix.DOCS} INDEXED BY {ix.DOCS_KIND_TIME}"
            return self._stream(source, ["kind = ?"], [kind], exact=timed)
        statuses = _STATUSES if q.status is None else (q.status,)
        return self._merge(self._by_status(status, timed) for status in statuses)

    def _by_status(self, status: Status, timed: bool) -> Iterator[Candidate]:
        """One status's records: a settled status from the time table, one in flight
        (PENDING, UNCERTAIN: few) from the status index, sorted by SQLite in a time order."""
        if status.value in ix.SETTLED:
            return self._stream(ix.TIME, ["status = ?"], [status.value], exact=timed)
        source = "idempotency_records INDEXED BY idempotency_records_status"
        return self._stream(source, ["status = ?"], [status.value], exact=not timed)

    def _documents(self) -> Iterator[Candidate]:
        """Documents by state or subject: one stream for the value, one for the entries
        the trigger could not be sure of (`AMBIGUOUS`), merged."""
        q = self._q
        keyed = q.order is Order.KEY
        extra: list[str] = []
        extra_params: list[Any] = []
        value: Any
        if q.state is not None:
            field, value = "state", q.state
            index = ix.DOCS_STATE_KEY if keyed else ix.DOCS_STATE_TIME
            exact = True
            if q.subject is not None:
                extra, extra_params = ["(subject = ? OR subject = ?)"], [q.subject, ix.AMBIGUOUS]
        else:
            field, value = "subject", q.subject
            index, exact = ix.DOCS_SUBJECT_TIME, not keyed
        source = f"{ix.DOCS} INDEXED BY {index}"
        return self._merge(
            self._stream(source, [f"{field} = ?", *extra], [wanted, *extra_params], exact=exact)
            for wanted in (value, ix.AMBIGUOUS)
        )

    def _merge(self, streams: Iterable[Iterator[Candidate]]) -> Iterator[Candidate]:
        streams = list(streams)
        if len(streams) == 1:
            return streams[0]
        if self._order is Order.KEY:
            return heapq.merge(*streams, key=_by_key)
        return heapq.merge(*streams, reverse=self._order is Order.NEWEST)

    def _stream(
        self, source: str, where: list[str], params: list[Any], *, exact: bool
    ) -> Iterator[Candidate]:
        """The entries of `source` that meet `where` and the select's key and time ranges,
        in its order from its `after` on, a window per statement, each after the last
        entry read. `exact`: the index gives the order (a window is a range of it);
        otherwise SQLite sorts what the conditions leave, and windows are larger."""
        q, order = self._q, self._order
        by = {
            Order.KEY: "key",
            Order.OLDEST: "updated_at, key",
            Order.NEWEST: "updated_at DESC, key DESC",
        }[order]
        limit = self._limit
        most = BATCH if exact else WINDOW
        size = most if limit is None else min(most, limit)
        after = self._after
        while True:
            window = _bounds(order, q.prefix, q.updated_from, q.updated_before, after)
            if window is None:
                return  # the position is past every key the prefix allows
            bounds, values = window
            sql = (
                f"SELECT updated_at, key FROM {source} "
                f"WHERE {' AND '.join([*where, *bounds]) or '1'} ORDER BY {by} LIMIT ?"
            )
            rows = self._run(sql, (*params, *values, size))
            for at, key in rows:
                yield at, key
            if len(rows) < size:
                return
            at, key = rows[-1]
            after = key if order is Order.KEY else (at, key)
            size = min(most, size * 4)  # re-checks dropped some: read further at once

    def _after_key(self) -> str | None:
        after = self._after
        return after if isinstance(after, str) else None


def _by_key(candidate: Candidate) -> str:
    return candidate[1]


def _bounds(
    order: Order, prefix: str, start: float | None, before: float | None, after: Any
) -> tuple[list[str], list[Any]] | None:
    """The conditions of a window: the prefix's key range, the time range, and the
    position to continue after, each bound given once (of two lower bounds on one column,
    SQLite would seek by either: the one it chose might be the looser). None when no key
    can follow `after` under the prefix."""
    where: list[str] = []
    values: list[Any] = []
    low: str | None = prefix or None
    end = prefix_end(prefix) if prefix else None
    if order is Order.KEY and after is not None and (low is None or after >= low):
        if end is not None and after >= end:
            return None
        where.append("key > ?")
        values.append(after)
    elif low is not None:
        where.append("key >= ?")
        values.append(low)
    if end is not None:
        where.append("key < ?")
        values.append(end)
    if order is Order.OLDEST and after is not None and (start is None or after[0] >= start):
        at, key = after
        where.append("updated_at >= ? AND (updated_at > ? OR key > ?)")
        values += [at, at, key]
    elif start is not None:
        where.append("updated_at >= ?")
        values.append(start)
    if order is Order.NEWEST and after is not None and (before is None or after[0] < before):
        at, key = after
        where.append("updated_at <= ? AND (updated_at < ? OR key < ?)")
        values += [at, at, key]
    elif before is not None:
        where.append("updated_at < ?")
        values.append(before)
    return where, values


def _kind(prefix: str) -> str | None:
    """The kind of document every key under `prefix` is (the documents' table's `kind`),
    or None when the prefix does not name one whole kind."""
    if not prefix.startswith(DOCUMENTS):
        return None
    rest = prefix[_KIND_START:]
    slash = rest.find("/")
    return None if slash < 0 else rest[: slash + 1]


def _floor(at: float) -> int:
    if math.isinf(at):
        return 2**63 - 1 if at > 0 else ix.UNSURE
    return math.floor(at)


def _width(count: int) -> int:
    """Placeholders for `count` keys: a power of two, so a handful of statements serve
    every batch (the rest bound to NULL, which no key equals)."""
    width = 1
    while width < count:
        width *= 2
    return width


_FETCH: dict[int, str] = {}


def _fetch_sql(width: int) -> str:
    sql = _FETCH.get(width)
    if sql is None:
        marks = ", ".join("?" * width)
        sql = _FETCH[width] = f"SELECT key, doc FROM idempotency_records WHERE key IN ({marks})"
    return sql


def _direct_sql(status: bool, op: str, bounded: bool) -> str:
    where = ["status = ?"] if status else []
    where.append(f"key {op} ?")
    if bounded:
        where.append("key < ?")
    index = " INDEXED BY idempotency_records_status" if status else ""
    return (
        f"SELECT key, doc FROM idempotency_records{index} WHERE {' AND '.join(where)} "
        "ORDER BY key LIMIT ?"
    )
