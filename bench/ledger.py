"""Ledger throughput next to raw baselines measured in the same run.

    python bench/ledger.py --dir /root/benchtmp            # the run in docs/benchmarks.md
    python bench/ledger.py --quick --dir /root/benchtmp    # a smoke run
    python bench/ledger.py --scale 1000000 ...             # the 1M-record scale figure

One cycle = claim + commit of a fresh key (`Ledger.run` with a trivial body). The raw
baseline executes the same two statements (the same INSERT ... ON CONFLICT DO NOTHING and
conditional UPDATE, same schema, same PRAGMAs, documents of the same size) with sqlite3
directly, documents prepared in advance: the ratio ours/raw is what the guard costs on top
of SQLite itself. `synchronous=CLAIMS` is measured against a raw loop doing the same:
the INSERT on a FULL connection, the UPDATE on a NORMAL one. A replay is `Ledger.run` on
a committed key, against a raw SELECT of the row plus `json.loads`. A third loop does the
SELECT that finds nothing before the two statements: what a ledger that reads first (so
that a replay never takes the write lock) cannot go below. Within each round ours
and raw alternate in blocks of 25 calls and the median of the rounds is reported, so a
noisy neighbour (CPU or disk) hurts both sides alike.

Also: agent-once (the nearest peer, `pip install -e .[bench]`) on the same workload;
8 threads and 8 processes on distinct keys against the same raw loop in as many threads
or processes; cycles at `--scale` records against cycles at 10k (SQLite and file lock),
and the peak RSS of a process working on each. Everything goes to `--json` too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import platform
import resource
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crewai_idempotent import FileLockCacheBackend, Ledger, SQLiteCacheBackend
from crewai_idempotent.backends.sqlite._store import _GET, _INSERT, _REPLACE, _SCHEMA
from crewai_idempotent.ledger._record import Event, Owner, Record, Status

RECEIPT = "ch_3PxYz2LkdIwHu7ix0s1Q9aBc"
THREADS = PROCESSES = 8
BLOCK = 25  # calls per block when two sides alternate


def _receipt() -> str:
    return RECEIPT


def _raw_connection(path: Path, synchronous: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 5000")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    return conn


def _records(key: str) -> tuple[Record, Record]:
    """A claim record for `key` and its commit, as the ledger writes them."""
    now = time.time()
    owner = Owner("bench-host", os.getpid(), "0123456789")
    claim = Record(
        key, Status.PENDING, "", 1, 1, owner, 1, now, now, now + 30, None, None,
        None, False, (), (Event(now, "claim", 1, owner.label),),
    )  # fmt: skip
    commit = claim.settled(
        Event(now, "commit", 1, owner.label),
        Status.COMMITTED,
        now,
        result={"t": "json", "v": RECEIPT},
    )
    return claim, commit


def _docs() -> tuple[str, str]:
    """A claim document and a commit document of the sizes the ledger writes."""
    claim, commit = _records("charge:0:0")
    return claim.to_json(), commit.to_json()


class Raw:
    """The raw sqlite3 loop: a claim connection and a commit connection (the same one
    unless the mode syncs claims only)."""

    def __init__(self, path: Path, mode: str) -> None:
        claim_mode = "FULL" if mode == "CLAIMS" else mode
        self.claim = _raw_connection(path, claim_mode)
        self.commit = self.claim if mode != "CLAIMS" else _raw_connection(path, "NORMAL")
        self.claim_doc, self.commit_doc = _docs()

    def cycle(self, key: str) -> None:
        self.claim.execute(_INSERT, (key, "PENDING", 1, 1, time.time(), self.claim_doc))
        self.commit.execute(_REPLACE, ("COMMITTED", 1, 2, time.time(), self.commit_doc, key, 1, 1))

    def read_first_cycle(self, key: str) -> None:
        """The cycle of a store that reads before it claims (so that a replay never takes
        the write lock): the SELECT that finds nothing, then the same two statements."""
        self.claim.execute(_GET, (key,)).fetchone()
        self.cycle(key)

    def replay(self, key: str) -> Any:
        return json.loads(self.claim.execute(_GET, (key,)).fetchone()[0])["result"]

    def close(self) -> None:
        self.claim.close()
        if self.commit is not self.claim:
            self.commit.close()


def _rate(fn: Callable[[str], Any], keys: list[str]) -> float:
    start = time.perf_counter()
    for key in keys:
        fn(key)
    return len(keys) / (time.perf_counter() - start)


def _interleaved(sides: dict[str, Callable[[str], Any]], keys: dict[str, list[str]]
) -> dict[str, float]:  # fmt: skip
    """Calls/s of each side over its own keys, run in alternating blocks of `BLOCK` calls:
    a noisy neighbour (CPU or disk) hits every side alike, block by block."""
    spent = dict.fromkeys(sides, 0.0)
    cpu = dict.fromkeys(sides, 0.0)
    count = len(keys[next(iter(sides))])
    for block, start in enumerate(range(0, count, BLOCK)):
        for name in list(sides) if block % 2 == 0 else list(reversed(sides)):
            fn, chunk = sides[name], keys[name][start : start + BLOCK]
            began, began_cpu = time.perf_counter(), time.process_time()
            for key in chunk:
                fn(key)
            spent[name] += time.perf_counter() - began
            cpu[name] += time.process_time() - began_cpu
    rates = {name: count / spent[name] for name in sides}
    # CPU (user + system, this process) per call, in microseconds: less at the mercy of
    # a busy machine than wall time, and what the guard itself adds.
    rates.update({f"{name}_cpu_us": cpu[name] / count * 1e6 for name in sides})
    return rates


def _rounds(
    sides: dict[str, Callable[[str], Any]],
    replay: dict[str, Callable[[str], Any]] | None,
    cycles: int,
    rounds: int,
    tag: str,
) -> dict[str, float]:
    """Medians over `rounds` of interleaved cycles (fresh keys) and, with `replay`, of
    interleaved replays of the keys just written."""
    rates: dict[str, list[float]] = {}
    for round_ in range(rounds):
        keys = {name: [f"{tag}:{name}:{round_}:{i}" for i in range(cycles)] for name in sides}
        for name, rate in _interleaved(sides, keys).items():
            rates.setdefault(name, []).append(rate)
        if replay is not None:
            for name, rate in _interleaved(replay, keys).items():
                side, _, unit = name.partition("_")  # "oursFULL", "oursFULL_cpu_us"
                label = f"{side}_replays_{unit}" if unit else f"{side}_replays"
                rates.setdefault(label, []).append(rate)
    return {name: statistics.median(values) for name, values in rates.items()}


def bench_sqlite(modes: list[str], cycles: int, rounds: int, folder: Path
) -> dict[str, dict[str, float]]:  # fmt: skip
    """Ours and raw in every mode, all interleaved block by block: the modes are compared
    with each other under the same conditions, not only with their raw loops."""
    ledgers = {m: Ledger(SQLiteCacheBackend(folder / f"ours-{m}.db", synchronous=m)) for m in modes}
    raws = {m: Raw(folder / f"raw-{m}.db", m) for m in modes}
    floors = {m: Raw(folder / f"floor-{m}.db", m) for m in modes}
    cycle: dict[str, Callable[[str], Any]] = {}
    replay: dict[str, Callable[[str], Any]] = {}
    for mode, ledger in ledgers.items():
        ledger.run("warm-up", _receipt)

        def ours(key: str, ledger: Ledger = ledger) -> Any:
            return ledger.run(key, _receipt)

        cycle[f"ours{mode}"] = replay[f"ours{mode}"] = ours
        cycle[f"raw{mode}"], replay[f"raw{mode}"] = raws[mode].cycle, raws[mode].replay
        cycle[f"floor{mode}"] = floors[mode].read_first_cycle
    m = _rounds(cycle, replay, cycles, rounds, "sqlite")
    for ledger in ledgers.values():
        ledger.close()
    for raw in (*raws.values(), *floors.values()):
        raw.close()
    results = {}
    for mode in modes:
        ours, raw = f"ours{mode}", f"raw{mode}"
        result = {
            "cycles": m[ours],
            "raw_cycles": m[raw],
            "replays": m[f"{ours}_replays"],
            "raw_replays": m[f"{raw}_replays"],
            "cycle_cpu_us": m[f"{ours}_cpu_us"],
            "raw_cycle_cpu_us": m[f"{raw}_cpu_us"],
            "replay_cpu_us": m[f"{ours}_replays_cpu_us"],
            "raw_replay_cpu_us": m[f"{raw}_replays_cpu_us"],
            "floor_cycles": m[f"floor{mode}"],
            "floor_cycle_cpu_us": m[f"floor{mode}_cpu_us"],
        }
        result["cycle_ratio"] = result["cycles"] / result["raw_cycles"]
        result["replay_ratio"] = result["replays"] / result["raw_replays"]
        # The best cycle ratio any store that reads first could reach, and ours against it.
        result["floor_ratio"] = result["floor_cycles"] / result["raw_cycles"]
        result["cycle_floor_ratio"] = result["cycles"] / result["floor_cycles"]
        result["cycle_cpu_ratio"] = result["raw_cycle_cpu_us"] / result["cycle_cpu_us"]
        result["replay_cpu_ratio"] = result["raw_replay_cpu_us"] / result["replay_cpu_us"]
        results[mode] = result
    return results


def bench_agent_once(cycles: int, rounds: int, folder: Path) -> dict[str, float] | None:
    try:
        from once import Once  # type: ignore[import-not-found]
    except ImportError:
        return None
    once = Once(str(folder / "agent-once.db"))
    ledger = Ledger(SQLiteCacheBackend(folder / "ours-vs-once.db"))

    def peer(key: str) -> Any:
        return once.execute(_receipt, key=key)

    def ours(key: str) -> Any:
        return ledger.run(key, _receipt)

    sides = {"ours": ours, "once": peer}
    m = _rounds(sides, sides, cycles, rounds, "peer")
    ledger.close()
    return {
        "cycles": m["ours"],
        "peer_cycles": m["once"],
        "cycle_ratio": m["ours"] / m["once"],
        "replays": m["ours_replays"],
        "peer_replays": m["once_replays"],
        "replay_ratio": m["ours_replays"] / m["once_replays"],
    }


# -- concurrency ------------------------------------------------------------------------


def _worker(
    kind: str, path: str, mode: str, tag: str, cycles: int, start_at: float, shared: Any = None
) -> float:
    """Run `cycles` fresh keys from `start_at`; return when it finished. Threads share
    one ledger (`shared`), as they would in an application."""
    if kind == "ours":
        ledger = shared or Ledger(SQLiteCacheBackend(path, synchronous=mode))
        ledger.run(f"{tag}:warm-up", _receipt)
        step: Callable[[str], Any] = lambda key: ledger.run(key, _receipt)  # noqa: E731
    else:
        raw = Raw(Path(path), mode)
        step = raw.cycle
    keys = [f"{tag}:{i}" for i in range(cycles)]
    time.sleep(max(0.0, start_at - time.time()))
    for key in keys:
        step(key)
    return time.time()


def bench_concurrent(mode: str, cycles: int, rounds: int, folder: Path) -> dict[str, float]:
    """8 threads and 8 processes on distinct keys: total cycles/s, ours and raw."""
    result: dict[str, list[float]] = {}
    context = multiprocessing.get_context("spawn")
    with context.Pool(PROCESSES) as pool:
        for round_ in range(rounds):
            for kind in ("ours", "raw"):
                path = str(folder / f"conc-{kind}-{mode}.db")
                shared = Ledger(SQLiteCacheBackend(path, synchronous=mode))
                start_at = time.time() + 0.3
                done: list[float] = []

                def thread_main(tag: str, shared: Ledger = shared, start_at: float = start_at,
                                kind: str = kind, path: str = path,
                                done: list[float] = done) -> None:  # fmt: skip
                    done.append(_worker(kind, path, mode, tag, cycles, start_at, shared))

                threads = [
                    threading.Thread(target=thread_main, args=(f"t{round_}:{t}",))
                    for t in range(THREADS)
                ]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                shared.close()
                result.setdefault(f"threads_{kind}", []).append(
                    THREADS * cycles / (max(done) - start_at)
                )
                start_at = time.time() + 1.0  # the pool's workers import the package first
                args = [
                    (kind, path, mode, f"p{round_}:{p}", cycles, start_at) for p in range(PROCESSES)
                ]
                ends = pool.starmap(_worker, args)
                result.setdefault(f"processes_{kind}", []).append(
                    PROCESSES * cycles / (max(ends) - start_at)
                )
    m = {name: statistics.median(values) for name, values in result.items()}
    m["threads_ratio"] = m["threads_ours"] / m["threads_raw"]
    m["processes_ratio"] = m["processes_ours"] / m["processes_raw"]
    return m


# -- scale ------------------------------------------------------------------------------


def _fill_sqlite(path: Path, records: int) -> None:
    """Write `records` committed records straight into a ledger file (one transaction)."""
    ledger = Ledger(SQLiteCacheBackend(path))
    ledger.run("fill-template", _receipt)
    ledger.close()
    conn = _raw_connection(path, "OFF")
    have = conn.execute("SELECT count(*) FROM idempotency_records").fetchone()[0]
    _, commit_doc = _docs()
    batch = 50_000
    for start in range(have, records, batch):
        rows = [
            (f"fill:{i}", "COMMITTED", 1, 2, 0.0, commit_doc)
            for i in range(start, min(start + batch, records))
        ]
        conn.execute("BEGIN")
        conn.executemany(_INSERT, rows)
        conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def _fill_filelock(folder: Path, records: int) -> None:
    """Write `records` committed record files straight into a ledger folder (no fsync)."""
    backend = FileLockCacheBackend(folder)
    _, commit_doc = _docs()
    data = commit_doc.encode()
    shards: set[Path] = set()
    for i in range(records):
        final = backend._names(f"fill:{i}")[0]
        if final.parent not in shards:
            final.parent.mkdir(mode=0o700, exist_ok=True)
            shards.add(final.parent)
        if not final.exists():
            final.write_bytes(data)
            os.chmod(final, 0o600)
    backend.close()


def _scale_child(kind: str, where: str, mode: str, cycles: int, queue: Any) -> None:
    if kind == "sqlite":
        backend: Any = SQLiteCacheBackend(where, synchronous=mode)
    else:
        backend = FileLockCacheBackend(where)
    ledger = Ledger(backend)
    tag = hashlib.sha256(os.urandom(8)).hexdigest()[:8]
    keys = [f"scale:{tag}:{i}" for i in range(cycles)]
    began = time.process_time()
    rate = _rate(lambda key: ledger.run(key, _receipt), keys)
    cpu_us = (time.process_time() - began) / cycles * 1e6
    _rate(lambda key: ledger.run(key, _receipt), keys)  # replays touch the records too
    queue.put((rate, cpu_us, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))


def _scale_once(kind: str, where: Path, mode: str, cycles: int) -> tuple[float, float, float]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_scale_child, args=(kind, str(where), mode, cycles, queue))
    child.start()
    rate, cpu_us, rss_kib = queue.get()
    child.join()
    return rate, cpu_us, rss_kib / 1024


def bench_scale(
    kind: str, small: int, large: int, cycles: int, rounds: int, folder: Path, mode: str = "FULL"
) -> dict[str, float]:
    """Cycles/s and peak RSS of a fresh process working on a ledger of `small` and of
    `large` records; the two measurements alternate (each in its own process)."""
    where = {size: folder / f"scale-{kind}-{size}" for size in (small, large)}
    for size, path in where.items():
        if kind == "sqlite":
            path.mkdir(mode=0o700, exist_ok=True)
            where[size] = path = path / "ledger.db"
            _fill_sqlite(path, size)
        else:
            _fill_filelock(path, size)
    # The fills leave gigabytes of dirty pages and metadata (the file lock's are a million
    # files' worth); written back during the measurement, they would land in the journal
    # commits of its fsyncs and charge the large ledger for the fill, not for its size.
    os.sync()
    rates: dict[int, list[float]] = {small: [], large: []}
    cpu: dict[int, list[float]] = {small: [], large: []}
    rss: dict[int, list[float]] = {small: [], large: []}
    for _ in range(rounds):
        for size in (small, large):
            rate, cpu_us, mib = _scale_once(kind, where[size], mode, cycles)
            rates[size].append(rate)
            cpu[size].append(cpu_us)
            rss[size].append(mib)
    result = {
        "small": small,
        "large": large,
        "cycles_small": statistics.median(rates[small]),
        "cycles_large": statistics.median(rates[large]),
        "cpu_us_small": statistics.median(cpu[small]),
        "cpu_us_large": statistics.median(cpu[large]),
        "rss_mib_small": max(rss[small]),
        "rss_mib_large": max(rss[large]),
    }
    result["flatness"] = result["cycles_large"] / result["cycles_small"]
    result["cpu_flatness"] = result["cpu_us_small"] / result["cpu_us_large"]
    result["rss_mib_per_100k"] = (result["rss_mib_large"] - result["rss_mib_small"]) / (
        (large - small) / 100_000
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--cycles", type=int, help="cycles per round")
    parser.add_argument("--rounds", type=int, help="rounds (default 5, quick 3)")
    parser.add_argument("--scale", type=int, help="records for the scale figure (SQLite)")
    parser.add_argument("--filelock-scale", type=int, help="records for the file-lock figure")
    parser.add_argument("--skip", default="", help="comma list: peer,concurrency,scale")
    parser.add_argument("--dir", type=Path, help="where to put the ledgers (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    cycles = args.cycles or (500 if args.quick else 2000)
    rounds = args.rounds or (3 if args.quick else 5)
    scale = args.scale or (100_000 if args.quick else 1_000_000)
    filelock_scale = args.filelock_scale or (30_000 if args.quick else 200_000)
    skip = set(filter(None, args.skip.split(",")))

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        os.chmod(folder, 0o700)
        print(f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version}, "
              f"{platform.machine()}, {os.cpu_count()} cpus, ledgers in {folder}")  # fmt: skip
        print(f"{cycles} cycles per round, {rounds} rounds alternating ours/raw, medians\n")
        figures: dict[str, Any] = {
            "machine": {
                "python": platform.python_version(),
                "sqlite": sqlite3.sqlite_version,
                "cpus": os.cpu_count(),
                "load": os.getloadavg()[0],
            },
            "cycles": cycles,
            "rounds": rounds,
        }
        print(f"{'SQLite, 1 thread':<22}{'cycles/s':>10}{'raw':>10}{'ratio':>7}"
              f"{'replays/s':>11}{'raw':>10}{'ratio':>7}")  # fmt: skip
        for mode, r in bench_sqlite(["FULL", "CLAIMS", "NORMAL"], cycles, rounds, folder).items():
            figures[f"sqlite-{mode}"] = r
            print(f"{'synchronous=' + mode:<22}{r['cycles']:>10.0f}{r['raw_cycles']:>10.0f}"
                  f"{r['cycle_ratio']:>7.2f}{r['replays']:>11.0f}{r['raw_replays']:>10.0f}"
                  f"{r['replay_ratio']:>7.2f}")  # fmt: skip
        print("CPU per call, us (ours / raw = ratio raw/ours):")
        for mode in ("FULL", "CLAIMS", "NORMAL"):
            r = figures[f"sqlite-{mode}"]
            print(f"  {mode:<7} cycle {r['cycle_cpu_us']:.0f} / {r['raw_cycle_cpu_us']:.0f} = "
                  f"{r['cycle_cpu_ratio']:.2f};  replay {r['replay_cpu_us']:.1f} / "
                  f"{r['raw_replay_cpu_us']:.1f} = {r['replay_cpu_ratio']:.2f}")  # fmt: skip
        print("read first (raw SELECT + the two statements) / raw cycles = the ceiling of a ledger"
              " whose replays skip the write lock; ours / that:")  # fmt: skip
        for mode in ("FULL", "CLAIMS", "NORMAL"):
            r = figures[f"sqlite-{mode}"]
            print(f"  {mode:<7} {r['floor_cycles']:.0f} / {r['raw_cycles']:.0f} = "
                  f"{r['floor_ratio']:.2f} (CPU {r['floor_cycle_cpu_us']:.0f} us);  ours / read "
                  f"first {r['cycle_floor_ratio']:.2f}")  # fmt: skip
        full, claims = figures["sqlite-FULL"], figures["sqlite-CLAIMS"]
        print(f"CLAIMS / FULL cycles: ours {claims['cycles'] / full['cycles']:.2f}, "
              f"raw {claims['raw_cycles'] / full['raw_cycles']:.2f}")  # fmt: skip

        if "peer" not in skip:
            peer = bench_agent_once(cycles, rounds, folder)
            figures["agent-once"] = peer
            if peer is None:
                print("\nagent-once: not installed (pip install -e .[bench]); skipped")
            else:
                print(f"\nvs agent-once 0.1.0 (both synchronous=FULL): cycles {peer['cycles']:.0f}"
                      f" / {peer['peer_cycles']:.0f} = {peer['cycle_ratio']:.2f}x, replays "
                      f"{peer['replays']:.0f} / {peer['peer_replays']:.0f} = "
                      f"{peer['replay_ratio']:.2f}x")  # fmt: skip

        if "concurrency" not in skip:
            per = max(cycles // 4, 100)
            print(f"\nconcurrent, distinct keys, {per} cycles each, total cycles/s:")
            for mode in ("FULL", "CLAIMS"):
                c = bench_concurrent(mode, per, rounds, folder)
                figures[f"concurrent-{mode}"] = c
                print(f"  {mode:<7}{THREADS} threads: {c['threads_ours']:.0f} / raw "
                      f"{c['threads_raw']:.0f} = {c['threads_ratio']:.2f};  {PROCESSES} processes: "
                      f"{c['processes_ours']:.0f} / raw {c['processes_raw']:.0f} = "
                      f"{c['processes_ratio']:.2f}")  # fmt: skip

        if "scale" not in skip:
            per = max(cycles // 2, 200)
            print(f"\nscale, {per} cycles per fresh process, cycles/s (CPU us/cycle), peak RSS:")
            cases = (("sqlite", scale, "FULL"), ("sqlite", scale, "NORMAL"),
                     ("filelock", filelock_scale, ""))  # fmt: skip
            for kind, large, mode in cases:
                s = bench_scale(kind, 10_000, large, per, rounds, folder, mode or "FULL")
                name = f"{kind}-{mode}" if mode else kind
                figures[f"scale-{name}"] = s
                print(f"  {name:<14}@10k {s['cycles_small']:>6.0f}/s ({s['cpu_us_small']:.0f}) "
                      f"{s['rss_mib_small']:.1f} MiB; @{large // 1000}k {s['cycles_large']:>6.0f}/s"
                      f" ({s['cpu_us_large']:.0f}) {s['rss_mib_large']:.1f} MiB; ratio "
                      f"{s['flatness']:.2f} (CPU {s['cpu_flatness']:.2f}); RSS "
                      f"{s['rss_mib_per_100k']:+.2f} MiB per 100k records")  # fmt: skip

        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
            print(f"\nfigures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
