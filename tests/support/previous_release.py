"""The previous release beside this one, for the rolling-upgrade tests.

During a rolling deployment workers of the previous release and of this one share a
ledger. The previous release is commit 61b49de of this repository (the release before the
listings read through indexes, issue 30). `environment()` installs it once in an
environment of its own, cached outside the checkout and keyed by the commit and the
versions of its dependencies, under a file lock, so that the xdist workers (and concurrent
sessions) build it once and share it; a warm cache costs one stat and one interpreter
start.

This file is also the worker both releases run, in separate processes:

    <previous python> -I tests/support/previous_release.py serve URL --provider FILE
    <this python> -P tests/support/previous_release.py serve URL --provider FILE
        (with PYTHONPATH=the checkout)

`serve` answers one JSON command per line of stdin with one JSON line on stdout (the
commands are `Worker`'s methods); `loop` claims, replays and retries keys of its own until
its stdin closes, printing one JSON line per call. It uses only the public API the two
releases share: `-I` keeps the checkout (PYTHONPATH, the script's folder) out of the
previous release's path, so there it imports the crewai_idempotent installed beside it;
`hello` says which one it imported.

Effects go to the fake provider file of tests/support/faults/provider.py (one JSON line
per effect, appended in one write), where the tests count them.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import os
import secrets
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from click.testing import CliRunner

# The public API both releases have: under the previous release's interpreter these are
# the previous release's.
import crewai_idempotent
from crewai_idempotent import (
    ApprovalRequired,
    Approvals,
    Ledger,
    OutcomeUnknown,
    backend_from_url,
    fingerprint,
)
from crewai_idempotent.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve()
COMMIT = "61b49de"
# What the previous release needs to run a worker on every store. crewai is left out: the
# package imports it only when crewai is imported, which no worker here does.
REQUIREMENTS = (
    "pydantic",
    "rfc8785",
    "click",
    "rich",
    "platformdirs",
    "psycopg[binary]",
    "psycopg-pool",
    "redis",
)
# What of the commit is installed: the package and what its build needs.
SOURCE = (
    "crewai_idempotent",
    "pyproject.toml",
    "README.md",
    "crewai_idempotent_autoload.pth",
    "_crewai_idempotent_autoload.py",
)


# -- the environment -----------------------------------------------------------------------


class Unavailable(Exception):
    """The previous release cannot be installed here; the message says what is missing."""


@dataclass(frozen=True)
class Environment:
    """The previous release, installed: its interpreter, and where its package is."""

    folder: Path
    python: Path
    package: Path

    def worker(self, *args: str) -> list[str]:
        """The command line of a worker of the previous release."""
        return [str(self.python), "-I", str(WORKER), *args]


def current_worker(*args: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a worker of this release (the checkout)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return [sys.executable, "-P", str(WORKER), *args], env


def previous_env() -> dict[str, str]:
    """The environment a previous release's worker runs with: nothing of this checkout."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "crewai-idempotent-tests"


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    if shutil.which("git") is None:
        raise Unavailable(f"git is not installed: the previous release ({COMMIT}) comes from git")
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=120)


def commit() -> str:
    """The previous release's full commit id. Raises `Unavailable` if this clone lacks it."""
    found = _git("rev-parse", "--verify", "--quiet", f"{COMMIT}^{{commit}}")
    if found.returncode != 0:
        raise Unavailable(
            f"the previous release, commit {COMMIT} of this repository, is not in this "
            f"clone's history ({ROOT}): a shallow clone? `git fetch --unshallow` (or clone "
            "with the history) brings it; the rolling-upgrade tests install it beside this "
            "release"
        )
    return found.stdout.decode().strip()


