"""PostgreSQL and Redis ledger throughput next to a raw client baseline in the same run.

    python bench/servers.py             # the full run recorded in docs/backends.md
    python bench/servers.py --quick     # a smoke run
    python bench/servers.py --postgres-url postgresql://... --redis-url redis://...
    python bench/servers.py --profile   # where one cycle's time goes, by module

Without URLs it starts throwaway servers on loopback (as the tests do): PostgreSQL with its
default durability (fsync on, synchronous_commit on), Redis with appendonly yes under
appendfsync always (what a money-moving tool needs) and under everysec.

One cycle = claim + commit of a fresh key (`Ledger.run` with a trivial body). The raw
baseline sends the same two statements (PostgreSQL: the same claim and conditional UPDATE
text on a table of the same schema; Redis: the same two Lua scripts on the same key
layout) with documents of the same size prepared in advance, over one plain psycopg
connection / redis-py client: the ratio ours/raw is what the guard costs on top of the
server round trips. A replay is one guarded call on a committed key, against the raw
claim statement that finds the key taken. Rounds alternate ours and raw and the median
is reported. The concurrent figures run 16 processes (each with its own backend or raw
client) on distinct keys for a fixed time, released together.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing
import os
import platform
import pstats
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from crewai_idempotent import Ledger, Status, backend_from_url  # noqa: E402

RECEIPT = "ch_3PxYz2LkdIwHu7ix0s1Q9aBc"


# -- one cycle, ours and raw ---------------------------------------------------------------


def _sample_docs(url: str) -> tuple[str, str]:
    """A claim document and a commit document of the size the ledger writes."""
    ledger = Ledger(backend_from_url(url))
    key = f"sample:{uuid.uuid4().hex[:8]}"
    ledger.run(key, lambda: RECEIPT)
    committed = ledger.get(key)
    assert committed is not None
    ledger.close()
    claim = committed.evolve(None, revision=1, status=Status.PENDING)
    return claim.to_json(), committed.to_json()


class RawPostgres:
    """The ledger's two statements over one plain autocommit psycopg connection."""

    def __init__(self, url: str, docs: tuple[str, str]) -> None:
        import psycopg

        from crewai_idempotent.backends.postgres import PostgresCacheBackend
        from crewai_idempotent.backends.postgres._schema import Statements

        backend = PostgresCacheBackend.from_url(url)  # creates the table: same schema as ours
        backend.get("nothing")
        table, dsn = backend.table, backend._conninfo
        backend.close()
        self.sql = Statements(table, None)
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.claim_doc, self.commit_doc = docs

    def cycle(self, key: str) -> None:
        key = f"raw:{key}"  # the same table as ours: never the keys ours wrote
        now = time.time()
        claim = {"key": key, "status": "PENDING", "token": 1, "revision": 1,
                 "updated_at": now, "doc": self.claim_doc}  # fmt: skip
        self.conn.execute(self.sql.claim, claim).fetchall()
        commit = {"status": "COMMITTED", "token": 1, "revision": 2, "updated_at": now,
                  "doc": self.commit_doc, "key": key, "current_token": 1,
                  "current_revision": 1}  # fmt: skip
        self.conn.execute(self.sql.replace, commit)

    def replay(self, key: str) -> None:
        key = f"raw:{key}"
        claim = {"key": key, "status": "PENDING", "token": 1, "revision": 1,
                 "updated_at": time.time(), "doc": self.claim_doc}  # fmt: skip
        self.conn.execute(self.sql.claim, claim).fetchall()

    def close(self) -> None:
        self.conn.close()


class RawRedis:
    """The ledger's two Lua scripts over one plain redis-py client."""

    def __init__(self, url: str, docs: tuple[str, str]) -> None:
        import redis

        from crewai_idempotent.backends.redis import RedisCacheBackend
        from crewai_idempotent.backends.redis._scripts import CLAIM, REPLACE

        backend = RedisCacheBackend.from_url(url)
        self.prefix = backend.prefix + "raw:"
        backend.close()
        base = url.split("?", 1)[0]
        self.client = redis.Redis.from_url(base)
        self.claim = self.client.register_script(CLAIM)
        self.replace = self.client.register_script(REPLACE)
        self.indexes = [
            f"{self.prefix}i:{s}" for s in ("PENDING", "COMMITTED", "FAILED", "UNCERTAIN")
        ]
        self.claim_doc, self.commit_doc = docs

    def cycle(self, key: str) -> None:
        now = repr(time.time())
        record = f"{self.prefix}r:{key}"
        self.claim(keys=[record, self.indexes[0]],
                   args=[key, "PENDING", 1, 1, now, self.claim_doc, 0])  # fmt: skip
        self.replace(keys=[record, *self.indexes],
                     args=[key, 1, 1, "COMMITTED", 1, 2, now, self.commit_doc])  # fmt: skip

    def replay(self, key: str) -> None:
        self.claim(keys=[f"{self.prefix}r:{key}", self.indexes[0]],
                   args=[key, "PENDING", 1, 1, repr(time.time()), self.claim_doc, 0])  # fmt: skip

    def close(self) -> None:
        self.client.close()


