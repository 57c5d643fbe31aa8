"""A crewAI release newer than the newest tested one, inside the supported minor, verifies
itself: the self-test (`_selftest`: every path, every retry source, offline) runs once
per machine in a background interpreter, its verdict is kept in the user cache folder,
and the release is allowed once the verdict says it passed.

What a verdict is about (`Subject`): crewAI's version, this package's version, the Python
(implementation and version), and a digest of the files of crewAI (crewai, crewai_core)
and of this package as they are installed. A verdict's file name carries all four, so a
modified install (a patched file, a reinstall with other contents) has no verdict and
verifies again, while two virtualenvs holding the same installs share one. Hashing the
files costs ~35 ms (8 MB); the digest is kept beside the verdicts by the files' stat
(size, mtime, ctime, inode), so a process pays ~6 ms for the stat walk, and any write
to a file changes its ctime, which no tool can set back.

Concurrency: many processes (Celery prefork, gunicorn workers) meet the first guarded
call at once. Each reads the verdict; without one, each tries `flock(LOCK_EX|LOCK_NB)` on
the subject's lock file. The one that gets it reads the verdict again (a run may have
finished in between) and, still without one, starts the runner (this module's `main`)
with the locked descriptor inherited, then closes its own copy: the lock is the
runner's for as long as it lives, and the kernel drops it when the runner exits or is
killed. The others see the lock taken and refuse. So there is at most one run per
subject at a time, a run killed half way is started again by the next call, and no run
starts once a verdict exists. A guarded call never runs its body before reading a
passing verdict.

The runner writes the verdict (a temporary file renamed over it), a line in
`history.jsonl` (how long runs take on this machine: the refusal says it) and the
self-test's report (`<subject>.log`). The cache folder and the verdict must be this
user's (or root's: a verdict baked into an image) and writable by no one else: a verdict
others could write would let them switch the guard on.

The sections below (where verdicts live, what a verdict is about, the verdicts, running
it once, what a guarded call asks, the runner) are one protocol between the first
guarded call, the runner it starts and `doctor`: each side reads what the others write.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import re
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .._errors import CacheUnusable, UnverifiedCrewAIVersion

log = logging.getLogger("crewai_idempotent")

CACHE_ENV = "CREWAI_IDEMPOTENT_CACHE_DIR"
# What a run took on this machine before any run here says otherwise (28 checks on 1.15.30
# take 10 s on the 2-core test machine, the interpreter and crewAI's import included).
USUAL_SECONDS = 15.0
RUN_TIMEOUT_S = 600.0
# Whose files the digest covers: crewAI (its core package from 1.14.5) and this package.
PACKAGES = ("crewai", "crewai_core", "crewai_idempotent")
_FORMAT = 1
_UNSAFE_BITS = stat.S_IWGRP | stat.S_IWOTH


# -- where verdicts live ----------------------------------------------------------------


def cache_dir() -> Path:
    """CREWAI_IDEMPOTENT_CACHE_DIR, else `self-test/` in the user cache folder
    (`~/.cache/crewai-idempotent/` on Linux, XDG_CACHE_HOME honoured)."""
    given = os.environ.get(CACHE_ENV, "").strip()
    if given:
        return Path(given).expanduser().absolute()
    import platformdirs  # only when a release needs its verdict

    return Path(platformdirs.user_cache_dir("crewai-idempotent")) / "self-test"


def _folder(create: bool) -> Path:
    """The cache folder, checked: this user's, writable by no one else."""
    path = cache_dir()
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise CacheUnusable(
                f"cannot create the cache folder {path}: {exc.strerror or exc}"
            ) from None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CacheUnusable(f"the cache folder {path} does not exist") from None
    except OSError as exc:
        raise CacheUnusable(f"cannot read the cache folder {path}: {exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheUnusable(f"the cache folder {path} is not a folder")
    if st.st_uid not in (os.geteuid(), 0) or st.st_mode & _UNSAFE_BITS:
        raise CacheUnusable(
            f"the cache folder {path} is not this user's alone (owner uid {st.st_uid}, mode "
            f"{stat.filemode(st.st_mode)}): a verdict another user could write is not trusted"
        )
    if create and not os.access(path, os.W_OK):
        raise CacheUnusable(f"the cache folder {path} is not writable")
    return path


def _write_atomically(path: Path, text: str) -> None:
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


# -- what a verdict is about ------------------------------------------------------------


def _files(root: Path) -> list[tuple[str, os.stat_result, str]]:
    """Every file of an installed package, compiled bytecode aside (the interpreter
    writes that itself), sorted by path."""
    found = []
    pending = [("", str(root))]
    while pending:
        prefix, folder = pending.pop()
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            continue
        for entry in entries:
            rel = prefix + entry.name
            if entry.is_dir(follow_symlinks=False):
                if entry.name != "__pycache__":
                    pending.append((rel + "/", entry.path))
            elif not entry.name.endswith((".pyc", ".pyo")):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append((rel, st, entry.path))
    found.sort(key=lambda item: item[0])
    return found


def _stat_digest(files: list[tuple[str, os.stat_result, str]]) -> str:
    h = hashlib.sha256()
    for rel, st, _ in files:
        h.update(
            f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\0"
            f"{st.st_dev}\n".encode("utf-8", "surrogateescape")
        )
    return h.hexdigest()


def _content_digest(files: list[tuple[str, os.stat_result, str]]) -> str:
    h = hashlib.sha256()
    for rel, _, path in files:
        with open(path, "rb") as file:
            content = hashlib.sha256(file.read()).hexdigest()
        h.update(f"{rel}\0{content}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def tree_digest(root: Path) -> str:
    """The digest of every file under `root` by content, taken from the cache when no file
    has changed by its stat since the cache was written."""
    files = _files(root)
    seen = _stat_digest(files)
    entry: Path | None = None
    with contextlib.suppress(CacheUnusable, OSError, ValueError, TypeError, KeyError):
        folder = _folder(create=False)
        name = hashlib.sha256(str(root).encode("utf-8", "surrogateescape")).hexdigest()[:32]
        entry = folder / "trees" / f"{name}.json"
        cached = json.loads(entry.read_text(encoding="utf-8"))
        if cached["root"] == str(root) and cached["stat"] == seen:
            return str(cached["content"])
    content = _content_digest(files)
    if entry is not None and _stat_digest(_files(root)) == seen:  # unchanged while read
        with contextlib.suppress(OSError):
            entry.parent.mkdir(mode=0o700, exist_ok=True)
            _write_atomically(
                entry, json.dumps({"root": str(root), "stat": seen, "content": content})
            )
    return content


def package_root(name: str) -> Path | None:
    """Where an importable package's files are, without importing it."""
    module = sys.modules.get(name)
    locations = list(getattr(module, "__path__", None) or [])
    if not locations:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.submodule_search_locations:
            return None
        locations = list(spec.submodule_search_locations)
    return Path(locations[0]).absolute()


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class Subject:
    """What one verdict covers."""

    crewai: str
    plugin: str
    python: str
    digest: str

    @property
    def name(self) -> str:
        text = f"crewai-{self.crewai}_plugin-{self.plugin}_{self.python}_{self.digest[:16]}"
        return re.sub(r"[^A-Za-z0-9._-]", "_", text)

    def describe(self) -> str:
        return (
            f"crewai {self.crewai}, crewai-idempotent {self.plugin}, {self.python}, "
            f"files {self.digest[:12]}"
        )


def subject(crewai_version: str | None = None) -> Subject:
    """The subject for the installed crewAI and this package, as this interpreter finds
    them. `crewai_version`: what the caller knows it is (the guard: `crewai.__version__`)."""
    parts = []
    for name in PACKAGES:
        root = package_root(name)
        if root is not None:
            parts.append(f"{name}:{tree_digest(root)}")
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    python = f"{sys.implementation.name}-{platform.python_version()}"
    return Subject(
        crewai=crewai_version or _version("crewai"),
        plugin=_version("crewai-idempotent"),
        python=python,
        digest=digest,
    )


# -- verdicts -------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    passed: bool
    checks: int
    failed: tuple[tuple[str, str], ...]  # (check, what went wrong)
    seconds: float
    finished_at: float
    by: str
    path: Path

    def failures(self, limit: int = 3) -> str:
        shown = "; ".join(f"{check}: {detail}" for check, detail in self.failed[:limit])
        more = len(self.failed) - limit
        return shown + (f"; and {more} more" if more > 0 else "")


def verdict_path(of: Subject) -> Path:
    return cache_dir() / f"{of.name}.json"


def report_path(of: Subject) -> Path:
    return cache_dir() / f"{of.name}.log"


def read(of: Subject) -> Verdict | None:
    """The verdict on `of`, if one was written (CacheUnusable if the folder is not safe)."""
    folder = _folder(create=False) if cache_dir().exists() else None
    if folder is None:
        return None
    path = folder / f"{of.name}.json"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CacheUnusable(f"cannot read the verdict {path}: {exc}") from None
    if (
        not stat.S_ISREG(st.st_mode)
        or st.st_uid not in (os.geteuid(), 0)
        or st.st_mode & _UNSAFE_BITS
    ):
        raise CacheUnusable(f"the verdict {path} is not a file only this user can write")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != _FORMAT or doc["subject"] != asdict(of):
            return None  # another format, or a name clash: as if none was written
        return Verdict(
            passed=bool(doc["passed"]),
            checks=int(doc["checks"]),
            failed=tuple((str(c), str(d)) for c, d in doc["failed"]),
            seconds=float(doc["seconds"]),
            finished_at=float(doc["finished_at"]),
            by=str(doc["by"]),
            path=path,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # half a file from another tool: run again rather than trust it


def record(
    of: Subject, results: list[dict[str, Any]], problem: str, seconds: float, by: str
) -> Verdict:
    """Write the verdict on `of` from the self-test's results; `problem`, if any, is why the
    self-test did not produce a full report (then the verdict fails)."""
    folder = _folder(create=True)
    failed = [(str(r["check"]), str(r["detail"])) for r in results if not r["passed"]]
    if problem:
        failed.append(("the self-test", problem))
    verdict = Verdict(
        passed=not failed and bool(results),
        checks=len(results),
        failed=tuple(failed),
        seconds=round(seconds, 1),
        finished_at=time.time(),
        by=by,
        path=folder / f"{of.name}.json",
    )
    doc = {
        "format": _FORMAT,
        "subject": asdict(of),
        "passed": verdict.passed,
        "checks": verdict.checks,
        "failed": [list(f) for f in verdict.failed],
        "seconds": verdict.seconds,
        "finished_at": verdict.finished_at,
        "by": by,
    }
    _write_atomically(verdict.path, json.dumps(doc, indent=2) + "\n")
    line = json.dumps(
        {
            "subject": of.name,
            "passed": verdict.passed,
            "seconds": verdict.seconds,
            "at": verdict.finished_at,
            "by": by,
        }
    )
    with contextlib.suppress(OSError):
        fd = os.open(folder / "history.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (line + "\n").encode())  # one write: lines of concurrent runs stay whole
        finally:
            os.close(fd)
    return verdict


def history() -> list[dict[str, Any]]:
    """Every run recorded on this machine, oldest first."""
    try:
        text = (_folder(create=False) / "history.jsonl").read_text(encoding="utf-8")
    except (CacheUnusable, OSError):
        return []
    runs = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            runs.append(json.loads(line))
    return runs


def usual_seconds() -> float:
    """How long a run takes here: the median of the last runs, else USUAL_SECONDS."""
    took = sorted(float(r["seconds"]) for r in history()[-9:] if "seconds" in r)
    return took[len(took) // 2] if took else USUAL_SECONDS


# -- running it once --------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """A self-test running now, by another process or just started by this one."""

    started_at: float | None
    pid: int | None
    ours: bool


_held: set[int] = set()  # lock descriptors open in this process right now


def _close_held_in_child() -> None:
    # A fork between opening the lock and closing it must not leave the child holding a
    # copy of the runner's lock for as long as the child lives.
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def running(of: Subject) -> Run | None:
    """The run on `of` in progress, if any (without starting one)."""
    try:
        folder = _folder(create=False)
    except CacheUnusable:
        return None
    with _lock_file(folder / f"{of.name}.lock", create=False) as fd:
        if fd is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _run_info(fd)
        return None


@contextlib.contextmanager
def _lock_file(path: Path, create: bool) -> Iterator[int | None]:
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        if create:
            raise
        yield None
        return
    _held.add(fd)
    try:
        yield fd
    finally:
        _held.discard(fd)
        os.close(fd)


def _run_info(fd: int) -> Run:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return Run(float(info["started_at"]), int(info["pid"]), ours=False)
    except (OSError, ValueError, KeyError, TypeError):
        return Run(None, None, ours=False)  # the starter is writing it now


def interpreter() -> str | None:
    """The Python to run the self-test with: this process's, when it is one (uWSGI and
    other embedding hosts report their own binary as sys.executable)."""
    name = Path(sys.executable or "").name.lower()
    return sys.executable if name.startswith(("python", "pypy")) else None


def ensure_running(of: Subject, by: str) -> Verdict | Run:
    """The verdict on `of` if there is one, else the run in progress, started here if no
    process runs it. CacheUnusable, or OSError if the runner cannot be started."""
    folder = _folder(create=True)
    with _lock_file(folder / f"{of.name}.lock", create=True) as fd:
        assert fd is not None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _run_info(fd)
        # Ours now: a run that finished since our last look has left its verdict.
        verdict = read(of)
        if verdict is not None:
            return verdict
        python = interpreter()
        if python is None:
            raise CacheUnusable(
                f"this process's interpreter ({sys.executable}) is not a Python that can run "
                "the self-test"
            )
        command = [
            python,
            "-m",
            "crewai_idempotent.integration._verify",
            "--lock-fd",
            str(fd),
            "--by",
            by,
            json.dumps(asdict(of)),
        ]
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(fd,),
            start_new_session=True,  # not in the caller's process group: a ^C or a
            # worker's restart does not cut the run short
        )
        started = time.time()
        info = json.dumps({"pid": process.pid, "started_at": started, "by": by}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        # Reaped here, so that the finished runner does not linger as a zombie.
        reaper = threading.Thread(target=process.wait, name="crewai-idempotent-reaper", daemon=True)
        reaper.start()
        log.info(
            "crewai-idempotent: self-test of crewai %s started (pid %d); its verdict goes to %s",
            of.crewai,
            process.pid,
            folder / f"{of.name}.json",
        )
        return Run(started, process.pid, ours=True)


# -- what a guarded call asks -----------------------------------------------------------


def _about(seconds: float) -> str:
    return f"about {seconds:.0f} s" if seconds < 90 else f"about {seconds / 60:.0f} min"


class Gate:
    """Asked before every guarded call on a release that has no passing verdict in this
    process yet: raises `UnverifiedCrewAIVersion` (as a Halt inside a kickoff, so the
    kickoff stops with it) until the verdict passes, then calls `done` and lets calls by."""

    def __init__(self, version: str, newest: str, done: Any) -> None:
        self.version = version
        self.newest = newest
        self._done = done
        self._subject: Subject | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._reset_lock)

    def _reset_lock(self) -> None:
        self._lock = threading.Lock()  # a thread holding it did not come along

    def __call__(self) -> None:
        from ._call import halting

        with self._lock:
            state, message = self._look()
            if state == "passed":
                self._done()
                return
        raise halting(UnverifiedCrewAIVersion(message, state))

    def _look(self) -> tuple[str, str]:
        head = (
            f"crewai {self.version} is newer than the newest release crewai-idempotent is "
            f"tested with ({self.newest})"
        )
        refused = "tools flagged idempotent refuse to run (nothing was run)"
        try:
            if self._subject is None:
                self._subject = subject(self.version)
            of = self._subject
            found = read(of) or ensure_running(of, f"the first guarded call (pid {os.getpid()})")
        except (CacheUnusable, OSError) as exc:
            return "unavailable", (
                f"{head}, and its self-test cannot run here: {exc}. Until it has passed, "
                f"{refused}. Set {CACHE_ENV} to a folder only this user can write, or run "
                "`crewai-idempotent doctor --self-test` and, if it passes, set "
                "CREWAI_IDEMPOTENT_ALLOW_UNTESTED=1"
            )
        if isinstance(found, Verdict):
            if found.passed:
                log.info(
                    "crewai-idempotent: crewai %s passed its self-test on this machine (%d "
                    "checks; verdict %s): tools flagged idempotent run",
                    self.version,
                    found.checks,
                    found.path,
                )
                return "passed", ""
            return "failed", (
                f"{head}, and it failed crewai-idempotent's self-test on this machine "
                f"({len(found.failed)} of {found.checks} checks: {found.failures()}), so "
                f"{refused}. The verdict is {found.path}; `crewai-idempotent doctor "
                "--self-test` runs it again. Install a tested crewai to go on"
            )
        since = ""
        if found.started_at is not None:
            since = f", started {max(0.0, time.time() - found.started_at):.0f} s ago"
        return "running", (
            f"{head}: its self-test is running (once per machine{since}; it usually takes "
            f"{_about(usual_seconds())}). Until it has passed, {refused}; call again when it "
            "is done. `crewai-idempotent doctor` shows the verdict"
        )


# -- the runner -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """`python -m crewai_idempotent.integration._verify --lock-fd N --by WHO SUBJECT`: run
    the self-test for SUBJECT and write the verdict, holding the inherited lock N (the
    kernel drops it when this process ends, however it ends)."""
    parser = argparse.ArgumentParser(prog="crewai_idempotent.integration._verify")
    parser.add_argument("--lock-fd", type=int, required=True)
    parser.add_argument("--by", default="crewai-idempotent")
    parser.add_argument("subject")
    args = parser.parse_args(argv)
    expected = Subject(**json.loads(args.subject))
    started = time.monotonic()
    version, results, problem = run_reporting(report_path(expected))
    seconds = time.monotonic() - started
    tested = subject(version if version != "unknown" else None)
    if results and tested != expected:
        # The runner's interpreter finds another crewAI than the process that asked, or
        # the install changed during the run: the results are not about `expected`.
        problem = (
            f"the self-test ran against {tested.describe()}, not against the crewAI of the "
            f"process that asked for it ({expected.describe()})"
        )
    record(expected, results, problem, seconds, args.by)
    return 0


def run_reporting(report: Path) -> tuple[str, list[dict[str, Any]], str]:
    """Run the self-test, writing each check's line to `report` as it finishes."""
    from .offline._selftest_process import run_in_subprocess

    fd = os.open(report, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with open(fd, "w", encoding="utf-8") as out:

        def line(result: dict[str, Any]) -> None:
            verdict = "pass" if result["passed"] else "FAIL"
            out.write(f"{verdict}  {result['check']}: {result['detail']}\n")
            out.flush()

        try:
            version, results, errors = run_in_subprocess(RUN_TIMEOUT_S, on_result=line)
        except subprocess.TimeoutExpired:
            out.write(f"did not finish within {RUN_TIMEOUT_S:.0f} s\n")
            return "unknown", [], f"did not finish within {RUN_TIMEOUT_S:.0f} s"
        if errors:
            out.write(errors + "\n")
        problem = "" if results else f"it did not run: {errors or 'no output'}"
        return version, results, problem


if __name__ == "__main__":
    raise SystemExit(main())
