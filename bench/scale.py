"""What the people's side costs as the ledger grows: rows read and records held.

    python bench/scale.py                       # SQLite at 10k and 100k records
    python bench/scale.py --counts 10000 1000000 --dir /root/benchtmp

For each count: a SQLite ledger of that many COMMITTED records plus a few approval
requests and spend windows, filled with the store's own statement in one transaction.
Then, from the store's `scan_stats()` (records its scans read) and the Python objects
alive (`gc`, never RSS):

- rows read to list the pending approvals and the spend windows (their documents only);
- rows read by a scan of the UNCERTAIN records (what the sweeper repeats);
- a whole scan as `export` would consume it: the records read, the batches, the most
  `Record` objects alive at once, and tracemalloc's peak of Python memory during a
  second scan.

The records held do not grow with the count: a scan streams. The peak grows a little
until pydantic_core's cache of decoded strings (16,384 of them) is full, then stays.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sqlite3
import tempfile
import tracemalloc
from pathlib import Path

from crewai_idempotent import (
    ApprovalRequired,
    Ledger,
    Record,
    SQLiteCacheBackend,
    Status,
)
from crewai_idempotent.gates._approvals import Approvals
from crewai_idempotent.gates._plan import Plan
from crewai_idempotent.gates._spend import Money, SpendCap, SpendLedger, Where


def fill(path: Path, count: int) -> SQLiteCacheBackend:
    backend = SQLiteCacheBackend(path, synchronous="NORMAL")
    backend.get("-")  # the schema
    now = backend.now()
    rows = []
    for i in range(count):
        record = Record(f"pay:{i:08d}", Status.COMMITTED, "fp", 1, 1, None, 1, now, now,
                        result={"charge": f"ch_{i}", "amount": 100})  # fmt: skip
        rows.append((record.key, "COMMITTED", 1, 1, now, record.to_json()))
        if len(rows) == 10_000 or i == count - 1:
            with sqlite3.connect(path) as conn:
                conn.executemany(
                    "INSERT INTO idempotency_records (key, status, token, revision, "
                    "updated_at, doc) VALUES (?, ?, ?, ?, ?, ?)",
                    rows,
                )
            rows = []
    ledger = Ledger(backend)
    where = Where(kickoff="k1", crew="c1", task="t1")
    for cents in (60_000, 70_000, 80_000):
        plan = Plan(tool="pay_invoice", fingerprint=f"fp-{cents}", approval=True,
                    approval_reason="big", summary={"amount_cents": cents},
                    where=where)  # fmt: skip
        with contextlib.suppress(ApprovalRequired):  # a request made: what is listed
            ledger.run(f"big:{cents}", lambda: "paid", fingerprint=plan.fingerprint, stage=plan)
    cap = SpendCap(1_000_000, "EUR", per="day")
    for i in range(2):
        plan = Plan(tool="pay", fingerprint=f"fp-s{i}", amount=Money(100, "EUR"),
                    caps=[("pay", cap)], where=where)  # fmt: skip
        ledger.run(f"spend:{i}", lambda: "paid", fingerprint=plan.fingerprint, stage=plan)
    return backend


def records_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, Record))


def rows(backend: SQLiteCacheBackend, action: object) -> int:
    before = backend.scan_stats().rows
    action()  # type: ignore[operator]
    return backend.scan_stats().rows - before


def measure(folder: Path, count: int) -> dict[str, int]:
    backend = fill(folder / f"ledger-{count}.db", count)
    try:
        figures = {
            "approvals rows": rows(backend, lambda: Approvals(backend).list("pending")),
            "spend rows": rows(backend, lambda: SpendLedger(backend).budgets()),
            "uncertain rows": rows(backend, lambda: list(backend.scan(Status.UNCERTAIN))),
        }
        baseline = records_alive()
        before = backend.scan_stats()
        held = seen = 0
        every = max(count // 20, 1)
        for seen, record in enumerate(backend.scan(), 1):
            del record
            if seen % every == 0:
                held = max(held, records_alive() - baseline)
        after = backend.scan_stats()
        tracemalloc.start()  # a second scan, measured alone: gc.get_objects allocates
        for record in backend.scan():
            del record
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        figures |= {
            "scan records": seen,
            "scan rows": after.rows - before.rows,
            "scan batches": after.batches - before.batches,
            "records held": held,
            "peak KiB": peak // 1024,
        }
        return figures
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--dir", type=Path, default=None, help="where the ledgers go")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=options.dir) as folder:
        results = {count: measure(Path(folder), count) for count in options.counts}
    names = list(next(iter(results.values())))
    print(f"{'records':>16}" + "".join(f"{count:>12}" for count in results))
    for name in names:
        print(f"{name:>16}" + "".join(f"{results[c][name]:>12}" for c in results))


if __name__ == "__main__":
    main()
