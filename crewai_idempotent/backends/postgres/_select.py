"""The statements a `Select` becomes on the PostgreSQL ledger: one per batch, every field
of the select a condition the planner can serve from an index (`_upgrade` makes them).

Each field is written as its index is defined, so that the planner matches a partial
index's predicate and an index's expression: the status and the time are columns; the
needs-operator flag and documents' prefix are the partial indexes' own predicates; expiry,
a document's state and its subject are the functions the indexes are made of. Which index
serves a statement is the planner's choice, made for the statement's values (statements
are never prepared): a rare status from its index, a common one from the primary key. A
page of everything in time order is one statement that merges each status's own ordered
range of the `(status, updated_at)` index (a `UNION ALL` of per-status `LIMIT`ed scans:
at most a batch from each). Key order is code point order: the primary key's, when the
database's collation orders text as bytes (C, POSIX); the partial indexes' otherwise
(`text_pattern_ops`).

Every batch starts after the last row of the one before (keyset), so a batch costs a
batch, however deep the page. The rows come back as written; the reader checks each
against the `Select` (`Select.matches`), which drops what an index over-included (model
content that looks like a field). A field whose index is not there yet (a table being
upgraded) is left out of the statement and filtered by that check alone: every statement
still reads at most a batch of the index that drives it, rather than the whole table in
one statement (which could outlast the statement timeout), and the select costs a read of
what the rest of it selects.
"""

from __future__ import annotations

from typing import Any

import pydantic_core

from ...ledger._backend import DOCUMENTS, prefix_end
from ...ledger._select import Order, Position, Select
from ._schema import Statements
from ._upgrade import DOCUMENTS_ONLY, EXPIRING, NEEDS_OPERATOR, STATUSES, Found, Objects

_COLUMNS = "key, doc, updated_at"


def json_text(value: str) -> bytes:
    """A string as the writers' JSON has it between its quotes (what `_upgrade`'s
    document_field returns), in UTF-8."""
    return pydantic_core.to_json(value)[1:-1]


class Plan:
    """The statements of one select: `statement(after, size)` for a batch of at most
    `size` rows after the position `after` (None: from the start)."""

    def __init__(
        self, sql: Statements, objects: Objects | None, found: Found | None, query: Select
    ) -> None:
        self.query = query
        self.table = sql.table
        valid = found.valid if found is not None else frozenset()
        functions = objects is not None and found is not None and found.has_functions

        def indexed(kind: str) -> bool:
            # A field goes into the statement only when its index is there: without it,
            # the condition would read every row in one statement (past the statement
            # timeout on a big table), where the reader's check of each batch's rows
            # keeps every statement to a batch.
            return f"{sql.base}_{kind}" in valid and (functions or kind == "flagged")

        where: list[str] = []
        params: list[Any] = []
        status = query.status
        if query.expired_by is not None:
            if objects is not None and indexed("expiry"):
                where.append(EXPIRING)
                where.append(f"{objects.expires} <= %s")
                params.append(float(query.expired_by))
            else:
                where.append("status = 'COMMITTED'")
        if status is not None:
            where.append("status = %s")
            params.append(status.value)
        flagged = query.needs_operator and indexed("flagged")
        if flagged:
            where.append(NEEDS_OPERATOR)
        documents = query.prefix.startswith(DOCUMENTS)
        # A partial index in code point order (text_pattern_ops) drives these; others go
        # by the primary key, which is in code point order only under a bytewise collation.
        self.pattern = documents or flagged or found is None or not found.bytewise
        if query.prefix:
            if documents:
                where.append(DOCUMENTS_ONLY.replace("%", "%%"))
            end = prefix_end(query.prefix)
            op = ("~>=~", "~<~") if self.pattern else (">=", "<")
            where.append(f"key {op[0]} %s")
            params.append(query.prefix)
            if end is not None:
                where.append(f"key {op[1]} %s")
                params.append(end)
        if query.updated_from is not None:
            where.append("updated_at >= %s")
            params.append(float(query.updated_from))
        if query.updated_before is not None:
            where.append("updated_at < %s")
            params.append(float(query.updated_before))
        if objects is not None:
            for name, value in (("state", query.state), ("subject", query.subject)):
                if value is not None and indexed(name):
                    where.append(f"{getattr(objects, name)} = %s")
                    params.append(json_text(value))
        timed = query.order is not Order.KEY
        if (
            status is None
            and not timed
            and query.expired_by is None
            and (query.updated_from is not None or query.updated_before is not None)
        ):
            # A time window in key order: each status's range of the (status,
            # updated_at) index, then sorted, rather than every row filtered.
            where.append("status IN (" + ", ".join(f"'{s}'" for s in STATUSES) + ")")
        self.where, self.params = where, params
        # A time order over every status merges the statuses' own ordered indexes, unless
        # something narrower drives it (expiry: one status; the flag; the documents).
        self.merge = (
            timed and status is None and query.expired_by is None and not flagged and not documents
        )
        if query.order is Order.KEY:
            self.order = "key USING ~<~" if self.pattern else "key"
        elif query.order is Order.OLDEST:
            self.order = "updated_at, key USING ~<~"
        else:
            self.order = "updated_at DESC, key USING ~>~"

    def _after(self, after: Position | None) -> tuple[list[str], list[Any]]:
        if after is None:
            return [], []
        if isinstance(after, str):
            return [f"key {'~>~' if self.pattern else '>'} %s"], [after]
        at, key = after
        if self.query.order is Order.OLDEST:
            # `updated_at >= t` is the index's range; the OR is the tie on the key.
            return ["updated_at >= %s", "(updated_at > %s OR key ~>~ %s)"], [at, at, key]
        return ["updated_at <= %s", "(updated_at < %s OR key ~<~ %s)"], [at, at, key]

    def statement(self, after: Position | None, size: int) -> tuple[str, list[Any]]:
        more, more_params = self._after(after)
        where = self.where + more
        params = self.params + more_params
        if not self.merge:
            return self._one(where), [*params, size]
        branches = []
        merged: list[Any] = []
        for status in STATUSES:
            branches.append("(" + self._one([f"status = '{status}'", *where]) + ")")
            merged += [*params, size]
        text = (
            f"SELECT {_COLUMNS} FROM ({' UNION ALL '.join(branches)}) AS merged "
            f"ORDER BY {self.order} LIMIT %s"
        )
        return text, [*merged, size]

    def _one(self, where: list[str]) -> str:
        condition = " AND ".join(where) if where else "TRUE"
        return (
            f"SELECT {_COLUMNS} FROM {self.table} WHERE {condition} ORDER BY {self.order} LIMIT %s"
        )
