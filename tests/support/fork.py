"""Fork scenarios any backend can be put through, with real processes and a fake provider.

Each scenario runs in a fresh interpreter that plays the parent (a Celery master, a
`gunicorn --preload` arbiter, a script building a `multiprocessing` pool): it opens the
ledger named by a URL, uses it, then forks. Nothing here knows which backend it drives;
the tests pass a URL (`sqlite:///…`, `file:///…`, `postgresql://…`, `redis://…`).

    python -m tests.support.fork SCENARIO --url URL --dir DIR [--child inherited|new] …

prints one JSON line: what the parent saw. Children write theirs to files in DIR. Every
effect is a line at the fake provider (`tests.support.faults.provider`), so duplicates are counted
where they happen, not from what the ledger believes.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import json
import multiprocessing
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from crewai_idempotent import IdempotencyError, Ledger, backend_from_url
from tests.support.faults.provider import Provider

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ("concurrent", "parent_closes", "parent_exits", "pool", "owner_killed", "bypass")

# -- the work: charge keys, count what happened ----------------------------------------------


def charge_keys(
    ledger: Ledger, provider: Provider, keys: list[str], pause_s: float = 0.0
) -> dict[str, Any]:
    """Run the guarded charge of every key; report how many ran, replayed or failed."""
    tally: dict[str, Any] = {"ran": 0, "replayed": 0, "errors": []}
    for key in keys:
        try:
            outcome = ledger.execute(key, lambda key=key: provider.charge(key))
        except IdempotencyError as exc:
            tally["errors"].append(f"{key}: {type(exc).__name__}: {exc}")
        else:
            tally["replayed" if outcome.replayed else "ran"] += 1
        if pause_s:
            time.sleep(pause_s)
    return tally


def duplicates(provider: Provider) -> dict[str, int]:
    """Keys the provider charged more than once, with their counts."""
    counts = collections.Counter(effect["key"] for effect in provider.effects())
    return {key: n for key, n in counts.items() if n > 1}


def assert_sound(kind: str, tmp_path: Path, provider: Provider) -> None:
    """No key charged twice, and an SQLite ledger that SQLite itself finds intact."""
    assert duplicates(provider) == {}
    if kind.startswith("sqlite"):
        conn = sqlite3.connect(tmp_path / "ledger.db")
        try:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        finally:
            conn.close()


def run_scenario(
    scenario: str, url: str, folder: Path, timeout: float = 240.0, **options: Any
) -> dict[str, Any]:
    """Run one scenario's parent in a fresh interpreter and return its JSON report."""
    argv = [
        sys.executable,
        "-m",
        "tests.support.fork",
        scenario,
        "--url",
        url,
        "--dir",
        str(folder),
    ]
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    done = subprocess.run(
        argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, (
        f"{scenario} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    )
    report: dict[str, Any] = json.loads(lines[-1])
    report["stderr"] = done.stderr
    return report


def fresh_charges(url: str, provider: Path, keys: list[str], seed: int) -> subprocess.Popen[str]:
    """A process that never saw the parent's ledger (exec, not fork) charging `keys`."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.fork", "fresh", "--url", url,
         "--provider", str(provider), "--keys", ",".join(keys), "--seed", str(seed)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen[str], timeout: float = 240.0) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"fresh worker exited {proc.returncode}\n{out}\n{err}"
    report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return report


# -- children ---------------------------------------------------------------------------------


def _write_json(path: Path, value: Any) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(value), "utf-8")
    os.replace(temp, path)


def _fork(body: Callable[[], Any], report: Path) -> int:
    """Fork a child that runs `body` and writes its result (or error) to `report`."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            result = {"value": body(), "pid": os.getpid()}
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the test
            result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            code = 1
        with contextlib.suppress(BaseException):
            _write_json(report, result)
        os._exit(code)
    return pid


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _child_ledger(mode: str, inherited: Ledger, url: str, **kwargs: Any) -> Ledger:
    if mode == "inherited":
        return inherited
    if mode == "new":
        return Ledger(backend_from_url(url), **kwargs)
    raise ValueError(f"--child must be inherited or new, not {mode!r}")


def _keys(prefix: str, count: int) -> list[str]:
    return [f"{prefix}-{i:03d}" for i in range(count)]


# -- scenarios (each runs in its own interpreter, as the parent) ------------------------------


def concurrent(args: argparse.Namespace) -> dict[str, Any]:
    """The parent uses the ledger, forks, and both charge the same keys at once."""
    provider = Provider(args.provider)
    ledger = Ledger(backend_from_url(args.url), wait_s=60.0)
    warm = charge_keys(ledger, provider, ["warm-up"])
    keys = _keys("both", args.keys)
    report = args.dir / "child.json"
    shuffled = random.Random(1).sample(keys, len(keys))
    child = _fork(
        lambda: charge_keys(_child_ledger(args.child, ledger, args.url, wait_s=60.0),
                            provider, shuffled),
        report,
    )  # fmt: skip
    mine = charge_keys(ledger, provider, keys)
    ledger.close()  # done first: close while the child may still be charging
    inspect_until(args.url, lambda: _exited(child))
    code = _wait(child)
    return {"warm": warm, "parent": mine, "child_exit": code, "child": _read(report)}


def parent_closes(args: argparse.Namespace) -> dict[str, Any]:
    """The parent uses the ledger, forks a worker, then closes its ledger mid-run."""
    provider = Provider(args.provider)
    ledger = Ledger(backend_from_url(args.url), wait_s=60.0)
    warm = charge_keys(ledger, provider, ["warm-up"])
    report = args.dir / "child.json"
    keys = _keys("child", args.keys)
    child = _fork(
        lambda: charge_keys(_child_ledger(args.child, ledger, args.url, wait_s=60.0),
                            provider, keys, pause_s=0.002),
        report,
    )  # fmt: skip
    time.sleep(0.05)
    ledger.close()
    inspect_until(args.url, lambda: _exited(child))
    code = _wait(child)
    return {"warm": warm, "child_exit": code, "child": _read(report)}


def parent_exits(args: argparse.Namespace) -> dict[str, Any]:
    """The parent uses the ledger, forks a worker and exits (the interpreter's own
    clean-up runs) while the worker still charges."""
    provider = Provider(args.provider)
    ledger = Ledger(backend_from_url(args.url), wait_s=60.0)
    warm = charge_keys(ledger, provider, ["warm-up"])
    keys = _keys("child", args.keys)
    report = args.dir / "child.json"

    def work() -> Any:
        os.setsid()  # outlives the parent without a controlling terminal
        time.sleep(0.05)  # let the parent exit first
        return charge_keys(_child_ledger(args.child, ledger, args.url, wait_s=60.0),
                           provider, keys, pause_s=0.002)  # fmt: skip

    child = _fork(work, report)
    return {"warm": warm, "child_pid": child, "report": str(report)}


# The pool's workers use the ledger the parent opened before the pool existed, as a Celery
# task or a gunicorn worker uses one opened at import time.
_POOL_LEDGER: Ledger | None = None
_POOL_PROVIDER: Provider | None = None


def _pool_task(keys: list[str]) -> dict[str, Any]:
    assert _POOL_LEDGER is not None and _POOL_PROVIDER is not None
    # A little slower than the fresh processes, so that they finish (and close) first.
    return charge_keys(_POOL_LEDGER, _POOL_PROVIDER, keys, pause_s=0.003)


def pool(args: argparse.Namespace) -> dict[str, Any]:
    """A fork pool of 4 and 2 fresh processes charge the same keys; the parent used the
    ledger first and closes it while they run."""
    global _POOL_LEDGER, _POOL_PROVIDER
    provider = _POOL_PROVIDER = Provider(args.provider)
    ledger = _POOL_LEDGER = Ledger(backend_from_url(args.url), wait_s=120.0)
    warm = charge_keys(ledger, provider, ["warm-up"])
    keys = _keys("shared", args.keys)
    fresh = [fresh_charges(args.url, args.provider, keys, seed) for seed in (11, 12)]
    orders = [random.Random(seed).sample(keys, len(keys)) for seed in range(4)]
    with multiprocessing.get_context("fork").Pool(4) as workers:
        pending = workers.map_async(_pool_task, orders, chunksize=1)
        time.sleep(0.2)
        ledger.close()  # the parent is done with it; its workers are not
        inspect_until(args.url, pending.ready)
        results = pending.get(timeout=240)
    return {"warm": warm, "pool": results, "fresh": [finish(proc) for proc in fresh]}


def owner_killed(args: argparse.Namespace) -> dict[str, Any]:
    """The owner of a running claim forks a worker that claims keys of its own; the test
    SIGKILLs the owner (pid in the marker file). The worker must not keep the dead
    owner's lease alive."""
    provider = Provider(args.provider)
    ledger = Ledger(backend_from_url(args.url), lease_s=args.lease_s, wait_s=5.0)
    marker = args.dir / "owner.json"
    report = args.dir / "child.json"

    def child_work() -> Any:
        # A claim of its own keeps the worker's lease keeper busy until the test has seen
        # the owner's claim go stale (it creates the release file then; a cap, in case not).
        def slow(key: str) -> str:
            release = args.dir / "release"
            deadline = time.monotonic() + 120
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            return provider.charge(key)

        child_ledger = _child_ledger(args.child, ledger, args.url, lease_s=args.lease_s)
        return child_ledger.run("child-own", lambda: slow("child-own"))

    def body() -> str:
        child = _fork(child_work, report)
        _write_json(marker, {"owner": os.getpid(), "child": child, "at": time.time()})
        signal.pause()  # until SIGKILL
        return "never"

    ledger.run("held", body)
    return {"error": "the owner was not killed"}


def bypass(args: argparse.Namespace) -> dict[str, Any]:
    """A fork that skips os.register_at_fork (libc's fork() called directly, as C
    extensions do): the child must refuse the ledger rather than risk it."""
    provider = Provider(args.provider)
    ledger = Ledger(backend_from_url(args.url))
    warm = charge_keys(ledger, provider, ["warm-up"])
    report = args.dir / "child.json"
    libc = ctypes.CDLL(None, use_errno=True)
    pid = libc.fork()
    if pid == 0:  # pragma: no cover - the child
        result: dict[str, Any] = {}
        for mode in ("inherited", "new"):
            try:
                child_ledger = _child_ledger(mode, ledger, args.url)
                result[mode] = charge_keys(child_ledger, provider, [f"bypass-{mode}"])
            except IdempotencyError as exc:  # refused while opening
                result[mode] = {"errors": [f"{type(exc).__name__}: {exc}"]}
        with contextlib.suppress(BaseException):
            _write_json(report, result)
        os._exit(0)
    code = _wait(pid)
    after = charge_keys(ledger, provider, ["parent-after"])
    return {"warm": warm, "child_exit": code, "child": _read(report), "parent_after": after}


def inspect_until(url: str, done: Callable[[], bool]) -> int:
    """Open the ledger, list it and close it, over and over until `done()`: what any other
    process does meanwhile (`crewai-idempotent ls`, a health check). A close that SQLite
    takes for the last one checkpoints and deletes the WAL."""
    rounds = 0
    while not done():
        other = Ledger(backend_from_url(url))
        other.records()
        other.close()
        rounds += 1
        time.sleep(0.02)
    return rounds


def _exited(pid: int) -> bool:
    """True once the child `pid` has finished (without reaping it)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _read(path: Path) -> Any:
    return json.loads(path.read_text("utf-8")) if path.exists() else None


# -- entry points -----------------------------------------------------------------------------


def wait_for(path: Path, timeout: float) -> Any:
    """Poll for a JSON file written by a child; its content, or AssertionError at `timeout`."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.01)
    return json.loads(path.read_text("utf-8"))


def stale_unwritten(url: str, key: str, hang_s: float = 60.0) -> Any:
    """Wait until `key`'s claim is stale (its owner stopped renewing), and check that it
    was never written meanwhile: whoever renewed it (a child keeping a dead parent's lease
    alive) would show as a growing revision. The record, once stale."""
    ledger = Ledger(backend_from_url(url))
    try:
        first = ledger.get(key)
        assert first is not None
        deadline = time.monotonic() + hang_s  # a guard against a claim kept live, not a bound
        while True:
            record = ledger.get(key)
            assert record is not None and record.revision == first.revision, record
            if ledger.is_stale(record):
                return record
            assert time.monotonic() < deadline, f"{key!r} stayed live: {record}"
            time.sleep(0.02)
    finally:
        ledger.close()


def renewed(url: str, key: str, times: int, hang_s: float = 60.0) -> Any:
    """Wait until `key`'s claim has been renewed `times` more times (live throughout)."""
    ledger = Ledger(backend_from_url(url))
    try:
        deadline = time.monotonic() + hang_s
        first = None
        while True:
            record = ledger.get(key)
            if record is not None:
                first = first or record
                assert not ledger.is_stale(record), record
                if record.revision >= first.revision + times:
                    return record
            assert time.monotonic() < deadline, f"{key!r} was not renewed {times} times"
            time.sleep(0.02)
    finally:
        ledger.close()


@contextlib.contextmanager
def killed_on_exit(*pids: int) -> Iterator[None]:
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _fresh(args: argparse.Namespace) -> dict[str, Any]:
    keys = args.keys.split(",")
    random.Random(args.seed).shuffle(keys)
    ledger = Ledger(backend_from_url(args.url), wait_s=120.0)
    try:
        return charge_keys(ledger, Provider(args.provider), keys)
    finally:
        ledger.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.fork")
    parser.add_argument("scenario", choices=[*SCENARIOS, "fresh"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--provider", type=Path)
    parser.add_argument("--child", default="inherited", choices=["inherited", "new"])
    parser.add_argument("--keys", default="100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lease-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    if args.scenario == "fresh":
        print(json.dumps(_fresh(args)), flush=True)
        return 0
    args.keys = int(args.keys)
    if args.provider is None:
        args.provider = args.dir / "effects.jsonl"
    print(json.dumps(globals()[args.scenario](args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
