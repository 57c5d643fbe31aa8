"""The async path under a crowd, next to the sync path in threads measured in the same run.

    python bench/async_swarm.py                 # memory, SQLite, file lock, PostgreSQL, Redis
    python bench/async_swarm.py --local         # without the server backends
    python bench/async_swarm.py --calls 200     # a smaller crowd

Two workloads, each with a body that waits `--body-ms` (a provider's round trip):

* distinct: N calls on N distinct keys at once. Async: N `aexecute` tasks on one event
  loop. Baseline: the same N `run` calls on a pool of `--threads` threads (what a sync
  caller has to do to overlap the bodies).
* one key: N calls on one key at once: one runs, the rest replay. Async: N tasks.
  Baseline: N `run` calls on the thread pool.

Reported per backend: wall time and calls per second of each side, the ratio async/sync
(above 1: the async path is faster), the slowest call, and the longest stall of a ticker
task on the loop during the async run (wall-clock, and the loop thread's CPU time in that
gap: the work that held it up, apart from waiting for a core). Each side runs on a fresh
store.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from crewai_idempotent import (
    CacheBackend,
    FileLockCacheBackend,
    InMemoryCacheBackend,
    Ledger,
    SQLiteCacheBackend,
    backend_from_url,
)


async def _async_side(ledger: Ledger, keys: list[str], body_s: float) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    worst = worst_cpu = 0.0
    running = True

    async def ticker() -> None:
        nonlocal worst, worst_cpu
        last, last_cpu = loop.time(), time.thread_time()
        while running:
            await asyncio.sleep(0.005)
            now, cpu = loop.time(), time.thread_time()
            worst = max(worst, now - last - 0.005)
            worst_cpu = max(worst_cpu, cpu - last_cpu)
            last, last_cpu = now, cpu

    async def body() -> str:
        await asyncio.sleep(body_s)
        return "receipt"

    async def one(key: str) -> float:
        started = time.perf_counter()
        await ledger.aexecute(key, body)
        return time.perf_counter() - started

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    started = time.perf_counter()
    tasks = []
    for first in range(0, len(keys), 100):  # the crowd arrives over a few loop turns
        tasks += [asyncio.create_task(one(key)) for key in keys[first : first + 100]]
        await asyncio.sleep(0)
    latencies = await asyncio.gather(*tasks)
    wall = time.perf_counter() - started
    running = False
    await tick
    return {"wall": wall, "slowest": max(latencies), "stall": worst, "stall_cpu": worst_cpu}


def _sync_side(ledger: Ledger, keys: list[str], body_s: float, threads: int) -> dict[str, float]:
    def body() -> str:
        time.sleep(body_s)
        return "receipt"

    def one(key: str) -> float:
        started = time.perf_counter()
        ledger.run(key, body)
        return time.perf_counter() - started

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        latencies = list(pool.map(one, keys))
    return {"wall": time.perf_counter() - started, "slowest": max(latencies)}


def run(
    label: str, open_: Callable[[str], CacheBackend], calls: int, body_s: float, threads: int
) -> None:
    for workload in ("distinct", "one key"):
        keys = [f"k{n}" for n in range(calls)] if workload == "distinct" else ["k"] * calls
        figures: dict[str, dict[str, float]] = {}
        for side in ("sync", "async"):
            ledger = Ledger(open_(f"{workload}-{side}".replace(" ", "-")))
            gc.collect()
            if side == "async":
                figures[side] = asyncio.run(_async_side(ledger, keys, body_s))
            else:
                figures[side] = _sync_side(ledger, keys, body_s, threads)
            ledger.close()
        a, s = figures["async"], figures["sync"]
        print(
            f"{label:<22} {workload:<8} "
            f"async {calls / a['wall']:8.0f}/s ({a['wall']:6.2f} s, slowest {a['slowest']:5.2f} s,"
            f" stall {a['stall'] * 1000:5.1f} ms, {a['stall_cpu'] * 1000:4.1f} ms CPU) | "
            f"sync x{threads} threads {calls / s['wall']:8.0f}/s ({s['wall']:6.2f} s, "
            f"slowest {s['slowest']:5.2f} s) | async/sync {s['wall'] / a['wall']:5.2f}",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--body-ms", type=float, default=50.0)
    parser.add_argument("--threads", type=int, default=64, help="the sync baseline's pool")
    parser.add_argument("--local", action="store_true", help="skip PostgreSQL and Redis")
    args = parser.parse_args()
    body_s = args.body_ms / 1000
    folder = Path(tempfile.mkdtemp(prefix="async-swarm-"))
    targets: list[tuple[str, Callable[[str], CacheBackend]]] = [
        ("memory", lambda name: InMemoryCacheBackend()),
        ("SQLite FULL", lambda name: SQLiteCacheBackend(folder / f"{name}.db")),
        (
            "SQLite NORMAL",
            lambda name: SQLiteCacheBackend(folder / f"n-{name}.db", synchronous="NORMAL"),
        ),
        ("file lock", lambda name: FileLockCacheBackend(folder / name)),
    ]
    servers: list[Any] = []
    if not args.local:
        from tests.support.servers import start_postgres, start_redis

        pg, redis = start_postgres(), start_redis(appendonly=True, appendfsync="everysec")
        servers += [pg, redis]
        targets.append(("PostgreSQL", lambda name: backend_from_url(pg.fresh_url())))
        targets.append(("Redis everysec", lambda name: backend_from_url(redis.fresh_url())))
    print(
        f"{args.calls} concurrent calls, body {args.body_ms:.0f} ms; "
        f"async: one event loop; sync baseline: {args.threads} threads"
    )
    try:
        for label, open_ in targets:
            run(label, open_, args.calls, body_s, args.threads)
    finally:
        for server in servers:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
