"""Ledger throughput next to a raw sqlite3 baseline measured in the same run.

    python bench/ledger.py            # the full run recorded in docs/benchmarks.md
    python bench/ledger.py --quick    # a smoke run (fewer cycles, 10k file-lock records)

One cycle = claim + commit of a fresh key (`Ledger.run` with a trivial body). The raw
baseline executes the same two statements (the same INSERT ... ON CONFLICT DO NOTHING and
conditional UPDATE, same schema, same PRAGMAs, documents of the same size) on its own
connection, with the documents prepared in advance: the ratio ours/raw is what the guard
costs on top of SQLite itself. Rounds alternate ours and raw and the median is reported,
so a noisy neighbour hurts both sides alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from crewai_idempotent import FileLockCacheBackend, Ledger, SQLiteCacheBackend
from crewai_idempotent._sqlite import _GET, _INSERT, _REPLACE, _SCHEMA

RECEIPT = "ch_3PxYz2LkdIwHu7ix0s1Q9aBc"


def _median_rate(run: Callable[[int], float], rounds: int) -> float:
    return statistics.median(run(i) for i in range(rounds))


def _raw_connection(path: Path, synchronous: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 5000")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    return conn


def bench_sqlite(synchronous: str, cycles: int, rounds: int, folder: Path) -> dict[str, float]:
    ledger = Ledger(SQLiteCacheBackend(folder / f"ours-{synchronous}.db", synchronous=synchronous))
    ledger.run("warm-up", lambda: RECEIPT)
    claim_doc = ledger.get("warm-up").evolve(None, revision=1).to_json()  # type: ignore[union-attr]
    commit_doc = ledger.get("warm-up").to_json()  # type: ignore[union-attr]
    raw = _raw_connection(folder / f"raw-{synchronous}.db", synchronous)

    def ours_cycles(round_: int) -> float:
        keys = [f"charge:{round_}:{i}" for i in range(cycles)]
        start = time.perf_counter()
        for key in keys:
            ledger.run(key, lambda: RECEIPT)
        return cycles / (time.perf_counter() - start)

    def raw_cycles(round_: int) -> float:
        keys = [f"charge:{round_}:{i}" for i in range(cycles)]
        start = time.perf_counter()
        for key in keys:
            raw.execute(_INSERT, (key, "PENDING", 1, 1, time.time(), claim_doc))
            raw.execute(_REPLACE, ("COMMITTED", 1, 2, time.time(), commit_doc, key, 1, 1))
        return cycles / (time.perf_counter() - start)

    def ours_replays(round_: int) -> float:
        keys = [f"charge:{round_}:{i}" for i in range(cycles)]
        start = time.perf_counter()
        for key in keys:
            ledger.run(key, lambda: RECEIPT)
        return cycles / (time.perf_counter() - start)

    def raw_replays(round_: int) -> float:
        keys = [f"charge:{round_}:{i}" for i in range(cycles)]
        start = time.perf_counter()
        for key in keys:
            json.loads(raw.execute(_GET, (key,)).fetchone()[0])["result"]
        return cycles / (time.perf_counter() - start)

    ours_c, raw_c = [], []
    for round_ in range(rounds):  # alternate, so both sides see the same machine
        ours_c.append(ours_cycles(round_))
        raw_c.append(raw_cycles(round_))
    ours_r, raw_r = [], []
    for round_ in range(rounds):
        ours_r.append(ours_replays(round_))
        raw_r.append(raw_replays(round_))
    ledger.close()
    raw.close()
    result = {
        "cycles": statistics.median(ours_c),
        "raw_cycles": statistics.median(raw_c),
        "replays": statistics.median(ours_r),
        "raw_replays": statistics.median(raw_r),
    }
    result["cycle_ratio"] = result["cycles"] / result["raw_cycles"]
    result["replay_ratio"] = result["replays"] / result["raw_replays"]
    return result


def _prefill(folder: Path, records: int) -> None:
    """Fill a file-lock ledger quickly (no fsync); the measured backend fsyncs as usual."""
    fast = Ledger(FileLockCacheBackend(folder, fsync=False))
    existing = sum(1 for _ in (folder / "records").glob("*/*.json"))
    for i in range(existing, records):
        fast.run(f"prefill:{i}", lambda: RECEIPT)


def bench_filelock(sizes: list[int], cycles: int, rounds: int, folder: Path) -> dict[str, float]:
    result: dict[str, float] = {}
    ledger_dir = folder / "filelock"
    ledger = Ledger(FileLockCacheBackend(ledger_dir))
    for size in sizes:
        _prefill(ledger_dir, size)

        def run_cycles(round_: int, size: int = size) -> float:
            keys = [f"measure:{size}:{round_}:{i}" for i in range(cycles)]
            start = time.perf_counter()
            for key in keys:
                ledger.run(key, lambda: RECEIPT)
            return cycles / (time.perf_counter() - start)

        def run_replays(round_: int, size: int = size) -> float:
            keys = [f"measure:{size}:{round_}:{i}" for i in range(cycles)]
            start = time.perf_counter()
            for key in keys:
                ledger.run(key, lambda: RECEIPT)
            return cycles / (time.perf_counter() - start)

        result[f"cycles@{size}"] = _median_rate(run_cycles, rounds)
        result[f"replays@{size}"] = _median_rate(run_replays, rounds)
    result["flatness"] = result[f"cycles@{sizes[-1]}"] / result[f"cycles@{sizes[0]}"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--cycles", type=int, help="cycles per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--records", type=int, help="file-lock records for the large figure")
    parser.add_argument("--dir", type=Path, help="where to put the ledgers (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    cycles = args.cycles or (300 if args.quick else 2000)
    records = args.records or (10_000 if args.quick else 100_000)
    rounds = 3 if args.quick else args.rounds

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        os.chmod(folder, 0o700)
        print(f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version}, "
              f"{platform.machine()}, {os.cpu_count()} cpus, ledgers in {folder}")  # fmt: skip
        print(f"{cycles} cycles per round, {rounds} rounds alternating ours/raw, medians\n")
        figures: dict[str, dict[str, float]] = {}
        print(f"{'backend':<22}{'cycles/s':>10}{'raw':>10}{'ratio':>7}"
              f"{'replays/s':>11}{'raw':>10}{'ratio':>7}")  # fmt: skip
        ok = True
        for mode in ("FULL", "NORMAL"):
            r = bench_sqlite(mode, cycles, rounds, folder)
            figures[f"sqlite-{mode}"] = r
            ok &= r["cycle_ratio"] >= 0.8
            print(f"{'SQLite ' + mode:<22}{r['cycles']:>10.0f}{r['raw_cycles']:>10.0f}"
                  f"{r['cycle_ratio']:>7.2f}{r['replays']:>11.0f}{r['raw_replays']:>10.0f}"
                  f"{r['replay_ratio']:>7.2f}")  # fmt: skip
        f = bench_filelock([1000, records], max(cycles // 4, 100), rounds, folder)
        figures["filelock"] = f
        for size in (1000, records):
            print(f"{f'file-lock @ {size} rec':<22}{f[f'cycles@{size}']:>10.0f}{'':>17}"
                  f"{f[f'replays@{size}']:>11.0f}")  # fmt: skip
        print(
            f"\nfile-lock cycles/s at {records} records / at 1000: {f['flatness']:.2f} "
            "(target >= 0.80)"
        )
        print("SQLite ours/raw cycle ratio target >= 0.80:", "met" if ok else "NOT met")
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
