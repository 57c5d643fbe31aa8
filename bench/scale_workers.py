"""Many workers on one server: claims/s through the package against raw clients.

    python bench/scale.py workers [--workers 32] [--rounds 5] [--seconds 10]

32 worker processes (spawned, each with its own `Ledger` and its own raw client) claim
and commit distinct fresh keys on one PostgreSQL or Redis server started on loopback (as
bench/servers.py starts them: PostgreSQL with fsync on, Redis with appendonly under
`appendfsync everysec`, or `always` with --redis-fsync always). In each round every
worker runs one side for `--seconds`, released together, then the other side; the order
alternates round by round, so a noisy neighbour hits both. Claims/s is the sum over the
workers; the ratio ours/raw is the median of the rounds'.

"Ours" is `Ledger.run` with a trivial body. "Raw" sends exactly what ours sent for one
guarded call, captured from the wire: the parent runs `Ledger.run` on a sample key with
psycopg's `Cursor.execute` (redis-py's `Redis.execute_command`) recorded, and each raw
cycle sends the same statements (commands) with the sample key replaced by the cycle's,
over one plain psycopg connection (redis-py client). Whatever the store sends per call,
today's or a later version's, the baseline sends too, and the parent checks that a raw
cycle leaves a record the store reads back as committed under its key. Connections are
counted on the server during each side's phase, by application name (PostgreSQL's
pg_stat_activity) or client name (Redis' CLIENT LIST).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from crewai_idempotent import Ledger, Status, backend_from_url  # noqa: E402

SAMPLE = "bench-sample-key-00000000"
RAW_NAME = "bench-raw"
RECEIPT = "ch_3PxYz2LkdIwHu7ix0s1Q9aBc"


def _receipt() -> str:
    return RECEIPT


def kind_of(url: str) -> str:
    return "postgres" if url.startswith(("postgres://", "postgresql://")) else "redis"


# -- what one guarded call sends --------------------------------------------------------------


@contextlib.contextmanager
def _recording(kind: str, sent: list[tuple[Any, ...]]) -> Iterator[None]:
    if kind == "postgres":
        import psycopg

        original = psycopg.Cursor.execute

        def execute(self: Any, query: Any, params: Any = None, **options: Any) -> Any:
            text = query if isinstance(query, str) else query.as_string(self)
            sent.append((text, params))
            return original(self, query, params, **options)

        psycopg.Cursor.execute = execute  # type: ignore[method-assign]
        try:
            yield
        finally:
            psycopg.Cursor.execute = original  # type: ignore[method-assign]
    else:
        import redis

        original_command = redis.Redis.execute_command

        def execute_command(self: Any, *args: Any, **options: Any) -> Any:
            sent.append((args, options))
            return original_command(self, *args, **options)

        redis.Redis.execute_command = execute_command  # type: ignore[method-assign]
        try:
            yield
        finally:
            redis.Redis.execute_command = original_command  # type: ignore[method-assign]


def capture(url: str) -> list[tuple[Any, ...]]:
    """What `Ledger.run` sends to the server for one guarded call of a fresh key (after a
    warm-up call): [(sql, params)] for PostgreSQL, [(args, options)] for Redis."""
    ledger = Ledger(backend_from_url(url))
    ledger.run(SAMPLE + "-warm-up", _receipt)
    sent: list[tuple[Any, ...]] = []
    with _recording(kind_of(url), sent):
        ledger.run(SAMPLE, _receipt)
    ledger.close()
    if not sent:
        raise RuntimeError("capturing a guarded call recorded nothing sent to the server")
    return sent


def _swap(value: Any, key: str) -> Any:
    if isinstance(value, str):
        return value.replace(SAMPLE, key)
    if isinstance(value, bytes):
        return value.replace(SAMPLE.encode(), key.encode())
    if isinstance(value, dict):
        return {name: _swap(item, key) for name, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_swap(item, key) for item in value)
    return value


class Raw:
    """The captured statements (commands) over one plain client, a key at a time."""

    def __init__(self, url: str, sent: list[tuple[Any, ...]]) -> None:
        self.kind = kind_of(url)
        self.sent = sent
        base = url.split("?", 1)[0]
        if self.kind == "postgres":
            import psycopg

            self.conn: Any = psycopg.connect(base, autocommit=True, application_name=RAW_NAME)
        else:
            import redis

            self.conn = redis.Redis.from_url(base, client_name=RAW_NAME)

    def cycle(self, key: str) -> None:
        if self.kind == "postgres":
            for sql, params in self.sent:
                cursor = self.conn.execute(_swap(sql, key), _swap(params, key))
                if cursor.description is not None:
                    cursor.fetchall()
        else:
            for args, options in self.sent:
                self.conn.execute_command(*_swap(args, key), **options)

    def close(self) -> None:
        self.conn.close()


def check_raw(url: str, sent: list[tuple[Any, ...]]) -> None:
    """A raw cycle must leave what a guarded call leaves: a committed record of its key."""
    raw = Raw(url, sent)
    backend = backend_from_url(url)
    try:
        for n in range(2):
            key = f"bench-raw-check-{os.getpid()}-{n}"
            raw.cycle(key)
            record = backend.get(key)
            if record is None or record.key != key or record.status is not Status.COMMITTED:
                raise RuntimeError(
                    f"a raw cycle for {key!r} left {record!r}: the captured statements did not "
                    "replay as the same claim and commit"
                )
    finally:
        raw.close()
        backend.close()


# -- the workers --------------------------------------------------------------------------------


def _worker(index: int, url: str, sent: list[tuple[Any, ...]], pipe: Any) -> None:
    ledger = Ledger(backend_from_url(url))
    raw = Raw(url, sent)
    tag = f"w{index}-{os.getpid()}"
    ledger.run(f"{tag}:ours-warm-up", _receipt)
    raw.cycle(f"{tag}:raw-warm-up")

    def ours(key: str) -> None:
        ledger.run(key, _receipt)

    sides = {"ours": ours, "raw": raw.cycle}
    pipe.send("ready")
    while (order := pipe.recv()) is not None:
        side, start_at, seconds, round_ = order
        step, deadline = sides[side], start_at + seconds
        time.sleep(max(0.0, start_at - time.time()))
        latencies: list[float] = []
        n = 0
        while time.time() < deadline:
            began = time.perf_counter()
            step(f"{tag}:{side}:{round_}:{n}")
            latencies.append(time.perf_counter() - began)
            n += 1
        pipe.send(latencies)
    ledger.close()
    raw.close()


def _connections(url: str) -> dict[str, int]:
    """Client connections to the server by application or client name."""
    base = url.split("?", 1)[0]
    if kind_of(url) == "postgres":
        import psycopg

        with psycopg.connect(base, autocommit=True, application_name="bench-parent") as conn:
            rows = conn.execute(
                "SELECT application_name, count(*) FROM pg_stat_activity "
                "WHERE backend_type = 'client backend' GROUP BY 1"
            ).fetchall()
        return {str(name): int(count) for name, count in rows if name != "bench-parent"}
    import redis

    client = redis.Redis.from_url(base, client_name="bench-parent")
    counts: dict[str, int] = {}
    for entry in client.client_list():
        name = entry.get("name") or "(unnamed)"
        if name != "bench-parent":
            counts[name] = counts.get(name, 0) + 1
    client.close()
    return counts


def _quantile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] * 1000


def run(url: str, workers: int = 32, rounds: int = 5, seconds: float = 10.0) -> dict[str, Any]:
    """The comparison on the server at `url` (a fresh table or prefix)."""
    sent = capture(url)
    check_raw(url, sent)
    context = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    for index in range(workers):
        parent, child = context.Pipe()
        proc = context.Process(target=_worker, args=(index, url, sent, child), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    for pipe in pipes:
        if not pipe.poll(300) or pipe.recv() != "ready":
            raise RuntimeError("a worker did not start")
    rates: dict[str, list[float]] = {"ours": [], "raw": []}
    latencies: dict[str, list[float]] = {"ours": [], "raw": []}
    connections: dict[str, list[dict[str, int]]] = {"ours": [], "raw": []}
    try:
        for round_ in range(rounds):
            order = ("ours", "raw") if round_ % 2 == 0 else ("raw", "ours")
            for side in order:
                start_at = time.time() + 0.5
                for pipe in pipes:
                    pipe.send((side, start_at, seconds, round_))
                time.sleep(max(0.0, start_at + seconds / 2 - time.time()))
                connections[side].append(_connections(url))
                done = [pipe.recv() for pipe in pipes]
                rates[side].append(sum(len(d) for d in done) / seconds)
                latencies[side].extend(x for d in done for x in d)
    finally:
        for pipe in pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for proc in procs:
            proc.join(60)
    ratios = [o / r for o, r in zip(rates["ours"], rates["raw"], strict=True) if r]
    return {
        "workers": workers,
        "rounds": rounds,
        "seconds": seconds,
        "sent_per_call": len(sent),
        "sent": [str(item[0])[:200] for item in sent],
        "ours_per_s": statistics.median(rates["ours"]),
        "raw_per_s": statistics.median(rates["raw"]),
        "ours_rounds": rates["ours"],
        "raw_rounds": rates["raw"],
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "ours_p99_ms": _quantile(latencies["ours"], 0.99),
        "raw_p99_ms": _quantile(latencies["raw"], 0.99),
        "connections": {side: _per_worker(found, workers) for side, found in connections.items()},
    }


def _per_worker(samples: list[dict[str, int]], workers: int) -> dict[str, float]:
    """Connections by name during a side's phases, per worker (median of the samples)."""
    names = {name for sample in samples for name in sample}
    return {
        name: statistics.median(sample.get(name, 0) for sample in samples) / workers
        for name in sorted(names)
    }


@contextlib.contextmanager
def servers(redis_fsync: str = "everysec") -> Iterator[dict[str, str]]:
    """PostgreSQL (fsync on) and Redis (appendonly, `redis_fsync`) on loopback, as
    bench/servers.py starts them; {kind: url of a fresh table / prefix}."""
    from tests.support.servers import start_postgres, start_redis

    started: list[Any] = []
    try:
        pg = start_postgres(fsync=True, max_connections=300)
        started.append(pg)
        redis_server = start_redis(appendonly=True, appendfsync=redis_fsync)
        started.append(redis_server)
        yield {"postgres": pg.fresh_url(), "redis": redis_server.fresh_url()}
    finally:
        for server in started:
            server.cleanup()
