"""Documents kept in the ledger under reserved keys: spend caps and approval requests.

They use the store's own five operations and nothing else, so every backend carries them
unchanged: a document is the `result` of a COMMITTED record that never expires, created
with `insert` (insert-if-absent) and changed only by `replace` (compare-and-set on token
and revision). Two processes changing one document at once: one wins, the other reads it
again and re-decides on what it finds.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any

from .._errors import CorruptRecord
from ..ledger._backend import CacheBackend
from ..ledger._record import Record, Status
from ..ledger._results import decode, encode
from ..ledger._select import Order, Position, Select
from ..notifications import _outbox

#: Every key this module writes starts with this; `crewai-idempotent ls` shows them too.
PREFIX = "crewai-idempotent/"
_FINGERPRINT = "crewai-idempotent-document"


class Unchanged(Exception):
    """Raised by an update function to leave the document as it is (no write)."""

    def __init__(self, doc: dict[str, Any] | None) -> None:
        super().__init__("unchanged")
        self.doc = doc


def is_document(record: Record) -> bool:
    return record.key.startswith(PREFIX) and record.fingerprint == _FINGERPRINT


def read(backend: CacheBackend, key: str) -> dict[str, Any] | None:
    record = backend.get(key)
    return None if record is None else _doc(record)


def scan(backend: CacheBackend, kind: str) -> Iterator[dict[str, Any]]:
    """Every document whose key starts with PREFIX + kind, in key order.

    Read from the store's index of the documents (`scan_prefix`), so a listing of
    approvals or caps reads those documents, not every record in the ledger. A document
    is always COMMITTED; a record under the prefix in another status, or with another
    fingerprint, is not one (a key a tool of someone's may have used) and is skipped."""
    for record in backend.scan_prefix(PREFIX + kind):
        if record.status is Status.COMMITTED and record.fingerprint == _FINGERPRINT:
            yield _doc(record)


def select(
    backend: CacheBackend,
    kind: str,
    *,
    state: str | None = None,
    subject: str | None = None,
    updated_from: float | None = None,
    order: Order = Order.KEY,
    after: Position | None = None,
    limit: int | None = None,
) -> Iterator[tuple[Record, dict[str, Any]]]:
    """The documents of `kind` (and, if given, in `state`, or about the call `subject`,
    or written at or after `updated_from` by the store's clock), with their records, in
    `order` from `after` on, at most `limit`: answered from the store's index of the
    documents by state, subject and time (`CacheBackend.select`), so a page of pending
    approvals reads that page, however many were decided before. A record under the
    prefix that is not a document is skipped, as `scan` skips it."""
    query = Select(
        prefix=PREFIX + kind, state=state, subject=subject, updated_from=updated_from,
        order=order, after=after, limit=limit,
    )  # fmt: skip
    for record in backend.select(query):
        if record.status is Status.COMMITTED and record.fingerprint == _FINGERPRINT:
            yield record, _doc(record)


Notes = Callable[[dict[str, Any] | None, dict[str, Any]], list[_outbox.Note]]


def update(
    backend: CacheBackend,
    key: str,
    change: Callable[[dict[str, Any] | None, float], dict[str, Any]],
    notes: Notes | None = None,
    *,
    expires_at: float | None = None,
) -> dict[str, Any]:
    """Apply `change(current_doc_or_None, store_now)` atomically and return the new doc.

    `change` may be called several times (once per lost race) and must decide only from
    what it is given; it raises `Unchanged(doc)` to write nothing, or any other
    exception to abort.

    `notes(old_doc, new_doc)` says what the change means for a person: its entries are
    put in the outbox before the document is written, and the document carries their
    marks, so they are delivered if and only if this write lands (`notifications._outbox`).
    `expires_at`: when `purge` may delete the document (a console session); by default
    never.
    """
    lost = 0
    while True:
        current = backend.get(key)
        now = backend.now()
        doc = None if current is None else _doc(current)
        try:
            new_doc = change(doc, now)
        except Unchanged as nothing:
            return nothing.doc if nothing.doc is not None else (doc or {})
        found = notes(doc, new_doc) if notes is not None else None
        if found:
            entries = _outbox.of_document(key, current, found, now)
            new_doc = _outbox.marked(new_doc, entries)
            _outbox.put_entries(backend, entries)  # first: the write below is their mark
        payload = encode(new_doc)
        if current is None:
            record = Record(
                key=key, status=Status.COMMITTED, fingerprint=_FINGERPRINT, token=1, revision=1,
                owner=None, attempts=0, created_at=now, updated_at=now, result=payload,
                expires_at=expires_at,
            )  # fmt: skip
            if backend.insert(record) is None:
                return new_doc
        elif backend.replace(
            current, current.evolve(None, result=payload, updated_at=now, expires_at=expires_at)
        ):
            return new_doc
        lost += 1
        # Many writers on one document: a short random pause spreads the retries out.
        time.sleep(random.uniform(0, min(0.002 * lost, 0.05)))


def _doc(record: Record) -> dict[str, Any]:
    value = decode(record.result)
    if not isinstance(value, dict):
        raise CorruptRecord("the ledger", f"the document under {record.key!r} is not an object")
    return value