def pins() -> list[str]:
    """The previous release's requirements at the versions this environment has (the ones
    the current release is tested with), so the two differ only in the package; a
    requirement this environment lacks is left to the resolver."""
    pinned = []
    for requirement in REQUIREMENTS:
        name = requirement.partition("[")[0]
        try:
            pinned.append(f"{requirement}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pinned.append(requirement)
    return pinned


def environment() -> Environment:
    """The previous release's environment, built if the cache lacks it. Raises
    `Unavailable` (with what is missing) if it cannot be had."""
    sha = commit()
    requirements = pins()
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    identity = json.dumps({"commit": sha, "requirements": requirements, "python": python})
    digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    folder = root / f"previous-{COMMIT}-{digest}"
    with _locked(root / f"previous-{COMMIT}-{digest}.lock"):
        stamp = folder / "installed.json"
        package = _package_of(folder) if stamp.is_file() and stamp.read_text() == identity else None
        if package is None:
            package = _build(folder, sha, requirements)
            stamp.write_text(identity)  # last: a build cut short is built again
        return Environment(folder, _python(folder), package)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _python(folder: Path) -> Path:
    return folder / "venv" / "bin" / "python"


def _package_of(folder: Path) -> Path | None:
    """Where the environment's interpreter imports crewai_idempotent from: None unless it
    starts and imports the one installed in the environment."""
    if not _python(folder).exists():
        return None
    where = "import crewai_idempotent; print(crewai_idempotent.__file__)"
    done = subprocess.run(
        [str(_python(folder)), "-I", "-c", where],
        capture_output=True, text=True, timeout=120, env=previous_env(),
    )  # fmt: skip
    package = Path(done.stdout.strip()).parent
    if done.returncode != 0 or not package.is_relative_to(folder / "venv"):
        return None
    return package


def _build(folder: Path, sha: str, requirements: list[str]) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    source = folder / "src"
    source.mkdir(parents=True)
    archive = _git("archive", "--format=tar", sha, *SOURCE)
    if archive.returncode != 0:
        raise Unavailable(f"git archive {COMMIT} failed: {archive.stderr.decode()[-2000:]}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(source, filter="data")
    python = str(_python(folder))
    _uv("venv", "--quiet", "--python", sys.executable, str(folder / "venv"))
    _uv("pip", "install", "--quiet", "--python", python, *requirements)
    _uv("pip", "install", "--quiet", "--python", python, "--no-deps", str(source))
    package = _package_of(folder)
    if package is None:
        raise Unavailable(f"the previous release installed in {folder} does not import")
    return package


def _uv(*args: str) -> None:
    """uv (the test extra brings it), from its cache alone if it can, else the registry."""
    command = [sys.executable, "-m", "uv", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    offline = subprocess.run([*command, "--offline"], capture_output=True, text=True, env=env,
                             timeout=600)  # fmt: skip
    if offline.returncode == 0:
        return
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise Unavailable(
            f"installing the previous release ({COMMIT}) failed: uv {' '.join(args)}:\n"
            f"{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )


# -- the worker: what runs in each release's processes -------------------------------------

AMOUNT = 1234
# A receipt of a few JSON types: a replay in the other release must give back an equal one.
EXTRAS = {"items": [1, 2.5, "übermorgen", None, True], "nested": {"a": [{"b": -7}]}}


class Provider:
    """The fake provider's file (tests/support/faults/provider.py's format): one JSON line
    per effect, appended in one write, which lands whole. Not fsynced: nothing here is
    killed, and a ledger of thousands would wait on thousands of syncs."""

    def __init__(self, path: str) -> None:
        self.path = path

    def record(self, kind: str, **fields: Any) -> str:
        receipt = f"{kind[:2]}_{secrets.token_hex(8)}"
        effect = {"kind": kind, "receipt": receipt, "pid": os.getpid(), "at": time.time()}
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, (json.dumps({**effect, **fields}) + "\n").encode())
        finally:
            os.close(fd)
        return receipt

    def kinds(self, key: str) -> list[str]:
        """The kinds of the effects recorded for `key`, in order."""
        mark = json.dumps({"key": key})[1:-1]  # as the line holds it: "key": "..."
        with open(self.path, encoding="utf-8") as lines:
            effects = (json.loads(line) for line in lines if mark in line)
            return [e["kind"] for e in effects if e.get("key") == key]


# How the calls of `Worker.fill` end, in turn.
_FILL = ("committed",) * 13 + ("expiring", "failed") * 2 + ("uncertain", "retried", "retried")


class _Stopped:
    """A clock that never moves: a ledger on it never renews a lease (the keeper's next
    renewal is never due), as a worker frozen mid-call would not, so its claim lapses."""

    def monotonic(self) -> float:
        return 0.0

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Worker:
    """One release's view of a ledger: guarded calls whose bodies charge at the provider,
    approvals, and reads. Each public method is a command of `serve`."""

    def __init__(self, url: str, provider: str, release: str) -> None:
        self.url = url
        self.release = release
        self.provider = Provider(provider)
        self.backend = backend_from_url(url)
        self.ledger = Ledger(self.backend, wait_s=60.0)
        self.approvals = Approvals(self.backend)

    def close(self) -> None:
        self.ledger.close()

    # -- guarded calls ---------------------------------------------------------------------

    def _body(self, key: str, mode: str) -> Callable[[], Any]:
        def body() -> Any:
            first = mode == "fail-first" and "decline" not in self.provider.kinds(key)
            if mode == "fail" or first:
                self.provider.record("decline", key=key, by=self.release)
                raise RuntimeError(f"the provider declined {key}")
            receipt = self.provider.record("charge", key=key, by=self.release)
            if mode == "unknown":
                raise OutcomeUnknown(f"the provider timed out on {key}")
            return {"key": key, "receipt": receipt, "by": self.release, "amount": AMOUNT, **EXTRAS}

        return body

    def run(
        self, key: str, mode: str = "ok", ttl: float | None = None, on_stale: str | None = None
    ) -> dict[str, Any]:
        """One guarded call of `key`; `mode` says what its body does: "ok" charges,
        "fail" declines (raises), "fail-first" declines the first time it runs for the key
        and charges after, "unknown" charges and says the outcome is unknown."""
        options: dict[str, Any] = {"ttl": ttl} if ttl is not None else {}
        if on_stale is not None:
            options["on_stale"] = on_stale
        try:
            outcome = self.ledger.execute(key, self._body(key, mode), **options)
        except Exception as exc:  # noqa: BLE001 - reported: the test judges it
            return {"key": key, "error": _error(exc), "by": self.release}
        return {
            "key": key, "value": outcome.value, "replayed": outcome.replayed,
            "status": outcome.record.status.value, "token": outcome.record.token,
            "by": self.release,
        }  # fmt: skip

    def fill(self, prefix: str, count: int) -> dict[str, list[str]]:
        """`count` guarded calls under `prefix`, of every outcome: mostly committed (a
        tenth with receipts that expire in a second), failed, uncertain, and failed then
        taken over by a retry. Returns the keys by how they ended."""
        ended: dict[str, list[str]] = {"committed": [], "expiring": [], "failed": [],
                                       "uncertain": [], "retried": []}  # fmt: skip
        for n in range(count):
            key = f"{prefix}{n:05d}"
            kind = _FILL[n % len(_FILL)]
            mode = {"failed": "fail", "uncertain": "unknown", "retried": "fail-first"}.get(kind)
            answer = self.run(key, mode or "ok", ttl=1.0 if kind == "expiring" else None)
            if kind == "retried":
                answer = self.run(key, "fail-first")
            wanted_error = kind in ("failed", "uncertain")
            if ("error" in answer) != wanted_error:
                raise AssertionError(f"{kind} call of {key}: {answer}")
            ended[kind].append(key)
        return ended

    def fence(self, keys: list[str]) -> dict[str, str]:
        """Make each key's record need an operator the way it happens: a worker's claim
        lapses while its body runs (it renews no lease: a frozen worker), a retry takes
        the claim over and commits, then the first body finishes and its commit is fenced
        off, so two executions may have happened. Returns what the first worker was told."""
        frozen = Ledger(backend_from_url(self.url), wait_s=60.0, lease_s=1.0, clock=_Stopped())
        running = {key: threading.Event() for key in keys}
        finish = threading.Event()
        told: dict[str, str] = {}

        def held(key: str) -> None:
            def body() -> dict[str, str]:
                running[key].set()
                finish.wait(120)
                return {"key": key, "by": "the frozen worker"}

            try:
                told[key] = repr(frozen.execute(key, body))
            except Exception as exc:  # noqa: BLE001 - the fenced commit raises
                told[key] = _error(exc)

        threads = [threading.Thread(target=held, args=(key,)) for key in keys]
        try:
            for thread in threads:
                thread.start()
            for key, thread in zip(keys, threads, strict=True):
                while not running[key].wait(0.05):
                    if not thread.is_alive():
                        raise AssertionError(f"the frozen worker never ran {key}: {told[key]}")
            for key in keys:  # each waits out the lapsed lease, takes over and commits
                answer = self.run(key, on_stale="retry")
                if answer.get("replayed") is not False:
                    raise AssertionError(f"the retry of {key}: {answer}")
        finally:
            finish.set()
            for thread in threads:
                thread.join(120)
            frozen.close()
        return told

    # -- approvals ---------------------------------------------------------------------

    def ask(self, key: str) -> dict[str, Any]:
        """A guarded call of `key` that needs an approval: the first asks for one (its
        request id is returned), a call after a grant uses it and charges."""
        args = {"amount": AMOUNT, "to": key}
        fp = fingerprint(args)

        def gated() -> Any:
            claim = self.ledger.get(key)  # ours: this body runs under it
            self.approvals.authorize(claim, fp, tool="pay", reason="over the limit", summary=args)
            return self._body(key, "ok")()

        try:
            outcome = self.ledger.execute(key, gated, fingerprint=fp, args=args)
        except ApprovalRequired as exc:
            return {"key": key, "request": exc.request_id}
        except Exception as exc:  # noqa: BLE001 - reported: the test judges it
            return {"key": key, "error": _error(exc)}
        return {"key": key, "value": outcome.value, "replayed": outcome.replayed}

    def decide(self, request: str, approve: bool) -> str:
        """Approve or deny the request; its state after."""
        if approve:
            return self.approvals.approve(request, by="ops", reason="fine").state.value
        return self.approvals.deny(request, by="ops", reason="not this one").state.value

    # -- operators ---------------------------------------------------------------------

    def resolve(self, key: str) -> str:
        """Settle an uncertain record as never having happened; its status after."""
        return self.ledger.resolve(key, absent=True, by="ops", reason="checked").status.value

    def delete(self, key: str) -> bool:
        record = self.backend.get(key)
        return record is not None and self.backend.delete(record)

    def read(self) -> dict[str, Any]:
        """What this release reads from the ledger: every record by `scan` and by `get`,
        and what `ls` and `approvals ls` (run in this process) list."""
        records = {r.key: _summary(r) for r in self.ledger.scan()}
        by_get = {key: _summary(self.ledger.get(key)) for key in records}
        runner = CliRunner()

        def listed(*args: str) -> Any:
            done = runner.invoke(cli, ["--ledger", self.url, *args, "--json"])
            if done.exit_code != 0:
                raise AssertionError(f"{args}: {done.output}")
            return json.loads(done.stdout)

        return {
            "scan": records,
            "get": by_get,
            "ls": [r["key"] for r in listed("ls")],
            "ls_needs_operator": [r["key"] for r in listed("ls", "--needs-operator")],
            "ls_uncertain": [r["key"] for r in listed("ls", "--status", "uncertain")],
            "approvals": {r["id"]: r["state"] for r in listed("approvals", "ls", "--state", "all")},
            "approvals_pending": [r["id"] for r in listed("approvals", "ls")],
        }

    def hello(self) -> dict[str, str]:
        return {"package": str(Path(crewai_idempotent.__file__).parent), "release": self.release}


def _summary(record: Any) -> dict[str, Any] | None:
    if record is None:
        return None
    return {
        "status": record.status.value, "token": record.token, "revision": record.revision,
        "needs_operator": record.needs_operator, "fingerprint": record.fingerprint,
        "result": record.result, "updated_at": record.updated_at,
    }  # fmt: skip


def serve(url: str, provider: str, release: str) -> None:
    """Answer one JSON command a line: {"op": method, ...its arguments}."""
    worker = Worker(url, provider, release)
    print(json.dumps({"ready": worker.hello()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            reply = {"ok": getattr(worker, op)(**command)}
        except Exception as exc:  # noqa: BLE001 - the test fails on it, with the traceback
            reply = {"failed": _error(exc), "traceback": traceback.format_exc()}
        print(json.dumps(reply), flush=True)
    worker.close()


def loop(url: str, provider: str, release: str, tag: str, replay: list[str]) -> None:
    """Claim new keys of `tag`, replay the keys in `replay` and retry keys whose first run
    fails, in turn, until stdin closes: one JSON line per call."""
    worker = Worker(url, provider, release)
    closed = threading.Event()

    def wait_for_eof() -> None:
        for _line in sys.stdin:
            pass
        closed.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    print(json.dumps({"ready": worker.hello()}), flush=True)
    n = 0
    while not closed.is_set():
        key = f"{tag}-{n:05d}"
        calls: list[tuple[str, str]] = [(key, "ok")]
        if n % 3 == 1 and replay:
            calls = [(replay[n % len(replay)], "ok")]
        elif n % 3 == 2:
            calls = [(key, "fail-first"), (key, "fail-first")]
        for target, mode in calls:
            print(json.dumps({"n": n, "mode": mode, **worker.run(target, mode)}), flush=True)
        n += 1
        closed.wait(0.005)  # a worker's pace, not a benchmark: the machine is shared
    worker.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=["serve", "loop"])
    parser.add_argument("url")
    parser.add_argument("--provider", required=True)
    parser.add_argument("--release", required=True)
    parser.add_argument("--tag", default="loop")
    parser.add_argument("--replay", default="[]", help="a JSON list of committed keys")
    args = parser.parse_args(argv)
    if args.mode == "serve":
        serve(args.url, args.provider, args.release)
    else:
        loop(args.url, args.provider, args.release, args.tag, json.loads(args.replay))
    return 0


if __name__ == "__main__":
    sys.exit(main())
