"""Reconcilers that ask your own system whether a key's effect exists: no class needed.

`lookup(find)`: `find(key, args)` returns the receipt when the operation happened and
None when it did not. `sql_lookup(connect, query)`: a query that selects the receipt of
the key's effect from your own database; a row is Found, no row is Absent.

What they prove: what your system holds. If it records the effect in the same
transaction as the effect itself (the charge and its row commit together), a missing row
proves the effect is absent. If the row is written after the effect (a webhook, a
replica, an outbox of your own), a missing row only says "not yet": answer Unknown for
recent records (`settle_after_s`) so that a late row is not taken for an absent effect.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..ledger._reconcile import Absent, Found, Unknown, Verdict, reconciling
from ..ledger._record import Record


def claimed_at(record: Record | None) -> float | None:
    """When the record's current operation was claimed (its claim or takeover), on the
    store's clock; None without a record."""
    if record is None:
        return None
    for event in reversed(record.history):
        if event.token == record.token and event.kind in ("claim", "takeover", "expire"):
            return event.at
    return record.created_at


def _young(settle_after_s: float) -> str | None:
    """Why an empty answer cannot be Absent yet: the claim is more recent than
    `settle_after_s` (by this host's clock against the claim's)."""
    if not settle_after_s:
        return None
    claimed = claimed_at(reconciling())
    if claimed is None:
        return None
    age = time.time() - claimed
    if age >= settle_after_s:
        return None
    return (
        f"nothing found yet, but the claim is {age:.0f} s old: an effect is only taken as "
        f"absent {settle_after_s:g} s after its claim"
    )


def lookup(
    find: Callable[[str, Any], Any],
    *,
    settle_after_s: float = 0.0,
) -> Callable[[str, Any], Verdict]:
    """A reconciler from `find(key, args)`: the receipt (Found) when the operation
    happened, None (Absent) when it did not. What `find` raises is Unknown. An effect not
    found for a claim younger than `settle_after_s` is Unknown ("not yet"), not Absent.
    Raises `TypeError` for a `find` that is not callable."""
    if not callable(find):
        raise TypeError(f"lookup() takes a callable (key, args) -> receipt | None, not {find!r}")

    def reconcile(key: str, args: Any) -> Verdict:
        found = find(key, args)
        if found is not None:
            return Found(found)
        young = _young(settle_after_s)
        return Unknown(young) if young else Absent()

    reconcile.__qualname__ = f"lookup({getattr(find, '__qualname__', find)!s})"
    return reconcile


def sql_lookup(
    connect: Callable[[], Any] | str,
    query: str,
    *,
    params: Callable[[str, Any], Sequence[Any] | Mapping[str, Any]] | None = None,
    receipt: Callable[[dict[str, Any]], Any] | None = None,
    settle_after_s: float = 0.0,
) -> Callable[[str, Any], Verdict]:
    """A reconciler that runs `query` to find the key's effect in your own database.

    `connect()` returns a DB-API connection (`sqlite3.connect`, `psycopg.connect`, ...),
    or give a `sqlite:///path` or `postgresql://...` URL; a connection is opened for each
    ask and closed after it. `params(key, args)` gives the query's parameters; by default
    `{"key": key, **args}`, for a query with named placeholders (`:key` for sqlite3,
    `%(key)s` for psycopg). One row is Found, its receipt `receipt(row)` (the row as a
    dict of its columns; by default the value of a one-column row, else the dict); no row
    is Absent (Unknown before `settle_after_s`); more than one row is Unknown.

    Raises `ValueError` for a blank `query` or a `connect` URL that is not a
    `sqlite:///path` or `postgresql://` one, and `TypeError` for a `connect` that is
    neither a function nor a str. What the reconciler raises as it asks (the connection's,
    the query's) is Unknown to the sweeper.
    """
    if not isinstance(query, str) or not query.strip():
        raise ValueError("sql_lookup() needs the query that finds the key's effect")
    opener = _opener(connect)

    def reconcile(key: str, args: Any) -> Verdict:
        bound = params(key, args) if params is not None else {"key": key, **_mapping(args)}
        connection = opener()
        try:
            cursor = connection.cursor()
            try:
                cursor.execute(query, bound)
                names = [column[0] for column in cursor.description or ()]
                rows = cursor.fetchmany(2)
            finally:
                cursor.close()
        finally:
            connection.close()
        if len(rows) > 1:
            return Unknown(f"the query found more than one row for {key!r}")
        if not rows:
            young = _young(settle_after_s)
            return Unknown(young) if young else Absent()
        row = dict(zip(names, rows[0], strict=False))
        if receipt is not None:
            return Found(receipt(row))
        return Found(rows[0][0] if len(row) == 1 else row)

    reconcile.__qualname__ = f"sql_lookup({query.strip().splitlines()[0][:60]!r})"
    return reconcile


def _mapping(args: Any) -> dict[str, Any]:
    return dict(args) if isinstance(args, Mapping) else {}


def _opener(connect: Callable[[], Any] | str) -> Callable[[], Any]:
    if callable(connect):
        return connect
    if not isinstance(connect, str):
        raise TypeError(f"connect must be a callable or a database URL, not {connect!r}")
    scheme = connect.partition(":")[0].lower()
    if scheme == "sqlite":
        import sqlite3

        from ..backends._url import local_path

        path = local_path(connect)
        if path is None:
            raise ValueError(f"not a sqlite URL with a path: {connect!r}")
        return lambda: sqlite3.connect(path)
    if scheme in ("postgresql", "postgres"):

        def open_postgres() -> Any:
            import psycopg

            return psycopg.connect(connect)

        return open_postgres
    raise ValueError(
        f"sql_lookup(): {connect!r} is not a sqlite:/// or postgresql:// URL; pass a function "
        "that returns a DB-API connection instead"
    )