def _raw(kind: str, url: str, docs: tuple[str, str]) -> RawPostgres | RawRedis:
    return RawPostgres(url, docs) if kind == "postgres" else RawRedis(url, docs)


def _rate(fn: Callable[[str], Any], keys: list[str], cpu: list[float] | None = None) -> float:
    """Calls per second; appends this process's CPU microseconds per call to `cpu`."""
    start, start_cpu = time.perf_counter(), time.process_time()
    for key in keys:
        fn(key)
    if cpu is not None:
        cpu.append((time.process_time() - start_cpu) / len(keys) * 1e6)
    return len(keys) / (time.perf_counter() - start)


def bench_single(kind: str, url: str, cycles: int, rounds: int) -> dict[str, float]:
    docs = _sample_docs(url)
    ledger = Ledger(backend_from_url(url))
    raw = _raw(kind, url, docs)
    ledger.run("warm-up", lambda: RECEIPT)
    raw.cycle("warm-up")
    tag = uuid.uuid4().hex[:6]
    ours_c, raw_c, ours_r, raw_r = [], [], [], []
    ours_cpu: list[float] = []
    raw_cpu: list[float] = []
    for round_ in range(rounds):
        keys = [f"c:{tag}:{round_}:{i}" for i in range(cycles)]
        ours_c.append(_rate(lambda key: ledger.run(key, lambda: RECEIPT), keys, ours_cpu))
        raw_c.append(_rate(raw.cycle, keys, raw_cpu))
        ours_r.append(_rate(lambda key: ledger.run(key, lambda: RECEIPT), keys))
        raw_r.append(_rate(raw.replay, keys))
    ledger.close()
    raw.close()
    result = {
        "ours_cycles": statistics.median(ours_c),
        "raw_cycles": statistics.median(raw_c),
        "ours_replays": statistics.median(ours_r),
        "raw_replays": statistics.median(raw_r),
        "ours_cpu_us_per_cycle": statistics.median(ours_cpu),
        "raw_cpu_us_per_cycle": statistics.median(raw_cpu),
    }
    result["cycle_ratio"] = result["ours_cycles"] / result["raw_cycles"]
    result["replay_ratio"] = result["ours_replays"] / result["raw_replays"]
    return result


# -- 16 processes at once ------------------------------------------------------------------


def _worker(kind: str, side: str, url: str, docs: tuple[str, str], seconds: float,
            start: Any, results: Any) -> None:  # fmt: skip
    tag = f"{side}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    if side == "ours":
        ledger = Ledger(backend_from_url(url))
        ledger.run(f"warm-up:{tag}", lambda: RECEIPT)

        def cycle(key: str) -> None:
            ledger.run(key, lambda: RECEIPT)

        close = ledger.close
    else:
        raw = _raw(kind, url, docs)
        raw.cycle(f"warm-up:{tag}")
        cycle, close = raw.cycle, raw.close
    start.wait()
    deadline = time.perf_counter() + seconds
    done = 0
    while time.perf_counter() < deadline:
        cycle(f"w:{tag}:{done}")
        done += 1
    close()
    results.put(done)


def bench_concurrent(kind: str, url: str, workers: int, seconds: float) -> dict[str, float]:
    docs = _sample_docs(url)
    context = multiprocessing.get_context("spawn")
    result: dict[str, float] = {}
    for side in ("raw", "ours"):
        start, results = context.Barrier(workers), context.Queue()
        procs = [
            context.Process(target=_worker, args=(kind, side, url, docs, seconds, start, results))
            for _ in range(workers)
        ]
        for proc in procs:
            proc.start()
        total = sum(results.get(timeout=seconds + 120) for _ in procs)
        for proc in procs:
            proc.join()
        result[f"{side}_cycles"] = total / seconds
    result["cycle_ratio"] = result["ours_cycles"] / result["raw_cycles"]
    return result


# -- where the time goes -------------------------------------------------------------------


