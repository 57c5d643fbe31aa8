"""bench/scale.py still runs, and what it loads is what the stores write.

Nothing here is timed: the bench's figures are its own business. These tests check that
its loaders write ledgers the stores read back record for record (so a later version's
store, or its indexes, cannot silently turn the bulk-loaded ledgers into something else),
that the raw baseline of the many-workers comparison replays what the package sends, and
that a small run measures and reports end to end.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from crewai_idempotent import Approvals, SpendLedger, Status, backend_from_url

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

import scale_ledgers  # noqa: E402
import scale_workers  # noqa: E402

MEASURES = ("listings", "pages", "idle", "memory", "traced", "purge")
SMALL = scale_ledgers.Shape(
    300, pending_approvals=5, approved=2, denied=2, uncertain=3, needs_operator=1,
    stale_pending=2, spend_windows=2,
)  # fmt: skip


def _check_ledger(url: str, shape: scale_ledgers.Shape, now: float) -> None:
    """Every receipt reads back as written; the documents are what the package made."""
    backend = backend_from_url(url)
    try:
        for _claim, final in scale_ledgers.receipts(shape, now):
            stored = backend.get(final.key)
            assert stored is not None and stored.to_json() == final.to_json()
        statuses = Counter(record.status for record in backend.scan())
        approvals = Approvals(backend)
        assert len(approvals.list("pending")) == shape.pending_approvals
        assert len(approvals.list("approved")) == shape.approved
        assert len(approvals.list("denied")) == shape.denied
        flagged = [r for r in backend.scan(Status.UNCERTAIN) if r.needs_operator]
        assert statuses[Status.UNCERTAIN] == shape.uncertain
        assert len(flagged) == shape.needs_operator
        assert statuses[Status.PENDING] == shape.stale_pending
        assert len(SpendLedger(backend).budgets()) == shape.spend_windows
        outbox = list(backend.scan_prefix("crewai-idempotent/outbox/"))
        requests = shape.pending_approvals + shape.approved + shape.denied
        assert len(outbox) >= requests + shape.uncertain
    finally:
        backend.close()


# Rows whose columns disagree with their document (`field(name)` reads one of its fields).
_DISAGREE = (
    "SELECT count(*) FROM {table} WHERE status != {status} OR token != {token} "
    "OR revision != {revision} OR updated_at != {updated_at}"
)


def _disagreeing(execute: Any, table: str, field: Callable[[str], str]) -> int:
    names = ("status", "token", "revision", "updated_at")
    sql = _DISAGREE.format(table=table, **{name: field(name) for name in names})
    return int(execute(sql).fetchone()[0])


_LOADED: dict[str, float] = {}


@pytest.fixture(autouse=True)
def _remember_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the `now` each loader reads, so the test regenerates the same receipts."""
    real = scale_ledgers.receipts

    def recording(shape: scale_ledgers.Shape, now: float, seed: int = 30) -> Any:
        _LOADED.setdefault("now", now)
        return real(shape, now, seed)

    monkeypatch.setattr(scale_ledgers, "receipts", recording)
    _LOADED.clear()


def test_help_says_how_to_run_each_part() -> None:
    said = subprocess.run(
        [sys.executable, str(BENCH / "scale.py"), "--help"], capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    for part in ("load", "run", "workers", "report", "cache", *MEASURES):
        assert part in said
    run = subprocess.run(
        [sys.executable, str(BENCH / "scale.py"), "run", "--help"], capture_output=True,
        text=True, check=True,
    ).stdout  # fmt: skip
    for option in ("--backends", "--sizes", "--measure", "--purge-size", "--idle-seconds"):
        assert option in run


def test_sqlite_loader_writes_what_the_store_reads(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    facts = scale_ledgers.load_sqlite(path, SMALL)
    assert facts["rows"] > SMALL.receipts
    _check_ledger(scale_ledgers.sqlite_url(path), SMALL, _LOADED["now"])
    with sqlite3.connect(path) as conn:  # the columns say what the document says

        def field(name: str) -> str:
            return f"json_extract(doc, '$.{name}')"

        assert _disagreeing(conn.execute, "idempotency_records", field) == 0


def test_postgres_loader_writes_what_the_store_reads(postgres_server: Any) -> None:
    database = f"bench_{uuid.uuid4().hex[:12]}"
    postgres_server.sql(f"CREATE DATABASE {database}")
    try:
        url = postgres_server.dsn(database)
        scale_ledgers.load_postgres(url, SMALL)
        _check_ledger(url, SMALL, _LOADED["now"])
        with psycopg.connect(url) as conn:  # the columns say what the document says
            casts = {"status": "text", "token": "bigint", "revision": "bigint"}

            def field(name: str) -> str:
                return f"(doc::jsonb ->> '{name}')::{casts.get(name, 'float8')}"

            assert _disagreeing(conn.execute, "crewai_idempotency_records", field) == 0
    finally:
        postgres_server.sql(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")


def test_redis_loader_writes_what_the_store_reads(redis_server: Any) -> None:
    url = redis_server.fresh_url()
    scale_ledgers.load_redis(url, SMALL)
    _check_ledger(url, SMALL, _LOADED["now"])


@pytest.mark.parametrize("kind", ["postgres", "redis"])
def test_the_raw_baseline_replays_what_the_package_sends(
    kind: str, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue(f"{kind}_server")
    url = server.fresh_url()
    sent = scale_workers.capture(url)
    assert sent
    scale_workers.check_raw(url, sent)  # raises unless a raw cycle commits its own key


def test_a_small_run_measures_and_reports(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    results = tmp_path / "results.json"
    common = ["--cache", str(cache), "--results", str(results)]
    subprocess.run(
        [sys.executable, str(BENCH / "scale.py"), "run", "--backends", "sqlite", "--sizes",
         "100", "--measure", "listings", "pages", "--runs", "1", *common],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    figures = json.loads(results.read_text())["sizes"]["sqlite"]["100"]
    assert {name: run["exit"] for name, run in figures["listings"].items()} == dict.fromkeys(
        figures["listings"], 0
    )
    assert len(figures["listings"]) == 7
    assert all(page["status"] == [200] for page in figures["pages"].values())
    assert {"approvals", "approval", "uncertain", "records", "record", "spend"} <= set(
        figures["pages"]
    )
    report = subprocess.run(
        [sys.executable, str(BENCH / "scale.py"), "report", *common],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert "`approvals ls`" in report and "Console pages, SQLite" in report
