"""`crewai-idempotent doctor`: what an operator needs to know before trusting the ledger.

Reads, never creates: a ledger that does not exist is reported, not made. `--self-test`
runs the integration's own checks (integration/_selftest.py) in a fresh interpreter.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click

from _crewai_idempotent_autoload import autoload_enabled

from .. import Status
from ..backends._url import local_path
from ..integration import default_ledger_path
from ..integration._compat import ALLOW_UNTESTED_ENV, untested_allowed
from ..integration._ledgers import describe_default
from ..integration._patch import is_supported, supported_range
from ..integration._selftest import run_in_subprocess
from ._output import safe
from ._where import Where

_UNSAFE_BITS = stat.S_IWGRP | stat.S_IWOTH


class _Report:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.problems = 0

    def fact(self, name: str, value: str) -> None:
        self.lines.append(f"{name:<12} {value}")

    def problem(self, name: str, value: str) -> None:
        self.problems += 1
        self.fact(name, f"PROBLEM: {value}")


@click.command("doctor")
@click.option(
    "--self-test",
    "self_test",
    is_flag=True,
    help="Run the guard's own checks (every execution path, every retry source) against "
    "the installed crewai, offline with a scripted model, and report pass/fail.",
)
@click.pass_obj
def doctor(where: Where, self_test: bool) -> None:
    """Which ledger is in effect and why, its files and their modes, whether it answers
    and how durable it is, whether this crewai is supported and the integration active.

    Exit status 1 when something needs fixing (or a self-test check fails). Never creates
    a ledger.
    """
    if self_test:
        lines, problems = self_test_report()
        for line in lines:
            click.echo(safe(line))
        if problems:
            click.echo(f"{problems} self-test check(s) failed", err=True)
            sys.exit(1)
        return
    lines, problems = report(where)
    for line in lines:
        click.echo(safe(where.scrub(line)))
    if problems:
        click.echo(f"{problems} problem(s) found", err=True)
        sys.exit(1)


def report(where: Where) -> tuple[list[str], int]:
    out = _Report()
    _ledger_facts(where, out)
    _open_facts(where, out)
    _crewai_facts(out)
    _activation_facts(out)
    return out.lines, out.problems


def _ledger_facts(where: Where, out: _Report) -> None:
    out.fact("ledger", where.label)
    if where.url is None:
        out.fact("source", f"default: {describe_default()}")
        if os.environ.get("CREWAI_STORAGE_DIR"):
            out.fact(
                "", f"CREWAI_STORAGE_DIR={os.environ['CREWAI_STORAGE_DIR']!r} names the folder"
            )
    else:
        out.fact("source", where.source)
    for path, required in _local_files(where, out):
        _mode_facts(path, required, out)


def _local_files(where: Where, out: _Report) -> list[tuple[Path, bool]]:
    """The ledger's files and folders, each with whether it must exist already (the
    others are made on first use)."""
    if where.url is None:
        path: Path | None = default_ledger_path()
        scheme = "sqlite"
    else:
        scheme = urlsplit(where.url).scheme.lower()
        try:
            path = local_path(where.url)
        except ValueError as exc:
            out.problem("url", str(exc))
            return []
    if path is None:
        return []
    if scheme == "sqlite":
        sidecars = [(Path(f"{path}{suffix}"), False) for suffix in ("-wal", "-shm")]
        return [(path.parent, True), (path, True), *sidecars]
    return [(path, True), (path / "records", True), (path / "locks", True), (path / "tmp", False)]


def _mode_facts(path: Path, required: bool, out: _Report) -> None:
    try:
        info = path.lstat()
    except FileNotFoundError:
        if required:
            out.problem("file", f"{path} does not exist")
        return
    except OSError as exc:
        out.problem("file", f"{path}: {exc}")
        return
    mode = stat.S_IMODE(info.st_mode)
    owner = "you" if info.st_uid == os.geteuid() else f"uid {info.st_uid}"
    text = f"{path}  {stat.filemode(info.st_mode)} ({mode:04o}), owner {owner}"
    if stat.S_ISLNK(info.st_mode):
        out.problem("file", f"{text}: a symlink (refused unless allow_insecure_path)")
    elif info.st_mode & _UNSAFE_BITS:
        out.problem("file", f"{text}: writable by group or others")
    else:
        out.fact("file", text)


def _open_facts(where: Where, out: _Report) -> None:
    try:
        ledger = where.ledger()
        counts = {status: 0 for status in Status}
        for record in ledger.records():
            counts[record.status] += 1
    except click.ClickException as exc:
        out.problem("reachable", exc.format_message())
        return
    except Exception as exc:  # noqa: BLE001 - any failure to read is what doctor reports
        out.problem("reachable", f"no: {type(exc).__name__}: {exc}")
        return
    summary = ", ".join(f"{counts[s]} {s.value.lower()}" for s in Status)
    out.fact("reachable", f"yes: {ledger.backend!r}; {summary}")
    if counts[Status.UNCERTAIN]:
        out.fact("", "uncertain records wait for a decision: ls --status uncertain")
    _durability_facts(ledger.backend, out)


def _durability_facts(backend: Any, out: _Report) -> None:
    kind = type(backend).__name__
    if kind == "SQLiteCacheBackend":
        level = getattr(backend, "synchronous", "?")
        note = {
            "FULL": "survives power loss",
            "EXTRA": "survives power loss",
            "NORMAL": "survives a crashed process; the last commits may be lost on power loss",
            "CLAIMS": "claims survive power loss; a commit lost to it leaves an uncertain record",
        }.get(level, "")
        out.fact("durability", f"synchronous={level}: {note}")
    elif kind == "FileLockCacheBackend":
        fsync = getattr(backend, "fsync", None)
        if fsync:
            out.fact("durability", "fsync=true: survives power loss")
        else:
            out.fact("durability", "fsync=false: survives a crashed process, not power loss")
    elif kind == "RedisCacheBackend":
        _redis_durability(backend, out)
    elif kind == "PostgresCacheBackend":
        _postgres_durability(backend, out)
    elif kind == "InMemoryCacheBackend":
        out.problem("durability", "in memory: not durable, not shared (tests only)")


def _redis_durability(backend: Any, out: _Report) -> None:
    # Late: the redis backend module imports the redis client, a fifth of a second of
    # start-up that every other command would pay.
    from ..backends.redis import persistence_problem

    try:
        config: dict[str, str] = {}
        for name in ("appendonly", "appendfsync", "save"):
            config.update(backend.client.config_get(name))
    except Exception as exc:  # noqa: BLE001 - managed Redis often refuses CONFIG
        out.fact("durability", f"unknown: CONFIG GET refused ({type(exc).__name__})")
        return
    problem = persistence_problem(config)
    settings = ", ".join(f"{k}={v}" for k, v in sorted(config.items()))
    if problem:
        out.problem("durability", f"{settings}: {problem}")
    else:
        out.fact("durability", settings)


def _postgres_durability(backend: Any, out: _Report) -> None:
    # Late, as for Redis: the module imports psycopg.
    from ..backends.postgres import durability_problems

    try:
        settings = backend.durability()
    except Exception as exc:  # noqa: BLE001 - reported, as any failure to read
        out.problem("durability", f"cannot read the server's settings: {exc}")
        return
    standbys = int(settings["standbys"])
    shown = [f"{name}={settings[name]}" for name in ("fsync", "synchronous_commit")]
    shown.append(f"full_page_writes={settings['full_page_writes']}")
    if standbys:
        names = settings["synchronous_standby_names"]
        shown.append(f"{standbys} standby(s), synchronous_standby_names={names!r}")
    problems = durability_problems(settings)
    if not problems:
        out.fact("durability", ", ".join(shown) + ": acknowledged commits survive a crash")
        return
    out.fact("durability", ", ".join(shown))
    for setting, risk in problems:
        out.problem("durability", f"{setting}: {risk}")


def _crewai_facts(out: _Report) -> None:
    try:
        installed = version("crewai")
    except PackageNotFoundError:
        out.fact("crewai", f"not installed (the integration supports {supported_range()})")
        return
    if is_supported(installed):
        out.fact("crewai", f"{installed}: supported ({supported_range()})")
    elif untested_allowed():
        out.fact(
            "crewai",
            f"{installed}: untested (the range is {supported_range()}); {ALLOW_UNTESTED_ENV} "
            "is set, so the guard runs in full: `doctor --self-test` checks it",
        )
    else:
        out.problem(
            "crewai",
            f"{installed}: outside the tested range {supported_range()}; tools flagged "
            "idempotent refuse to run. Run `crewai-idempotent doctor --self-test`, and if it "
            f"passes set {ALLOW_UNTESTED_ENV}=1",
        )


def self_test_report() -> tuple[list[str], int]:
    """`doctor --self-test`: the guard's checks run against the installed crewai."""
    started = time.monotonic()
    try:
        version, results, errors = run_in_subprocess()
    except subprocess.TimeoutExpired:
        return ["self-test: did not finish within 600 s"], 1
    lines = [f"crewai {version}: {len(results)} checks (path x retry source [executor])"]
    failed = 0
    for result in results:
        verdict = "pass" if result["passed"] else "FAIL"
        failed += not result["passed"]
        lines.append(f"  {verdict}  {result['check']}: {result['detail']}")
    if not results:
        failed += 1
        lines.append(f"  FAIL  the self-test did not run: {errors or 'no output'}")
    elapsed = time.monotonic() - started
    summary = "passed" if not failed else f"{failed} failed"
    lines.append(f"self-test {summary} in {elapsed:.1f} s")
    return lines, failed


def _activation_facts(out: _Report) -> None:
    pth = [
        Path(entry) / "crewai_idempotent_autoload.pth"
        for entry in sys.path
        if entry and (Path(entry) / "crewai_idempotent_autoload.pth").is_file()
    ]
    if not pth:
        out.problem(
            "activation",
            "the start-up hook (crewai_idempotent_autoload.pth) is not installed in this "
            "environment: only programs that import crewai_idempotent are guarded",
        )
    elif autoload_enabled():
        out.fact("activation", f"on: {pth[0]} activates the integration when crewai is imported")
    else:
        out.fact(
            "activation",
            "start-up hook off (CREWAI_IDEMPOTENT_AUTOLOAD); programs must import "
            "crewai_idempotent, or use IdempotentTool / idempotent_tool, which refuse to run "
            "unguarded",
        )
