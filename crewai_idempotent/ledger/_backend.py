"""The few atomic operations a ledger store must provide.

A backend stores one `Record` per key. The guard needs only:

* `insert` — store a record if its key is absent (the claim), atomically;
* `replace` — store a record if the stored one is still `current` (same token and
  revision), atomically; every transition after the claim goes through it;
* `get`, `scan` and `delete` for replays, waiting, inspection and clean-up;
* `peek` — a light read for the replay fast path (by default, `get`);
* `scan_prefix` — the records under a key prefix, for the package's own documents
  (by default a `scan`; the stores answer it from an index).

Backends raise `LedgerUnavailable` with a specific message when they cannot read or
write; the guard treats any other exception from a backend the same way (fail closed).
"""

from __future__ import annotations

import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

from ._hostclock import HostClock
from ._record import Peek, Record, Status
from ._select import DOCUMENTS, Select

__all__ = ["DOCUMENTS", "CacheBackend", "ledger_option", "mark_default", "prefix_end", "url_of"]


class CacheBackend(ABC):
    """Base class of ledger stores. Subclasses must be safe to share between threads.
    Each operation below says what it raises: `LedgerUnavailable` for a store that cannot
    be used (the ledger treats anything else a store raises the same way: fail closed)."""

    #: True when a read is cheap and local (an embedded store): the guard then peeks
    #: before claiming, so a replay never takes the store's write lock. A server store
    #: keeps its single round trip (its claim statement already returns the holder).
    read_first: bool = False

    #: The host's step-free clock (`_hostclock.this_host()`) for a store that every
    #: process using it runs on one host (SQLite, the file lock, memory): leases, TTLs
    #: and approval grants are then judged by it, which no wall-clock step moves, and
    #: `now()` is only what records show. None for a store shared by hosts (its `now()`
    #: is the server's clock) and for stores that do not say: judged by `now()` alone.
    host_clock: HostClock | None = None

    def now(self) -> float:
        """The store's clock in epoch seconds: the times records show, and what leases and
        TTLs are judged by where there is no `host_clock`. Raises `LedgerUnavailable` if
        a server store cannot read its server's clock."""
        return time.time()

    def now_blocks(self) -> bool:
        """True when `now()` would ask a server (no reading yet, or a refresh is due).

        The async path then reads the clock on a worker thread before deciding, so the
        event loop never waits for a round trip. A store whose `now()` is local keeps this.
        Raises nothing.
        """
        return False

    @abstractmethod
    def insert(self, record: Record) -> Record | None:
        """Store `record` if no record has its key, atomically and durably before it
        returns. Return None if stored, else the record that holds the key. Raises
        `LedgerUnavailable` if the store cannot be written (nothing is stored)."""

    @abstractmethod
    def replace(self, current: Record, new: Record) -> bool:
        """Store `new` if the stored record still has `current`'s token and revision,
        atomically; True if it did. Raises `LedgerUnavailable` if the store cannot be
        written."""

    @abstractmethod
    def get(self, key: str) -> Record | None:
        """The record stored under `key`, or None. Raises `LedgerUnavailable` if the
        store cannot be read, `CorruptRecord` (one) if what it holds is not a record."""

    def peek(self, key: str) -> Peek | None:
        """What a replay needs of the record under `key` (status, fingerprint, expiry and
        encoded result), or None. Stores override it to skip decoding the whole record.
        Raises what `get` raises."""
        record = self.get(key)
        return None if record is None else Peek.of(record)

    @abstractmethod
    def scan(self, status: Status | None = None) -> Iterator[Record]:
        """Every record (or every record in `status`), yielded as it is read.

        A stream, not a list: the stores read a bounded batch at a time (a few hundred
        records per statement or round trip, the connection given back between batches),
        so a scan's memory does not grow with the ledger, and the caller may write (or
        delete) between records. What a caller may rely on while the ledger changes under
        the scan: a record that exists (and, with `status`, keeps it) from the scan's
        start to its end is yielded, in a version it had meanwhile; one inserted or
        deleted meanwhile may or may not be. The order is the store's own and is not the
        order of updates: a caller that shows records oldest first sorts them. SQLite,
        PostgreSQL and the file lock go in an order of the key (which never changes), so
        each record is yielded once; Redis walks its keyspace (or a status index) with
        SCAN, which can yield a record twice if the server resizes its table meanwhile.
        Raises what `get` raises, when the batch that fails is read."""

    @abstractmethod
    def delete(self, current: Record) -> bool:
        """Remove the record if it is still `current` (same token and revision); True if it
        did. Raises `LedgerUnavailable` if the store cannot be written."""

    def delete_many(self, records: Sequence[Record]) -> list[bool]:
        """Remove each of `records` that is still as given (`delete`'s test, record by
        record), in one write where the store can: a purge of millions pays one commit
        per batch, not one per record. Returns, for each record, whether it was deleted.
        Raises `LedgerUnavailable` if the store cannot be written (then none of a store's
        one write was applied; with this default, those before the failure were)."""
        return [self.delete(record) for record in records]

    def scan_prefix(self, prefix: str) -> Iterator[Record]:
        """Every record whose key starts with `prefix`, in key order (by code point).

        What the outbox's dispatcher polls (`crewai-idempotent/outbox/`) and what lists
        approvals and spend caps, so a store should answer it for the `DOCUMENTS` prefix
        without reading every record; this default reads them all, which is right for a
        store of your own but slow at a million. The stores stream the documents as
        `scan` streams records, in batches that each start after the last key read, so a
        document that stays is yielded once. Raises what `scan` raises
        (`LedgerUnavailable` when the store cannot be read)."""
        found = [record for record in self.scan() if record.key.startswith(prefix)]
        found.sort(key=lambda record: record.key)
        return iter(found)

    def select(self, query: Select) -> Iterator[Record]:
        """The records `query` selects, in its order, from its `after` on, at most its
        `limit`: what every listing a person or a watcher repeats reads (`_select`).

        The stores answer it from their indexes, so it reads what it yields (and what an
        index cannot tell apart: a filter the index does not cover), not the ledger, and
        each store's `scan_stats()` counts the rows it read. This default is
        `Select.apply` over a scan of the query's prefix or status: right for a store of
        your own, but it reads every record of that scan, and an order other than the
        key's holds what matched. Streamed like `scan`: what a caller may rely on while
        the ledger changes is what `scan` promises, for the query's order. Raises what
        `scan` raises."""
        source = self.scan_prefix(query.prefix) if query.prefix else self.scan(query.status)
        return query.apply(source)

    def changes(self) -> object | None:
        """A mark that differs after any write to the ledger by any process, read without
        reading a record: what the console's live updates compare between refreshes, so
        an open page costs nothing while nothing changes. Equal marks mean nothing was
        written in between (a mark may also move without a change a page shows). None when
        the store cannot tell (this default): the console then reads what its pages show
        at every refresh. Raises `LedgerUnavailable` if the store cannot be asked."""
        return None

    def close(self) -> None:  # noqa: B027 - optional for stores that hold nothing open
        """Release connections and file handles. The backend may not be used afterwards.
        Raises nothing."""

    def __enter__(self) -> CacheBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prefix_end(prefix: str) -> str | None:
    """The least string greater than every string that starts with `prefix` (code point
    order, which is UTF-8's byte order), for a range scan; None when there is none."""
    chars = list(prefix)
    while chars:
        last = ord(chars.pop()) + 1
        if last == 0xD800:
            last = 0xE000  # surrogates are never in a key
        if last <= 0x10FFFF:
            return "".join(chars) + chr(last)
    return None


# -- naming a store in messages ---------------------------------------------------------

# The backends that are the CLI's own default ledger (the embedded default the crewai
# integration opens): a command suggested for them needs no --ledger.
_defaults: weakref.WeakSet[CacheBackend] = weakref.WeakSet()


def mark_default(backend: CacheBackend) -> None:
    _defaults.add(backend)


def url_of(backend: Any) -> str:
    """The ledger URL naming `backend`, passwords as `***`, for messages; a backend that
    cannot say (one of your own without a `url`) is shown by its repr."""
    url = getattr(backend, "url", None)
    return url if isinstance(url, str) else repr(backend)


def ledger_option(backend: Any) -> str | None:
    """The URL a suggested `crewai-idempotent` command must give with --ledger to reach
    `backend`; None for the embedded default, which the command finds by itself."""
    try:
        if backend in _defaults:
            return None
    except TypeError:  # an unhashable backend of your own is never the default
        pass
    url = getattr(backend, "url", None)
    return url if isinstance(url, str) else None
