"""What the people's side costs as the ledger grows (issue 30's bar), per store and size.

    python bench/scale.py load    [--backends ...] [--sizes ...]     # build the cached ledgers
    python bench/scale.py run     [--backends ...] [--sizes ...] [--measure ...]
    python bench/scale.py workers [--backends postgres redis]         # 32 processes, ours vs raw
    python bench/scale.py report  [--write-docs]                      # the tables, from the results
    python bench/scale.py cache   [--prune]                           # what the cache holds

Backends: sqlite, postgres, redis (PostgreSQL and Redis are started on loopback, from the
project's test support). Sizes are receipts per ledger: 10000, 1000000, 10000000 (Redis
stops at 1M: bigger sizes are skipped for it). Every ledger also holds 1,000 pending
approvals, 200 decided ones, 20 UNCERTAIN records (5 needs-operator), 5 stale claims, 20
spend windows and their outbox entries (bench/scale_ledgers.py says how it is loaded and
cached; a first build prints its time and rate, and `load --project N` what N would cost).

Measurements (`--measure`, default all), on a working copy of each ledger:
  listings  each listing command as a person runs it (`crewai-idempotent ...` in a fresh
            process, best of --runs): approvals ls, ls --needs-operator, ls --status
            uncertain, doctor, spend, reconcile --dry-run, notifications ls
  pages     each console page's server time (approvals, an approval, uncertain, records,
            a record, spend, notifications), best and median of 3, in process
  idle      one open console page (page + /events) for --idle-seconds while nothing is
            written: rows read, the server's statements / commands, CPU; then a write,
            and how long the page takes to hear of it
  memory    peak RSS of `ls`, `export` and `purge` (a plain run each)
  traced    tracemalloc's peak for the same three (a second, traced run; slow)
  purge     claims' latency (p50/p99) while `purge` deletes --purge-size expired
            records, against the same worker on the quiet ledger (one ledger per backend
            in which every receipt has expired)
`workers` is separate: 32 worker processes claiming and committing distinct keys through
the package against raw psycopg / redis-py sending the same statements (captured from the
package's own call), interleaved rounds (bench/scale_workers.py).

Results are merged into one JSON file per version of the code (--results; default
bench/.cache/results/<digest of crewai_idempotent>.json), so sizes and backends can be run
separately and `report` puts them side by side: growth 1M / 10k against the issue's
targets. `report --write-docs` replaces the generated block of docs/benchmarks.md.

The full set, after the Select work is merged (hours; ~60 GB of disk at 10M):
    python bench/scale.py run --backends sqlite postgres --sizes 10000 1000000 10000000
    python bench/scale.py run --backends redis --sizes 10000 1000000
    python bench/scale.py workers
    python bench/scale.py report --write-docs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sqlite3
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for entry in (str(ROOT), str(HERE)):
    if entry not in sys.path:
        sys.path.insert(0, entry)

import scale_ledgers as ledgers  # noqa: E402
import scale_measure as measure  # noqa: E402

MEASURES = ("listings", "pages", "idle", "memory", "traced", "purge")
BACKENDS = ("sqlite", "postgres", "redis")
NAMES = {"sqlite": "SQLite", "postgres": "PostgreSQL", "redis": "Redis"}
REDIS_LARGEST = 1_000_000
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench/scale.py: begin -->", "<!-- bench/scale.py: end -->"

#: (small, large) sizes the growth ratios compare, and the issue's targets.
GROWTH = (10_000, 1_000_000)
LISTING_GROWTH = {"sqlite": 1.2, "postgres": 1.2, "redis": 1.5}
PAGE_LIMIT_S = 0.200
MEMORY_GROWTH = 1.2
PURGE_P99 = 2.0
WORKERS_RATIO = 0.8


# -- the results file ----------------------------------------------------------------------------


def code_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted((ROOT / "crewai_idempotent").rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return done.stdout.strip()


class Results:
    """Every figure of one version of the code, merged run after run into one file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        self.data.setdefault("code", {})
        self.data["code"] |= {
            "digest": code_digest(),
            "commit": _git("rev-parse", "--short", "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "--", "crewai_idempotent")),
        }
        self.data.setdefault("machine", machine())
        for part in ("versions", "ledgers", "sizes", "purge", "workers"):
            self.data.setdefault(part, {})

    def ran(self) -> None:
        """Say that figures are being measured now: the machine, its load, the date."""
        self.data["machine"] = machine()

    def put(self, *where_and_value: Any) -> None:
        *where, value = where_and_value
        node = self.data
        for name in where[:-1]:
            node = node.setdefault(str(name), {})
        node[str(where[-1])] = value
        self.save()

    def merge(self, *where_and_value: Any) -> None:
        """`put`, keeping what the value does not say (a plain run's figures beside a
        traced run's)."""
        *where, value = where_and_value
        node = self.data
        for name in where:
            node = node.setdefault(str(name), {})
        _deep_merge(node, value)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".tmp")
        partial.write_text(json.dumps(self.data, indent=1, default=str))
        partial.replace(self.path)


