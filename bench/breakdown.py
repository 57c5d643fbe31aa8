"""Where a guarded call's time goes, layer by layer, measured in one run.

    python bench/breakdown.py [--mode NORMAL] [--cycles 2000] [--rounds 5] --dir /root/benchtmp

Six loops over fresh keys, each adding one layer to the one before, run in alternating
blocks of 25 calls (a noisy neighbour hits every loop alike), CPU time per cycle (user +
system, this process), medians of the rounds:

1. raw: the two statements of a cycle (`INSERT ... ON CONFLICT DO NOTHING`, conditional
   `UPDATE`) with sqlite3, documents prepared in advance: `bench/ledger.py`'s baseline.
2. read first: the `SELECT` that finds nothing, then the same two statements: the floor
   of any store whose replays never take the write lock.
3. + JSON: the same, with each document encoded from its record as the ledger does.
4. the store: `SQLiteCacheBackend.peek`, `insert` and `replace` with records built in
   advance (adds the fork gate, the per-operation file-identity check, the parameters).
5. the ledger: `Ledger.run` with a trivial body (adds the records, the rooms, the lease
   keeper, the driver, the events).
And, on its own, the ledger on a store that does nothing: the guard's own bookkeeping.

The increments between consecutive loops say what each layer costs; the last column says
what ratio against raw the loops up to that layer could reach.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ledger import BLOCK, Raw, _receipt, _records

from crewai_idempotent import Ledger, SQLiteCacheBackend
from crewai_idempotent.backends.sqlite._store import _GET, _INSERT, _REPLACE
from crewai_idempotent.ledger._backend import CacheBackend
from crewai_idempotent.ledger._record import Peek, Record, Status


class NullStore(CacheBackend):
    """A store that remembers nothing: every key is fresh, every write lands."""

    read_first = True

    def insert(self, record: Record) -> Record | None:
        return None

    def replace(self, current: Record, new: Record) -> bool:
        return True

    def get(self, key: str) -> Record | None:
        return None

    def peek(self, key: str) -> Peek | None:
        return None

    def scan(self, status: Status | None = None) -> Iterator[Record]:
        return iter(())

    def delete(self, current: Record) -> bool:
        return True

    def close(self) -> None:
        pass


def measure(mode: str, cycles: int, rounds: int, folder: Path) -> dict[str, float]:
    raw, floor, encoded = (Raw(folder / f"{name}.db", mode) for name in ("raw", "floor", "json"))
    store = SQLiteCacheBackend(folder / "store.db", synchronous=mode)
    ledger = Ledger(SQLiteCacheBackend(folder / "ledger.db", synchronous=mode))
    core = Ledger(NullStore())
    ledger.run("warm-up", _receipt)
    core.run("warm-up", _receipt)
    prepared: dict[str, tuple[Record, Record]] = {}

    def with_json(key: str) -> None:
        claim, commit = prepared[key]
        encoded.claim.execute(_GET, (key,)).fetchone()
        encoded.claim.execute(_INSERT, (key, "PENDING", 1, 1, time.time(), claim.to_json()))
        encoded.commit.execute(
            _REPLACE, ("COMMITTED", 1, 2, time.time(), commit.to_json(), key, 1, 1)
        )

    def through_store(key: str) -> None:
        claim, commit = prepared[key]
        store.peek(key)
        store.insert(claim)
        store.replace(claim, commit)

    loops: dict[str, Callable[[str], Any]] = {
        "raw": raw.cycle,
        "read first": floor.read_first_cycle,
        "+ JSON": with_json,
        "the store": through_store,
        "the ledger": lambda key: ledger.run(key, _receipt),
        "ledger, null store": lambda key: core.run(key, _receipt),
    }
    cpu: dict[str, list[float]] = {name: [] for name in loops}
    for round_ in range(rounds):
        keys = {name: [f"{name}:{round_}:{i}" for i in range(cycles)] for name in loops}
        for name in ("+ JSON", "the store"):
            prepared.update((key, _records(key)) for key in keys[name])
        spent = dict.fromkeys(loops, 0.0)
        for block, start in enumerate(range(0, cycles, BLOCK)):
            order = list(loops) if block % 2 == 0 else list(reversed(loops))
            for name in order:
                fn, chunk = loops[name], keys[name][start : start + BLOCK]
                began = time.process_time()
                for key in chunk:
                    fn(key)
                spent[name] += time.process_time() - began
        for name in loops:
            cpu[name].append(spent[name] / cycles * 1e6)
        prepared.clear()
    for closing in (raw, floor, encoded):
        closing.close()
    store.close()
    ledger.close()
    return {name: statistics.median(values) for name, values in cpu.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = ("FULL", "CLAIMS", "NORMAL")
    parser.add_argument("--mode", default="NORMAL", type=str.upper, choices=modes)
    parser.add_argument("--cycles", type=int, default=2000, help="cycles per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, help="where to put the ledgers (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        os.chmod(tmp, 0o700)
        us = measure(args.mode, args.cycles, args.rounds, Path(tmp))
    base = us["raw"]
    print(f"synchronous={args.mode}, CPU us per cycle, medians of {args.rounds} rounds "
          f"of {args.cycles} fresh keys")  # fmt: skip
    print(f"{'':<20}{'us':>8}{'added':>8}{'raw / this':>12}")
    previous = None
    for name in ("raw", "read first", "+ JSON", "the store", "the ledger"):
        added = "" if previous is None else f"{us[name] - previous:+.1f}"
        print(f"{name:<20}{us[name]:>8.1f}{added:>8}{base / us[name]:>12.2f}")
        previous = us[name]
    print(f"{'ledger, null store':<20}{us['ledger, null store']:>8.1f}   (the guard alone)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
