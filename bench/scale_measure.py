"""What the people's side costs on one ledger: the measurements bench/scale.py runs.

Each function takes the URL of a working copy and returns plain figures (JSON-ready):

- `listings`: each listing command as a person runs it (`bench/scale_cli.py` in a fresh
  interpreter, wall time from the outside, best of `runs`), with the rows its scans read;
- `memory`: peak RSS of `ls`, `export` and `purge` (a plain run) and tracemalloc's peak
  (a second, traced run); `purge` deletes, so its two runs need two copies (`memory`
  takes a `copy` to make the second);
- `pages`: each console page's time in the server (Starlette's TestClient, in process),
  and the rows the store's scans read for it;
- `idle`: one open page (a page and its `/events` stream, on uvicorn in a thread) over
  `seconds` while nothing is written: rows the store's scans read, the server's own
  counters (statements and table rows on PostgreSQL, commands on Redis), this process's
  CPU; then one write, and how long the page took to hear of it;
- `claims_during_purge`: a worker process claiming and committing fresh keys on a quiet
  ledger, then while `crewai-idempotent purge` runs: the claims' latency percentiles.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from crewai_idempotent import Approvals, Ledger, backend_from_url  # noqa: E402

CLI = Path(__file__).resolve().parent / "scale_cli.py"
CLAIMER = Path(__file__).resolve().parent / "scale_claimer.py"

#: The listing commands a person or a watcher repeats: name -> arguments.
LISTINGS = {
    "approvals ls": ["approvals", "ls"],
    "ls --needs-operator": ["ls", "--needs-operator"],
    "ls --status uncertain": ["ls", "--status", "uncertain"],
    "doctor": ["doctor"],
    "spend": ["spend"],
    "reconcile --dry-run": ["reconcile", "--dry-run"],
    "notifications ls": ["notifications", "ls"],
}
#: The commands whose memory must not grow with the ledger.
STREAMED = {"ls": ["ls"], "export": ["export"], "purge": ["purge"]}
ACCOUNT = "bench@example.com"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("CREWAI_IDEMPOTENCY_URL", None)
    env.setdefault("COLUMNS", "160")
    return env


def run_cli(
    url: str,
    args: list[str],
    *,
    trace: bool = False,
    keep_output: bool = True,
    timeout: float = 24 * 3600,
) -> dict[str, Any]:
    """One command in a fresh interpreter: wall time, what it reported, what it printed
    (line count and last line; with `keep_output=False` the output goes to /dev/null)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        report = Path(handle.name)
    argv = [
        sys.executable,
        str(CLI),
        str(report),
        *(["--trace"] if trace else []),
        "--",
        "--ledger",
        url,
        *args,
    ]
    began = time.perf_counter()
    done = subprocess.run(
        argv,
        env=_env(),
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if keep_output else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wall = time.perf_counter() - began
    try:
        figures = json.loads(report.read_text())
    except (OSError, ValueError):
        figures = {"exit": done.returncode, "error": done.stderr.decode(errors="replace")[-2000:]}
    finally:
        report.unlink(missing_ok=True)
    figures["wall_s"] = wall
    if keep_output:
        lines = done.stdout.decode(errors="replace").splitlines()
        figures["lines"] = len(lines)
        figures["said"] = (lines[-1] if lines else "")[:160]
    if done.returncode != 0 or "error" in figures:
        figures["stderr"] = done.stderr.decode(errors="replace")[-1000:]
    return figures


def listings(url: str, runs: int = 2, names: list[str] | None = None) -> dict[str, Any]:
    """Each listing command, best of `runs` by wall time."""
    found: dict[str, Any] = {}
    for name, args in LISTINGS.items():
        if names and name not in names:
            continue
        tries = [run_cli(url, args) for _ in range(runs)]
        best = min(tries, key=lambda t: t["wall_s"])
        best["walls_s"] = [t["wall_s"] for t in tries]
        found[name] = best
    return found


def memory(
    url: str,
    copy: Callable[[], contextlib.AbstractContextManager[str]] | None,
    *,
    plain: bool = True,
    traced: bool = True,
) -> dict[str, Any]:
    """`ls`, `export` (output to /dev/null) and `purge`: a plain run (time, peak RSS) and a
    traced one (tracemalloc's peak). `purge` deletes: its plain run comes last on `url`,
    and its traced run needs a fresh copy (`copy()`; skipped without one)."""
    found: dict[str, Any] = {}
    for name, args in STREAMED.items():
        figures: dict[str, Any] = {}
        if plain and name != "purge":
            figures |= run_cli(url, args, keep_output=False)
        if traced and (name != "purge" or copy is not None):
            if name == "purge" and copy is not None:
                with copy() as again:
                    once = run_cli(again, args, trace=True)
            else:
                once = run_cli(url, args, keep_output=False, trace=True)
            figures |= {
                "traced_peak_bytes": once.get("traced_peak_bytes"),
                "traced_wall_s": once["wall_s"],
            }
            if not plain:
                figures |= {k: v for k, v in once.items() if k in ("exit", "rows", "said")}
        found[name] = figures
    if plain:  # last: it deletes
        once = run_cli(url, STREAMED["purge"])
        once.pop("traced_peak_bytes", None)  # the traced run's, if any, stays
        found["purge"] |= once
    return found


# -- the console -------------------------------------------------------------------------------


def _console_app(backend: Any, refresh_s: float = 2.0) -> Any:
    from crewai_idempotent.console import Accounts, ConsoleSettings, create_app

    with contextlib.suppress(Exception):  # there already, from an earlier measurement
        Accounts(backend).add(ACCOUNT, "operator", None)
    settings = ConsoleSettings(auth="proxy", trusted_proxies=("127.0.0.1",), refresh_s=refresh_s)
    return create_app(backend, settings)


def _rows(backend: Any) -> int | None:
    stats = getattr(backend, "scan_stats", None)
    return stats().rows if stats is not None else None


def page_paths(backend: Any, receipt: str) -> dict[str, str]:
    """The pages a person opens: the lists, one pending request, one receipt."""
    first = next(iter(Approvals(backend).select("pending", limit=1)), None)
    paths = {
        "approvals": "/approvals",
        "uncertain": "/uncertain",
        "records": "/records",
        "record": f"/record?key={receipt}",
        "spend": "/spend",
        "notifications": "/notifications",
    }
    if first is not None:
        paths["approval"] = f"/approvals/{first.id}"
    return paths


def pages(url: str, receipt: str, runs: int = 3) -> dict[str, Any]:
    """Each page's time in the server, best and median of `runs` after one warm-up, and
    the rows the store's scans read for one request."""
    from starlette.testclient import TestClient

    backend = backend_from_url(url)
    found: dict[str, Any] = {}
    try:
        app = _console_app(backend)
        headers = {"x-forwarded-email": ACCOUNT}
        with TestClient(app, base_url="http://127.0.0.1", client=("127.0.0.1", 50000)) as client:
            client.get("/approvals", headers=headers)  # the session, the templates
            for name, path in page_paths(backend, receipt).items():
                times, statuses, rows = [], set(), []
                for _ in range(runs):
                    before = _rows(backend)
                    began = time.perf_counter()
                    answer = client.get(path, headers=headers)
                    times.append(time.perf_counter() - began)
                    after = _rows(backend)
                    statuses.add(answer.status_code)
                    if before is not None and after is not None:
                        rows.append(after - before)
                found[name] = {
                    "path": path,
                    "best_s": min(times),
                    "median_s": statistics.median(times),
                    "status": sorted(statuses),
                    "bytes": len(answer.content),
                    "rows": min(rows) if rows else None,
                }
    finally:
        backend.close()
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Served:
    """The console on uvicorn in a thread of this process, so its store's `scan_stats()`
    can be read here."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = _free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _Served:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the console did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class _Stream:
    """A page's `/events` stream, read on a thread: the lines and when each came."""

    def __init__(self, base: str, headers: dict[str, str], cookies: Any) -> None:
        import httpx

        self.client = httpx.Client(
            base_url=base, headers=headers, cookies=cookies, timeout=httpx.Timeout(5.0, read=None)
        )
        self.lines: list[tuple[float, str]] = []
        self.opened = threading.Event()
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with self.client.stream("GET", "/events") as answer:
                for line in answer.iter_lines():
                    self.lines.append((time.monotonic(), line))
                    self.opened.set()
        except BaseException as exc:  # noqa: BLE001 - the caller says it
            self.failed = exc
            self.opened.set()

    def changes_since(self, at: float) -> list[float]:
        return [when for when, line in self.lines if when >= at and line == "event: changed"]

    def close(self) -> None:
        self.client.close()


def idle(
    url: str,
    counters: Callable[[str], dict[str, float]],
    seconds: float = 60.0,
    refresh_s: float = 2.0,
    update_wait_s: float = 600.0,
) -> dict[str, Any]:
    """One open page over `seconds` while nothing is written, then one write, and how
    long until the page hears of it (None: not within `update_wait_s`)."""
    import httpx

    backend = backend_from_url(url)
    found: dict[str, Any] = {"seconds": seconds, "refresh_s": refresh_s}
    try:
        app = _console_app(backend, refresh_s)
        with _Served(app) as served:
            base = f"http://127.0.0.1:{served.port}"
            headers = {"x-forwarded-email": ACCOUNT}
            page = httpx.get(base + "/approvals", headers=headers, timeout=600)
            stream = _Stream(base, headers, page.cookies)
            try:
                if not stream.opened.wait(600) or stream.failed is not None:
                    raise RuntimeError(f"the page's event stream did not open: {stream.failed}")
                time.sleep(2 * refresh_s + 1)  # the watcher's first reads are the page's
                before = (_rows(backend), counters(url), time.process_time(), time.monotonic())
                time.sleep(seconds)
                after = (_rows(backend), counters(url), time.process_time(), time.monotonic())
                found |= {
                    "rows": None if before[0] is None or after[0] is None else after[0] - before[0],
                    "server": {
                        name: after[1][name] - before[1].get(name, 0.0) for name in after[1]
                    },
                    "cpu_s": after[2] - before[2],
                    "changed_events": len(stream.changes_since(before[3])),
                }
                written = time.monotonic()
                writer = Ledger(backend_from_url(url))
                writer.run(f"bench-idle:{os.getpid()}:{int(time.time())}", lambda: "done")
                writer.close()
                heard = None
                deadline = written + update_wait_s
                while heard is None and time.monotonic() < deadline:
                    arrived = stream.changes_since(written)
                    heard = arrived[0] - written if arrived else None
                    time.sleep(0.05)
                found["update_after_write_s"] = heard
                found["update_wait_s"] = update_wait_s
            finally:
                stream.close()
    finally:
        backend.close()
    return found


# -- claims while purge runs -------------------------------------------------------------------


def _percentiles(claims: list[tuple[float, str]]) -> dict[str, Any]:
    """Latency percentiles of claims (failed ones included, at the time they took to
    fail), how many failed, and the first failure's error."""
    failed = [error for _lat, error in claims if error]
    found: dict[str, Any] = {
        "claims": len(claims),
        "failed": len(failed),
        "error": failed[0] if failed else None,
    }
    if not claims:
        return found | {"p50_ms": None, "p99_ms": None, "max_ms": None}
    ordered = sorted(lat for lat, _error in claims)

    def at(share: float) -> float:
        return ordered[min(len(ordered) - 1, int(share * len(ordered)))] * 1000

    return found | {"p50_ms": at(0.50), "p99_ms": at(0.99), "max_ms": ordered[-1] * 1000}


def claims_during_purge(url: str, quiet_s: float = 20.0) -> dict[str, Any]:
    """A worker claims and commits fresh keys (`bench/scale_claimer.py`, the store's
    default durability) for `quiet_s`, then while `crewai-idempotent purge` runs; the
    claims' latency percentiles in each phase, and the purge's own figures."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = Path(handle.name)
    claimer = subprocess.Popen(
        [sys.executable, str(CLAIMER), url, str(out)],
        env=_env(),
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert claimer.stdout is not None
        if claimer.stdout.readline().strip() != b"ready":
            raise RuntimeError("the claiming worker did not start")
        began = time.time()
        time.sleep(quiet_s)
        purge_at = time.time()
        purged = run_cli(url, ["purge"])
        purge_end = time.time()
        time.sleep(1.0)
    finally:
        claimer.send_signal(signal.SIGTERM)
        claimer.wait(120)
    try:
        stamps = json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
    quiet = [(lat, error) for at, lat, error in stamps if began + 1.0 <= at < purge_at]
    during = [(lat, error) for at, lat, error in stamps if purge_at <= at < purge_end]
    result = {
        "quiet": _percentiles(quiet),
        "during": _percentiles(during),
        "purge": purged,
        "purge_s": purge_end - purge_at,
    }
    q, d = result["quiet"]["p99_ms"], result["during"]["p99_ms"]
    result["p99_ratio"] = d / q if q and d else None
    return result
