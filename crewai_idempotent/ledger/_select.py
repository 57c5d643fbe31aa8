"""What a listing asks a store for: the records it shows, and nothing else.

A person's or a watcher's read (a listing, a console page, doctor, purge, the sweeper)
names what it wants as a `Select`, and the store answers it from an index made for it, so
the read costs what it finds, not what the ledger holds. `Select.apply` is the meaning
of a select written once, over records already read: the stores' own answers must yield
what it yields (tests/backends hold each store to it), and a store of your own that has
no index for a select answers with it (`CacheBackend.select`'s default), which reads
every record.

A select is a conjunction: every field given must hold. Pages go by a cursor, never an
offset: `after` is the position of the last record of the previous page
(`Select.position`), so a page costs one page, however deep it is.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from ._record import Record, Status

#: The keys the package's own documents live under (approval requests, spend caps, the
#: outbox of what needs a person). A store keeps an index of them for `scan_prefix`.
DOCUMENTS = "crewai-idempotent/"


class Order(enum.StrEnum):
    KEY = "key"  # by key (code point order): what scans and exports go by
    OLDEST = "oldest"  # by last update, oldest first (ties by key)
    NEWEST = "newest"  # by last update, newest first (ties by key, descending)


#: Where a record stands in an order: its key (`Order.KEY`), or its last update and key.
Position = str | tuple[float, str]


@dataclass(frozen=True, slots=True)
class Select:
    """The records a read wants; every field that is set must hold.

    - `status`: in this status.
    - `needs_operator`: only records flagged for a person (`Record.needs_operator`).
    - `prefix`: keys starting with it.
    - `updated_from` / `updated_before`: last updated at or after / strictly before these
      times (the store's clock, epoch seconds).
    - `expired_by`: COMMITTED records whose `expires_at` is at or before this time by the
      wall clock (`Record.expired` then judges the host's clock too: purge asks it).
    - `state` / `subject`: the package's own documents (a `prefix` under `DOCUMENTS`)
      whose document's `state` (an approval's PENDING, ...) / `key` (the call an approval
      request is for) is this.
    - `order`, `after`, `limit`: the order, the position to continue after (the last
      record of the previous page), and how many at most (None: all).

    Raises `TypeError` for a status or order of another type, `ValueError` for `state` or
    `subject` without a prefix under `DOCUMENTS`, a `limit` below 1, or an `after` that
    is not a position in `order`.
    """

    status: Status | None = None
    needs_operator: bool = False
    prefix: str = ""
    updated_from: float | None = None
    updated_before: float | None = None
    expired_by: float | None = None
    state: str | None = None
    subject: str | None = None
    order: Order = Order.KEY
    after: Position | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.status is not None and not isinstance(self.status, Status):
            raise TypeError(f"status must be a Status, not {self.status!r}")
        if not isinstance(self.order, Order):
            raise TypeError(f"order must be an Order, not {self.order!r}")
        if (self.state is not None or self.subject is not None) and not self.prefix.startswith(
            DOCUMENTS
        ):
            raise ValueError(
                f"state= and subject= select the package's documents: give a prefix under "
                f"{DOCUMENTS!r}, not {self.prefix!r}"
            )
        if self.limit is not None and (isinstance(self.limit, bool) or self.limit < 1):
            raise ValueError(f"limit must be a positive count or None, not {self.limit!r}")
        if self.after is not None:
            time_order = self.order is not Order.KEY
            if time_order != isinstance(self.after, tuple):
                raise ValueError(
                    f"after= for order {self.order.value!r} is "
                    + ("an (updated_at, key) pair" if time_order else "a key")
                    + f", not {self.after!r}"
                )

    # -- the meaning of a select, over records already read ------------------------------

    def matches(self, record: Record) -> bool:
        """True when `record` meets every condition but the order's (`after` and `limit`
        are a page's, not a record's). Raises nothing."""
        if self.status is not None and record.status is not self.status:
            return False
        if self.needs_operator and not record.needs_operator:
            return False
        if not record.key.startswith(self.prefix):
            return False
        if self.updated_from is not None and record.updated_at < self.updated_from:
            return False
        if self.updated_before is not None and record.updated_at >= self.updated_before:
            return False
        if self.expired_by is not None and not (
            record.status is Status.COMMITTED
            and record.expires_at is not None
            and record.expires_at <= self.expired_by
        ):
            return False
        if self.state is not None and document_field(record, "state") != self.state:
            return False
        return self.subject is None or document_field(record, "key") == self.subject

    def position(self, record: Record) -> Position:
        """Where `record` stands in this select's order: give it as `after` for the next
        page. Raises nothing."""
        if self.order is Order.KEY:
            return record.key
        return (record.updated_at, record.key)

    def beyond(self, record: Record) -> bool:
        """True when `record` comes after `after` in this select's order (always, with no
        `after`). Raises nothing."""
        after = self.after
        if after is None:
            return True
        if self.order is Order.KEY:
            return record.key > after  # type: ignore[operator]
        mine = (record.updated_at, record.key)
        return mine > after if self.order is Order.OLDEST else mine < after  # type: ignore[operator]

    def _sort_key(self, record: Record) -> Any:
        if self.order is Order.KEY:
            return record.key
        return (record.updated_at, record.key)

    def apply(self, records: Iterable[Record]) -> Iterator[Record]:
        """The select's answer from `records` (in any order, each once): filtered, put in
        order, continued after `after`, cut at `limit`. An order other than the key's
        sorts, holding what matched: this is the meaning, and the fallback of a store with
        no index for it, not a way to read millions. Raises what iterating `records`
        raises."""
        found = (r for r in records if self.matches(r) and self.beyond(r))
        if self.order is Order.KEY:
            ordered: Iterable[Record] = sorted(found, key=lambda r: r.key)
        elif self.limit is not None:
            pick = heapq.nsmallest if self.order is Order.OLDEST else heapq.nlargest
            ordered = pick(self.limit, found, key=self._sort_key)
        else:
            ordered = sorted(found, key=self._sort_key, reverse=self.order is Order.NEWEST)
        for n, record in enumerate(ordered):
            if self.limit is not None and n >= self.limit:
                return
            yield record

    def page_after(self, record: Record) -> Select:
        """The same select for the page after `record` (the last of this page). Raises
        nothing."""
        return replace(self, after=self.position(record))


def document_field(record: Record, name: str) -> Any:
    """A field of the package's document a record holds under `DOCUMENTS` (an approval
    request's `state`, the `key` of the call it is for), or None: a record that holds no
    document, or one without that field. Reads the stored form (`_results.encode` keeps a
    dict as `{"t": "json", "v": {...}}`) without decoding the rest."""
    if not record.key.startswith(DOCUMENTS):
        return None
    stored = record.result
    if not isinstance(stored, dict) or stored.get("t") != "json":
        return None
    value = stored.get("v")
    return value.get(name) if isinstance(value, dict) else None