def _deep_merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for name, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(name), dict):
            _deep_merge(into[name], value)
        else:
            into[name] = value


def machine() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "cpus": os.cpu_count(),
        "arch": platform.machine(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "sqlite": sqlite3.sqlite_version,
        "load_average": load,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def _guarded(what: str, action: Callable[[], Any]) -> Any:
    """A measurement's figures, or what stopped it (the run goes on with the next)."""
    began = time.perf_counter()
    ledgers.say(f"{what} ...")
    try:
        found = action()
    except Exception as exc:  # noqa: BLE001 - said, and the run goes on
        traceback.print_exc()
        found = {"error": f"{type(exc).__name__}: {exc}"}
    ledgers.say(f"{what}: {time.perf_counter() - began:.1f} s")
    return found


def _sizes(kind: str, sizes: list[int]) -> list[int]:
    if kind != "redis":
        return sizes
    kept = [size for size in sizes if size <= REDIS_LARGEST]
    if kept != sizes:
        ledgers.say(f"Redis: sizes above {REDIS_LARGEST:,} skipped")
    return kept


# -- the commands ---------------------------------------------------------------------------------


def command_load(options: argparse.Namespace, results: Results) -> None:
    cache = ledgers.Cache(options.cache)
    for kind in options.backends:
        store = ledgers.STORES[kind](cache, options.rebuild)
        try:
            results.put("versions", kind, store.version())
            shapes = [ledgers.Shape(size) for size in _sizes(kind, options.sizes)]
            if options.purge_size:
                shapes.append(ledgers.purge_shape(options.purge_size))
            for shape in shapes:
                facts = store.ensure(shape)
                results.put("ledgers", kind, shape.label, facts)
                print(_load_line(kind, facts, options.project))
        finally:
            store.close()


def _load_line(kind: str, facts: dict[str, Any], project: list[int]) -> str:
    shape = facts["shape"]
    line = (
        f"{NAMES[kind]} {shape['receipts']:,} receipts: built in {facts['total_s']:.1f} s "
        f"({facts['receipts_per_s']:,.0f} receipts/s; "
        + ", ".join(f"{k} {v:.1f} s" for k, v in facts["seconds"].items())
        + f"), {facts['bytes'] / 1e6:,.0f} MB"
    )
    for size in project:
        seconds = size / facts["receipts_per_s"] + facts["seconds"].get("documents", 0.0)
        line += (
            f"\n  projected at {size:,}: ~{seconds / 60:.0f} min, "
            f"~{size * facts['bytes_per_record'] / 1e9:.1f} GB"
        )
    return line


def command_run(options: argparse.Namespace, results: Results) -> None:
    cache = ledgers.Cache(options.cache)
    wanted = set(options.measure)
    for kind in options.backends:
        store = ledgers.STORES[kind](cache, options.rebuild)
        try:
            results.put("versions", kind, store.version())
            for size in _sizes(kind, options.sizes):
                shape = ledgers.Shape(size)
                results.put("ledgers", kind, shape.label, store.ensure(shape))
                _run_size(options, results, store, shape, wanted)
            if "purge" in wanted and options.purge_size:
                shape = ledgers.purge_shape(options.purge_size)
                results.put("ledgers", kind, shape.label, store.ensure(shape))
                with store.copy(shape) as url:
                    found = _guarded(
                        f"{NAMES[kind]} claims during a purge of {shape.receipts:,}",
                        lambda url=url: measure.claims_during_purge(url, options.quiet_seconds),
                    )
                results.put("purge", kind, str(shape.receipts), found)
        finally:
            store.close()
    print(report(results.data))


def _run_size(
    options: argparse.Namespace,
    results: Results,
    store: ledgers.Ledgers,
    shape: ledgers.Shape,
    wanted: set[str],
) -> None:
    kind, size = store.kind, shape.receipts
    where = f"{NAMES[kind]} {size:,}"
    receipt = ledgers.sample_keys(shape)["receipt"]
    with store.copy(shape) as url:
        if "listings" in wanted:
            found = _guarded(f"{where}: listings", lambda: measure.listings(url, options.runs))
            results.put("sizes", kind, size, "listings", found)
        if "pages" in wanted:
            found = _guarded(f"{where}: console pages", lambda: measure.pages(url, receipt))
            results.put("sizes", kind, size, "pages", found)
        if "idle" in wanted:
            found = _guarded(
                f"{where}: an idle open page",
                lambda: measure.idle(url, store.counters, options.idle_seconds),
            )
            results.put("sizes", kind, size, "idle", found)
        if wanted & {"memory", "traced"}:
            found = _guarded(
                f"{where}: ls, export, purge",
                lambda: measure.memory(
                    url,
                    lambda: store.copy(shape),
                    traced="traced" in wanted,
                    plain="memory" in wanted,
                ),
            )
            results.merge("sizes", kind, size, "memory", found)


def command_workers(options: argparse.Namespace, results: Results) -> None:
    import scale_workers

    with scale_workers.servers(options.redis_fsync) as urls:
        for kind in options.backends:
            if kind not in urls:
                continue
            label = kind if kind != "redis" else f"redis-{options.redis_fsync}"
            found = _guarded(
                f"{NAMES[kind]}: {options.workers} workers",
                lambda kind=kind: scale_workers.run(
                    urls[kind], options.workers, options.rounds, options.seconds
                ),
            )
            results.put("workers", label, found)
        results.put("versions", "workers", _server_versions(urls))
    print(report(results.data))


def _server_versions(urls: dict[str, str]) -> dict[str, str]:
    import psycopg
    import redis

    found = {}
    with psycopg.connect(urls["postgres"].split("?")[0]) as conn:
        found["postgres"] = "PostgreSQL " + str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
    client = redis.Redis.from_url(urls["redis"].split("?")[0])
    found["redis"] = "Redis " + str(client.info("server")["redis_version"])
    client.close()
    return found


def command_report(options: argparse.Namespace, results: Results) -> None:
    data = results.data
    if options.backends:
        data = _only(data, set(options.backends))
    if options.sizes:
        data = _sizes_only(data, set(options.sizes))
    text = report(data)
    print(text)
    if options.write_docs:
        write_docs(text)
        print(f"\nwritten to {DOCS.relative_to(ROOT)}")


def command_cache(options: argparse.Namespace, results: Results) -> None:
    cache = ledgers.Cache(options.cache)
    current = {f"{kind}-{ledgers.code_digest(kind)}" for kind in BACKENDS}
    for name, size in cache.entries():
        stale = name.split("-")[0] in BACKENDS and name not in current
        print(f"{size / 1e9:8.2f} GB  {name}{'  (older code)' if stale else ''}")
        if stale and options.prune:
            shutil.rmtree(cache.root / name)
            print("          removed")


# -- the report ----------------------------------------------------------------------------------


def _label(size: int | str) -> str:
    n = int(size)
    return (
        f"{n // 1_000_000}M"
        if n >= 1_000_000 and n % 1_000_000 == 0
        else (f"{n // 1000}k" if n % 1000 == 0 else str(n))
    )


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.2f} s"
    return f"{int(value // 60)} min {value % 60:.0f} s"


