"""lookup() and sql_lookup(): asking your own system, without a class. A row (or a
receipt) is Found, none is Absent (Unknown while the claim is younger than
settle_after_s), two rows are Unknown, a failing query is Unknown. On SQLite and on the
session's PostgreSQL server."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import Absent, Event, Found, Owner, Record, Status, Unknown
from crewai_idempotent.ledger._reconcile import ask
from crewai_idempotent.reconciliation import lookup, sql_lookup


def _claimed(key: str, seconds_ago: float) -> Record:
    at = time.time() - seconds_ago
    owner = Owner("h", 1, "x")
    return Record(
        key, Status.UNCERTAIN, "fp", 1, 2, owner, 1, at, at,
        history=(Event(at, "claim", 1, owner.label),),
    )  # fmt: skip


def _ask(reconcile: Any, key: str, args: Any = None, seconds_ago: float = 600) -> Any:
    return ask(reconcile, key, args or {}, None, None, _claimed(key, seconds_ago))


def test_lookup_turns_a_receipt_or_none_into_an_answer() -> None:
    charges = {"charge:o1": "ch_1"}
    find = lookup(lambda key, args: charges.get(key), settle_after_s=60)
    assert _ask(find, "charge:o1") == Found("ch_1")
    assert _ask(find, "charge:o2") == Absent()
    young = _ask(find, "charge:o2", seconds_ago=5)
    assert isinstance(young, Unknown) and "taken as absent 60 s after its claim" in young.reason

    def down(key: str, args: Any) -> Any:
        raise TimeoutError("the orders service timed out")

    failed = _ask(lookup(down), "charge:o1")
    assert failed == Unknown("reconciler raised TimeoutError: the orders service timed out")


@pytest.fixture
def shop(tmp_path: Path) -> Path:
    path = tmp_path / "shop.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE charges (idempotency_key TEXT, charge_id TEXT, amount INT)")
        db.execute("INSERT INTO charges VALUES ('charge:o1', 'ch_1', 5)")
        db.execute("INSERT INTO charges VALUES ('charge:dup', 'ch_2', 5)")
        db.execute("INSERT INTO charges VALUES ('charge:dup', 'ch_3', 5)")
    return path


def test_sql_lookup_on_sqlite(shop: Path) -> None:
    query = "SELECT charge_id FROM charges WHERE idempotency_key = :key"
    by_url = sql_lookup(f"sqlite:///{shop}", query)
    assert _ask(by_url, "charge:o1") == Found("ch_1")
    assert _ask(by_url, "charge:o9") == Absent()
    dup = _ask(by_url, "charge:dup")
    assert isinstance(dup, Unknown) and "more than one row" in dup.reason
    both = sql_lookup(
        lambda: sqlite3.connect(shop),
        "SELECT charge_id, amount FROM charges WHERE idempotency_key = ? AND amount = ?",
        params=lambda key, args: (key, args["amount"]),
    )
    assert _ask(both, "charge:o1", {"amount": 5}) == Found({"charge_id": "ch_1", "amount": 5})
    assert _ask(both, "charge:o1", {"amount": 6}) == Absent()
    shaped = sql_lookup(f"sqlite:///{shop}", query, receipt=lambda row: {"id": row["charge_id"]})
    assert _ask(shaped, "charge:o1") == Found({"id": "ch_1"})
    broken = _ask(sql_lookup(f"sqlite:///{shop}", "SELECT nope FROM charges"), "charge:o1")
    assert isinstance(broken, Unknown) and "OperationalError" in broken.reason


def test_sql_lookup_on_postgres(postgres_server: Any) -> None:
    psycopg = pytest.importorskip("psycopg")
    dsn = postgres_server.dsn()
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute("DROP TABLE IF EXISTS lookup_charges")
        db.execute("CREATE TABLE lookup_charges (idempotency_key TEXT, charge_id TEXT)")
        db.execute("INSERT INTO lookup_charges VALUES ('charge:o1', 'ch_pg')")
    find = sql_lookup(dsn, "SELECT charge_id FROM lookup_charges WHERE idempotency_key = %(key)s")
    assert _ask(find, "charge:o1") == Found("ch_pg")
    assert _ask(find, "charge:o2") == Absent()


def test_settings_that_cannot_work_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs the query"):
        sql_lookup(f"sqlite:///{tmp_path}/x.db", " ")
    with pytest.raises(ValueError, match="not a sqlite:/// or postgresql:// URL"):
        sql_lookup("mysql://db/shop", "SELECT 1")
    with pytest.raises(TypeError, match="takes a callable"):
        lookup("find_charge")  # type: ignore[arg-type]