def profile(url: str, cycles: int) -> list[tuple[str, float]]:
    """Own time per cycle (microseconds), grouped by module family."""
    ledger = Ledger(backend_from_url(url))
    ledger.run("warm-up", lambda: RECEIPT)
    tag = uuid.uuid4().hex[:6]
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(cycles):
        ledger.run(f"p:{tag}:{i}", lambda: RECEIPT)
    profiler.disable()
    ledger.close()
    groups: dict[str, float] = {}
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    for (filename, _line, function), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        if "crewai_idempotent" in filename:
            name = os.path.basename(filename)
            if name == "_record.py":
                group = f"core: Record.{function}"
            elif name in ("_postgres.py", "_redis.py"):
                group = f"backend: {name}"
            else:
                group = f"core: {name}"
        elif "psycopg_pool" in filename:
            group = "psycopg_pool"
        elif "psycopg" in filename:
            group = "psycopg (incl. waiting for the server)"
        elif "redis" in filename:
            group = "redis-py (incl. waiting for the server)"
        elif "pydantic" in filename or function.startswith("to_json") or "from_json" in function:
            group = "pydantic_core JSON"
        else:
            group = "sockets, selectors, stdlib (incl. waiting for the server)"
        groups[group] = groups.get(group, 0.0) + tottime
    return sorted(((g, t / cycles * 1e6) for g, t in groups.items()), key=lambda x: -x[1])


# -- the run -------------------------------------------------------------------------------


def _servers(args: argparse.Namespace) -> tuple[list[tuple[str, str, str]], list[Any]]:
    """[(label, kind, url)] and the servers to stop afterwards."""
    targets: list[tuple[str, str, str]] = []
    started: list[Any] = []
    if args.postgres_url or args.redis_url:
        if args.postgres_url:
            targets.append(("PostgreSQL (given)", "postgres", args.postgres_url))
        if args.redis_url:
            targets.append(("Redis (given)", "redis", args.redis_url))
        return targets, started
    from tests.support.servers import start_postgres, start_redis

    pg = start_postgres(fsync=True)
    started.append(pg)
    targets.append(("PostgreSQL 15, fsync on", "postgres", pg.fresh_url()))
    for fsync in ("always", "everysec"):
        server = start_redis(appendonly=True, appendfsync=fsync)
        started.append(server)
        targets.append((f"Redis 7, appendfsync {fsync}", "redis", server.fresh_url()))
    return targets, started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--postgres-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="also profile the hot path")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    cycles, rounds, seconds = (200, 3, 2.0) if args.quick else (1000, 7, 10.0)

    targets, started = _servers(args)
    report: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                              f"Python {platform.python_version()}"}  # fmt: skip
    try:
        for label, kind, url in targets:
            single = bench_single(kind, url, cycles, rounds)
            together = bench_concurrent(kind, url, args.workers, seconds)
            report[label] = {"single": single, f"{args.workers} processes": together}
            if args.profile:
                report[label]["profile_us_per_cycle"] = profile(url, cycles)
            if not args.json:
                _print(
                    label, single, together, args.workers, report[label].get("profile_us_per_cycle")
                )
    finally:
        for server in started:
            server.cleanup()
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _print(label: str, single: dict[str, float], together: dict[str, float], workers: int,
           profiled: list[tuple[str, float]] | None) -> None:  # fmt: skip
    print(f"\n{label}")
    print(f"  claim+commit, 1 thread : ours {single['ours_cycles']:8.0f}/s   raw "
          f"{single['raw_cycles']:8.0f}/s   ours/raw {single['cycle_ratio']:.2f}")  # fmt: skip
    print(f"  replay, 1 thread       : ours {single['ours_replays']:8.0f}/s   raw "
          f"{single['raw_replays']:8.0f}/s   ours/raw {single['replay_ratio']:.2f}")  # fmt: skip
    print(f"  client CPU per cycle   : ours {single['ours_cpu_us_per_cycle']:6.0f} us     raw "
          f"{single['raw_cpu_us_per_cycle']:6.0f} us")  # fmt: skip
    print(f"  claim+commit, {workers} procs: ours {together['ours_cycles']:8.0f}/s   raw "
          f"{together['raw_cycles']:8.0f}/s   ours/raw {together['cycle_ratio']:.2f}")  # fmt: skip
    if profiled:
        total = sum(t for _g, t in profiled)
        print(f"  profile, own time per cycle ({total:.0f} us under cProfile):")
        for group, micros in profiled:
            print(f"    {micros:8.1f} us  {group}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