def _bytes(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f} MiB"


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("**holds**" if ok else "**misses**")


def _ratio(small: float | None, large: float | None) -> float | None:
    return large / small if small and large is not None else None


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _growth_pair(sizes: list[int]) -> tuple[int, int] | None:
    if GROWTH[0] in sizes and GROWTH[1] in sizes:
        return GROWTH
    return (sizes[0], sizes[-1]) if len(sizes) > 1 else None


def report(data: dict[str, Any]) -> str:
    """The tables, in Markdown, from one results file."""
    out = [_machine_line(data), ""]
    out += _ledger_table(data)
    out += _listing_table(data)
    out += _page_table(data)
    out += _idle_table(data)
    out += _memory_table(data)
    out += _purge_table(data)
    out += _worker_table(data)
    return "\n".join(out).rstrip() + "\n"


def _machine_line(data: dict[str, Any]) -> str:
    m, code = data.get("machine", {}), data.get("code", {})
    versions = data.get("versions", {})
    servers = versions.get("workers", {})
    parts = [
        f"{m.get('cpus')}-core {m.get('arch')} VM",
        m.get("python", ""),
        f"SQLite {m.get('sqlite')}",
        versions.get("postgres") or servers.get("postgres", "PostgreSQL (not run)"),
        versions.get("redis") or servers.get("redis", "Redis (not run)"),
    ]
    dirty = " with uncommitted changes" if code.get("dirty") else ""
    return (
        f"Machine: {', '.join(parts)}. Code: {code.get('commit')}{dirty} "
        f"(crewai_idempotent digest {code.get('digest')}); last run {m.get('date')}, "
        f"load average then {', '.join(f'{x:.1f}' for x in m.get('load_average', []))}."
    )


def _ledger_table(data: dict[str, Any]) -> list[str]:
    rows = []
    for kind, found in data.get("ledgers", {}).items():
        for label, facts in sorted(found.items(), key=lambda item: item[1]["shape"]["receipts"]):
            rows.append(
                f"| {NAMES[kind]} | {label} | {facts['rows']:,} | "
                f"{_seconds(facts['total_s'])} | {facts['receipts_per_s']:,.0f}/s | "
                f"{facts['bytes'] / 1e6:,.0f} MB |"
            )
    if not rows:
        return []
    return [
        "**Ledgers** (built once, cached; receipts in bulk, the rest through the package)",
        "",
        "| backend | ledger | records | load | receipts | on disk |",
        "|---|---|---:|---:|---:|---:|",
        *rows,
        "",
    ]


def _table(title: str, header: list[str], rows: list[list[str]], right: int = 0) -> list[str]:
    """A Markdown table; the first `right` columns after the first are right-aligned."""
    align = ["---"] + ["---:"] * right + ["---"] * (len(header) - 1 - right)
    return [
        title,
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(align) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


def _listing_table(data: dict[str, Any]) -> list[str]:
    out = []
    for kind, by_size in data.get("sizes", {}).items():
        sizes = sorted(int(s) for s, v in by_size.items() if "listings" in v)
        if not sizes:
            continue
        pair = _growth_pair(sizes)
        target = LISTING_GROWTH[kind]
        rows = []
        tries: set[int] = set()
        for name in measure.LISTINGS:
            cells, walls = [], {}
            for size in sizes:
                figure = by_size[str(size)]["listings"].get(name, {})
                walls[size] = figure.get("wall_s")
                tries.add(len(figure.get("walls_s", [])) or 2)
                rows_read = figure.get("rows")
                read = f" ({rows_read:,} rows)" if rows_read is not None else ""
                code = figure.get("exit")
                failed = f" (exit {code})" if code not in (0, None) else ""
                cells.append(f"{_seconds(walls[size])}{read}{failed}")
            growth = _ratio(walls[pair[0]], walls[pair[1]]) if pair else None
            ok = None if growth is None or pair != GROWTH else growth <= target
            rows.append([f"`{name}`", *cells, _x(growth), _verdict(ok)])
        out += _table(
            f"**Listings, {NAMES[kind]}**: `crewai-idempotent ...` in a fresh process, best of "
            f"{' or '.join(map(str, sorted(tries)))} (rows its scans read); "
            f"target: {_growth_header(GROWTH)} <= {target}x",
            ["command", *(_label(s) for s in sizes), _growth_header(pair), "target"],
            rows,
            len(sizes) + 1,
        )
    return out


def _growth_header(pair: tuple[int, int] | None) -> str:
    return f"{_label(pair[1])} / {_label(pair[0])}" if pair else "growth"


def _page_table(data: dict[str, Any]) -> list[str]:
    out = []
    for kind, by_size in data.get("sizes", {}).items():
        sizes = sorted(int(s) for s, v in by_size.items() if "pages" in v)
        if not sizes:
            continue
        names = list(
            dict.fromkeys(n for s in sizes for n in by_size[str(s)]["pages"] if n != "error")
        )
        rows = []
        for name in names:
            cells = []
            for size in sizes:
                figure = by_size[str(size)]["pages"].get(name, {})
                read = f", {figure['rows']:,} rows" if figure.get("rows") is not None else ""
                status = figure.get("status", [200])
                bad = f" (HTTP {status})" if status != [200] else ""
                cells.append(
                    f"{_seconds(figure.get('best_s'))} (median "
                    f"{_seconds(figure.get('median_s'))}{read}){bad}"
                )
            large = by_size.get(str(GROWTH[1]), {}).get("pages", {}).get(name, {}).get("best_s")
            ok = None if kind == "redis" or large is None else large < PAGE_LIMIT_S
            rows.append([name, *cells, _verdict(ok)])
        target = "no target" if kind == "redis" else f"target < {PAGE_LIMIT_S * 1000:.0f} ms at 1M"
        out += _table(
            f"**Console pages, {NAMES[kind]}**: time in the server (in process), best of 3 "
            f"(median; rows its scans read); {target}",
            ["page", *(_label(s) for s in sizes), "target"],
            rows,
            len(sizes),
        )
    return out


def _idle_table(data: dict[str, Any]) -> list[str]:
    rows = []
    for kind, by_size in data.get("sizes", {}).items():
        for size in sorted(int(s) for s, v in by_size.items() if "idle" in v):
            figure = by_size[str(size)]["idle"]
            if "error" in figure:
                rows.append(f"| {NAMES[kind]} | {_label(size)} | {figure['error']} | | | | |")
                continue
            minute = 60.0 / figure["seconds"]
            server = (
                ", ".join(
                    f"{name} {value * minute:,.0f}" for name, value in figure["server"].items()
                )
                or "-"
            )
            rows_read = figure.get("rows")
            read = "-" if rows_read is None else f"{rows_read * minute:,.0f}"
            table_rows = figure["server"].get("table rows read", 0.0) + figure["server"].get(
                "keys read", 0.0
            )
            ok = None if rows_read is None else rows_read == 0 and table_rows == 0
            heard = figure.get("update_after_write_s")
            rows.append(
                f"| {NAMES[kind]} | {_label(size)} | {read} | {server} | "
                f"{figure['cpu_s'] * minute:.2f} s | "
                f"{_heard(heard, figure.get('update_wait_s', 30.0))} | {_verdict(ok)} |"
            )
    if not rows:
        return []
    return [
        "**An idle open page** (a page and its live-update stream, nothing written), per "
        "minute; then one write",
        "",
        "| backend | ledger | rows read (scans) | the server's counts | console CPU | update "
        "after a write | reads nothing |",
        "|---|---|---:|---|---:|---:|---|",
        *rows,
        "",
    ]


def _heard(heard: float | None, waited: float) -> str:
    return f"not within {_seconds(waited)}" if heard is None else _seconds(heard)


def _memory_table(data: dict[str, Any]) -> list[str]:
    out = []
    for kind, by_size in data.get("sizes", {}).items():
        sizes = sorted(int(s) for s, v in by_size.items() if "memory" in v)
        if not sizes:
            continue
        pair = _growth_pair(sizes)
        rows = []
        for name in measure.STREAMED:
            cells, rss, traced = [], {}, {}
            for size in sizes:
                figure = by_size[str(size)]["memory"].get(name, {})
                rss[size] = figure["maxrss_kib"] * 1024 if figure.get("maxrss_kib") else None
                traced[size] = figure.get("traced_peak_bytes")
                cells.append(
                    f"{_bytes(rss[size])} / {_bytes(traced[size])}, "
                    f"{_seconds(figure.get('wall_s'))}"
                )
            growth = (
                (_ratio(rss[pair[0]], rss[pair[1]]), _ratio(traced[pair[0]], traced[pair[1]]))
                if pair
                else (None, None)
            )
            judged = [g for g in growth if g is not None]
            ok = (
                None
                if kind == "redis" or pair != GROWTH or not judged
                else all(g <= MEMORY_GROWTH for g in judged)
            )
            rows.append([f"`{name}`", *cells, f"{_x(growth[0])}, {_x(growth[1])}", _verdict(ok)])
        target = "no target" if kind == "redis" else f"target {_growth_header(GROWTH)} <= 1.2x"
        out += _table(
            f"**Memory, {NAMES[kind]}**: peak RSS / tracemalloc's peak (a second, traced run), "
            f"and the plain run's time; {target}",
            [
                "command",
                *(_label(s) for s in sizes),
                f"{_growth_header(pair)}: RSS, traced",
                "target",
            ],
            rows,
            len(sizes) + 1,
        )
    return out


def _purge_table(data: dict[str, Any]) -> list[str]:
    rows = []
    for kind, found in data.get("purge", {}).items():
        for size, figure in found.items():
            if "error" in figure:
                rows.append(f"| {NAMES[kind]} | {int(size):,} | {figure['error']} | | | | | |")
                continue
            quiet, during = figure["quiet"], figure["during"]
            ratio = figure.get("p99_ratio")
            ok = (
                None
                if kind == "redis" or ratio is None
                else ratio <= PURGE_P99
                and not (during.get("failed") or figure["purge"].get("exit"))
            )
            rows.append(
                f"| {NAMES[kind]} | {_said(figure['purge'])} | "
                f"{_seconds(figure['purge_s'])} | "
                f"{_ms(quiet['p50_ms'])} / {_ms(quiet['p99_ms'])} ({_claims(quiet)}) | "
                f"{_ms(during['p50_ms'])} / {_ms(during['p99_ms'])} ({_claims(during)}) | "
                f"{_ms(during['max_ms'])} | {_x(ratio)} | {_verdict(ok)} |"
            )
    if not rows:
        return []
    return [
        "**Claims during a purge** (one worker claiming and committing fresh keys; "
        "p50 / p99 latency, claims counted)",
        "",
        "| backend | purge said | purge took | quiet ledger | during the purge | worst | "
        "p99 ratio (<= 2x) | |",
        "|---|---|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
    ]


def _said(run: dict[str, Any]) -> str:
    """What a command printed last, or why it stopped."""
    if run.get("exit") in (0, None):
        return str(run.get("said", ""))
    lines = str(run.get("stderr", "")).strip().splitlines()
    return f"**exit {run['exit']}**: " + (lines[-1][:200] if lines else "")


def _claims(phase: dict[str, Any]) -> str:
    failed = phase.get("failed", 0)
    return f"{phase['claims']:,}" + (f", **{failed} failed**: {phase['error']}" if failed else "")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _worker_table(data: dict[str, Any]) -> list[str]:
    rows = []
    for label, figure in data.get("workers", {}).items():
        if "error" in figure:
            rows.append(f"| {label} | {figure['error']} | | | | | |")
            continue
        kind = label.split("-")[0]
        per = figure["connections"]["ours"]
        conns = ", ".join(f"{name}: {count:g}" for name, count in per.items())
        rows.append(
            f"| {NAMES[kind]}{label[len(kind) :].replace('-', ', appendfsync ')} | "
            f"{figure['workers']} x {figure['rounds']} rounds of {figure['seconds']:g} s | "
            f"{figure['ours_per_s']:,.0f} / {figure['raw_per_s']:,.0f} | {_x(figure['ratio'])} "
            f"({', '.join(f'{r:.2f}' for r in figure['ratios'])}) | "
            f"{_ms(figure['ours_p99_ms'])} / {_ms(figure['raw_p99_ms'])} | {conns} | "
            f"{_verdict(figure['ratio'] >= WORKERS_RATIO)} |"
        )
    if not rows:
        return []
    return [
        "**Many workers on one server**: claims+commits/s, ours (`Ledger.run`) / raw "
        "(the same statements, captured), median of interleaved rounds",
        "",
        "| server | workers | claims/s, ours / raw | ratio (>= 0.8x; each round) | "
        "p99, ours / raw | connections per worker (by name, while ours ran) | |",
        "|---|---|---:|---|---:|---|---|",
        *rows,
        "",
    ]


def _only(data: dict[str, Any], kinds: set[str]) -> dict[str, Any]:
    """The figures of these backends (the many-workers runs by their server's kind)."""
    kept = dict(data)
    for part in ("ledgers", "sizes", "purge", "workers"):
        kept[part] = {k: v for k, v in data.get(part, {}).items() if k.split("-")[0] in kinds}
    kept["versions"] = {k: v for k, v in data.get("versions", {}).items() if k in kinds}
    return kept


def _sizes_only(data: dict[str, Any], sizes: set[int]) -> dict[str, Any]:
    """The figures of ledgers of these sizes (purge ledgers by the receipts they purge)."""
    kept = dict(data)
    kept["sizes"] = {
        kind: {s: v for s, v in found.items() if int(s) in sizes}
        for kind, found in data.get("sizes", {}).items()
    }
    kept["purge"] = {
        kind: {s: v for s, v in found.items() if int(s) in sizes}
        for kind, found in data.get("purge", {}).items()
    }
    kept["ledgers"] = {
        kind: {
            label: facts for label, facts in found.items() if facts["shape"]["receipts"] in sizes
        }
        for kind, found in data.get("ledgers", {}).items()
    }
    return kept


def write_docs(text: str) -> None:
    """Put `text` between the markers of docs/benchmarks.md (after its scale section's
    prose), leaving everything else as it is."""
    docs = DOCS.read_text()
    if BEGIN not in docs:
        raise SystemExit(f"{DOCS} has no {BEGIN} marker: add the section first")
    head, rest = docs.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOCS.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")


# -- the command line ------------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--cache",
        type=Path,
        default=ledgers.DEFAULT_CACHE,
        help="cached ledgers, working copies and results (default %(default)s; "
        "its parents must be reachable by the postgres user)",
    )
    common.add_argument(
        "--results",
        type=Path,
        default=None,
        help="the results file (default: <cache>/results/<code digest>.json)",
    )
    stores = argparse.ArgumentParser(add_help=False)
    stores.add_argument("--backends", nargs="+", choices=BACKENDS, default=["sqlite"])
    stores.add_argument(
        "--sizes",
        nargs="+",
        type=int,
        default=[10_000, 100_000],
        help="receipts per ledger (default: 10000 100000)",
    )
    stores.add_argument("--rebuild", action="store_true", help="build the ledgers again")
    stores.add_argument(
        "--purge-size",
        type=int,
        default=None,
        help="expired receipts of the purge ledger (default: the largest size, at most "
        "1000000, the issue's purge of 1M)",
    )

    load = commands.add_parser("load", parents=[common, stores], help="build the ledgers")
    load.add_argument(
        "--project",
        nargs="*",
        type=int,
        default=[10_000_000],
        help="sizes to project the load's time and disk for",
    )
    run = commands.add_parser("run", parents=[common, stores], help="measure")
    run.add_argument("--measure", nargs="+", choices=MEASURES, default=list(MEASURES))
    run.add_argument("--runs", type=int, default=2, help="runs per listing (best is kept)")
    run.add_argument("--idle-seconds", type=float, default=60.0)
    run.add_argument(
        "--quiet-seconds",
        type=float,
        default=20.0,
        help="how long the worker claims on the quiet ledger before purge starts",
    )
    workers = commands.add_parser("workers", parents=[common], help="32 workers, ours vs raw")
    workers.add_argument(
        "--backends", nargs="+", choices=("postgres", "redis"), default=["postgres", "redis"]
    )
    workers.add_argument("--workers", type=int, default=32)
    workers.add_argument("--rounds", type=int, default=5)
    workers.add_argument("--seconds", type=float, default=10.0)
    workers.add_argument("--redis-fsync", choices=("everysec", "always"), default="everysec")
    report_ = commands.add_parser("report", parents=[common], help="the tables")
    report_.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        default=None,
        help="only these backends' figures (default: all in the results)",
    )
    report_.add_argument(
        "--sizes",
        nargs="+",
        type=int,
        default=None,
        help="only ledgers of these sizes (default: all in the results)",
    )
    report_.add_argument(
        "--write-docs",
        action="store_true",
        help="replace the generated block of docs/benchmarks.md",
    )
    cache = commands.add_parser("cache", parents=[common], help="what the cache holds")
    cache.add_argument("--prune", action="store_true", help="remove ledgers of older code")
    options = parser.parse_args(argv)
    if getattr(options, "sizes", None):
        options.sizes = sorted(set(options.sizes))
        if getattr(options, "purge_size", 0) is None:
            options.purge_size = min(options.sizes[-1], 1_000_000)
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    path = options.results or options.cache / "results" / f"{code_digest()}.json"
    results = Results(path)
    if options.command in ("load", "run", "workers"):
        results.ran()
    {
        "load": command_load,
        "run": command_run,
        "workers": command_workers,
        "report": command_report,
        "cache": command_cache,
    }[options.command](options, results)
    print(f"\nresults: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
