"""`crewai-idempotent doctor`: what an operator needs to know before trusting the ledger.

Reads, never creates: a ledger that does not exist is reported, not made. `--self-test`
runs the integration's own checks (integration/offline/_selftest.py) in a fresh interpreter,
showing each check as it finishes, and keeps the verdict for a release newer than the
newest tested one (integration/_verify.py), as that release's first guarded call would.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click

from _crewai_idempotent_autoload import autoload_enabled

from .. import Ledger, Status
from .._errors import SigningConfigurationError
from .._units import ago
from ..backends._url import local_path
from ..integration import _verify, default_ledger_path
from ..integration._compat import ALLOW_UNTESTED_ENV, untested_choice
from ..integration._ledgers import describe_default
from ..integration._patch import is_supported, is_tested, newest_tested, supported_range
from ..integration.offline._selftest_process import run_in_subprocess
from ..ledger._backend import url_of
from ..ledger._select import Select
from ._keys import SIGNING_KEY_ENV
from ._ledger import is_stale
from ._output import console, safe, stamp
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
        problems = self_test_report()
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
    _signing_facts(out)
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
    files = _local_files(where, out)
    for path, required in files:
        _mode_facts(path, required, out)
    if files:
        _filesystem_facts(files[0][0], out)


def _filesystem_facts(path: Path, out: _Report) -> None:
    """A ledger on a read-only filesystem cannot claim anything: say so in those words,
    for the nearest folder that exists (the ledger's, or the one it would be made in)."""
    folder = path if path.is_dir() else path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        info = os.statvfs(folder)
    except OSError:
        return
    if info.f_flag & os.ST_RDONLY:
        out.problem(
            "filesystem",
            f"{folder} is on a read-only filesystem: the ledger cannot be written there, so "
            "no call can be claimed (LedgerUnavailable; nothing runs). Mount it read-write, "
            "or name a ledger on a writable one",
        )


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
    made = [(path / "tmp", False), (path / "documents", False)]
    return [(path, True), (path / "records", True), (path / "locks", True), *made]


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
        found = _open_records(ledger)
    except click.ClickException as exc:
        out.problem("reachable", exc.format_message())
        return
    except Exception as exc:  # noqa: BLE001 - any failure to read is what doctor reports
        out.problem("reachable", f"no: {type(exc).__name__}: {exc}")
        return
    # Only what needs a person or a sweeper is counted: a count of the committed (or
    # failed) records would read every one of them, and they grow with every call.
    pending, stale, uncertain, flagged = found
    summary = (
        f"{pending} pending ({stale} stale), {uncertain} uncertain, "
        f"{flagged} flagged for an operator"
    )
    out.fact("reachable", f"yes: {url_of(ledger.backend)}; {summary}")
    for count, what, args in (
        (uncertain, "uncertain records wait for a decision", ("ls", "--status", "uncertain")),
        (stale, "stale claims wait for a sweeper or a decision", ("ls", "--stale")),
        (flagged, "two executions may have happened", ("ls", "--needs-operator")),
    ):
        if count:
            out.fact("", f"{what}: {where.command(*args)}")
    _index_facts(ledger.backend, where, out)
    _outbox_facts(ledger, out)
    _durability_facts(ledger.backend, out)


def _open_records(ledger: Ledger) -> tuple[int, int, int, int]:
    """PENDING records (and how many of them are stale), UNCERTAIN ones, and those flagged
    for an operator: each read by its own select, so doctor reads what it reports."""
    now = ledger.backend.now()
    pending = stale = 0
    for record in ledger.select(Select(status=Status.PENDING)):
        pending += 1
        stale += is_stale(ledger, record, now)
    uncertain = sum(1 for _ in ledger.select(Select(status=Status.UNCERTAIN)))
    flagged = sum(1 for _ in ledger.select(Select(needs_operator=True)))
    return pending, stale, uncertain, flagged


def _index_facts(backend: Any, where: Where, out: _Report) -> None:
    """Whether the store's listings read from its indexes yet: a ledger made by an earlier
    version gets them when this one opens it, and until they are built a listing answers
    by reading more. A store that cannot say is left unsaid."""
    ready = getattr(backend, "indexes_ready", None)
    if not callable(ready):
        return
    try:
        built = ready()
    except Exception as exc:  # noqa: BLE001 - reported, never a crash of doctor
        out.fact("indexes", f"cannot tell: {type(exc).__name__}: {exc}")
        return
    if built:
        out.fact("indexes", "ready: listings read only what they show")
    else:
        out.fact(
            "indexes",
            "not built yet (this version builds them on the ledger an earlier one made): "
            "listings answer right meanwhile, reading more of the ledger; "
            f"{where.command('build-indexes')} builds them now and waits",
        )


def _outbox_facts(ledger: Any, out: _Report) -> None:
    """What the outbox holds for a person and has not delivered (notifications.md)."""
    from ..notifications._outbox import Outbox

    try:
        # `Entry.undelivered`: what `notify` and `notifications ls --state pending` count.
        waiting = Outbox(ledger.backend).undelivered()
    except Exception as exc:  # noqa: BLE001 - reported, never a crash of doctor
        out.problem("outbox", f"cannot be read: {type(exc).__name__}: {exc}")
        return
    if not waiting:
        out.fact("outbox", "nothing waits for delivery")
        return
    oldest = ago(ledger.backend.now() - min(e.at for e in waiting))
    failing = sum(1 for e in waiting if e.failing)
    out.fact(
        "outbox",
        f"{len(waiting)} notification(s) not yet delivered, the oldest written {oldest}"
        + (f", {failing} failing" if failing else "")
        + ": notifications ls --state pending (is a dispatcher running? notify --watch)",
    )


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


_TRUSTED_ENV = "CREWAI_IDEMPOTENCY_TRUSTED_KEYS"  # signing.ENV, without loading signing
_UNSIGNED_UNTIL_ENV = "CREWAI_IDEMPOTENCY_ACCEPT_UNSIGNED_GRANTS_UNTIL"


def _signing_facts(out: _Report) -> None:
    """Whether decisions are signed, as this environment tells a worker: the trusted keys
    (how many, whose, for what, from where), the transition for unsigned grants, and the
    signing key a decision made here would use. A worker given trusted keys by
    configure() is not seen here."""
    from ..signing._keyfile import Signer
    from ..signing._trusted import TrustedKeys

    try:
        trusted = TrustedKeys.from_env()
    except SigningConfigurationError as exc:
        out.problem("signing", f"{exc} (a worker with this environment refuses to start)")
        return
    if trusted is None:
        out.fact(
            "signing",
            f"decisions are unsigned: ${_TRUSTED_ENV} is not set (nor, as far as this "
            "command can tell, configure(trusted_keys=...)): whoever can write the ledger "
            "can approve, pass the two-person rule and resolve uncertain outcomes "
            "(docs/security.md)",
        )
    else:
        keys = list(trusted)
        out.fact(
            "signing",
            f"decisions are signed: {len(keys)} trusted key(s) from ${_TRUSTED_ENV} "
            f"({trusted.path}); workers obey only approvals and resolutions they verify",
        )
        by_identity: dict[str, list[Any]] = {}
        for key in keys:
            by_identity.setdefault(key.identity, []).append(key)
        for identity, held in sorted(by_identity.items()):
            roles = sorted({role for key in held for role in key.roles})
            kinds = ", ".join(sorted({key.algorithm for key in held}))
            out.fact("", f"{identity}: {len(held)} key(s) ({kinds}), roles {', '.join(roles)}")
        approvers = trusted.identities("approve")
        if len(approvers) < 2:
            out.fact(
                "",
                f"{len(approvers)} identity may approve: a tool with approvers=2 (the "
                "two-person rule) can never be approved",
            )
    until = os.environ.get(_UNSIGNED_UNTIL_ENV, "").strip()
    if until:
        out.fact(
            "signing",
            f"${_UNSIGNED_UNTIL_ENV}={until}: approvals made without a signature still count "
            "until then",
        )
    key_file = os.environ.get(SIGNING_KEY_ENV, "").strip()
    if key_file:
        try:
            signer = Signer.from_file(key_file)
        except SigningConfigurationError as exc:
            out.problem("signing key", f"${SIGNING_KEY_ENV}: {exc}")
            return
        named = f"${SIGNING_KEY_ENV}: {signer.identity} (key {signer.key_id})"
        known = None if trusted is None else trusted.get(signer.key_id)
        if trusted is None:
            out.fact("signing key", f"{named} signs the decisions made here")
        elif known is None:
            out.problem(
                "signing key",
                f"{named} is not among the trusted keys: workers would refuse what it signs",
            )
        else:
            out.fact("signing key", f"{named}, trusted for {', '.join(sorted(known.roles))}")


def _crewai_facts(out: _Report) -> None:
    try:
        installed = version("crewai")
    except PackageNotFoundError:
        out.fact("crewai", f"not installed (the integration supports {supported_range()})")
        return
    choice = untested_choice()
    newer = f"{installed}: newer than the newest tested release ({newest_tested()})"
    if is_tested(installed):
        out.fact(
            "crewai",
            f"{installed}: supported and tested ({supported_range()}, every release up to "
            f"{newest_tested()} tested)",
        )
    elif choice is True:
        out.fact(
            "crewai",
            f"{installed}: untested (the range is {supported_range()}, tested up to "
            f"{newest_tested()}); {ALLOW_UNTESTED_ENV}=1, so the guard runs in full without "
            "a verdict: `doctor --self-test` checks it",
        )
    elif is_supported(installed) and choice is None:
        out.fact("crewai", f"{newer}; it verifies itself on this machine")
        _verdict_facts(installed, out)
    elif is_supported(installed):
        out.problem(
            "crewai",
            f"{newer}; {ALLOW_UNTESTED_ENV}={os.environ.get(ALLOW_UNTESTED_ENV, '').strip()!r} "
            "turns its self-test off, so tools flagged idempotent refuse to run",
        )
    else:
        out.problem(
            "crewai",
            f"{installed}: outside the supported range {supported_range()}; tools flagged "
            "idempotent refuse to run. Run `crewai-idempotent doctor --self-test`, and if it "
            f"passes set {ALLOW_UNTESTED_ENV}=1",
        )


def _verdict_facts(installed: str, out: _Report) -> None:
    """The self-test's verdict on this install of a release newer than the newest tested."""
    try:
        subject = _verify.subject(installed)
        verdict = _verify.read(subject)
        run = _verify.running(subject) if verdict is None else None
    except _verify.CacheUnusable as exc:
        out.problem("self-test", f"no verdict can be kept: {exc}")
        return
    where = _verify.verdict_path(subject)
    if verdict is None and run is not None:
        since = "" if run.started_at is None else f" since {stamp(run.started_at)}"
        out.fact(
            "self-test",
            f"running{since} (pid {run.pid}); tools flagged idempotent refuse until it passes",
        )
    elif verdict is None:
        out.fact(
            "self-test",
            f"not run for this install yet: the first guarded call starts it (about "
            f"{_verify.usual_seconds():.0f} s), or run `crewai-idempotent doctor --self-test`; "
            "tools flagged idempotent refuse until it passes",
        )
    elif verdict.passed:
        out.fact(
            "self-test",
            f"passed: {verdict.checks} checks in {verdict.seconds:.1f} s, "
            f"{stamp(verdict.finished_at)} ({ago(time.time() - verdict.finished_at)}), "
            f"by {verdict.by}: tools flagged idempotent run",
        )
    else:
        out.problem(
            "self-test",
            f"failed {len(verdict.failed)} of {verdict.checks} checks "
            f"({stamp(verdict.finished_at)}, by {verdict.by}): {verdict.failures()}. Tools "
            "flagged idempotent refuse to run; `doctor --self-test` runs it again",
        )
    out.fact("verdict", f"{where} ({subject.describe()})")
    if verdict is not None or run is not None:
        out.fact("", f"the self-test's report: {_verify.report_path(subject)}")


def self_test_report() -> int:
    """`doctor --self-test`: the guard's checks run against the installed crewai, each
    printed as it finishes (with a progress bar on a terminal); the number that failed."""
    screen = console()
    if screen.is_terminal:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=screen,
            transient=True,
        )
        with progress:
            task = progress.add_task("starting (importing crewai)", total=None)

            def say(line: str) -> None:
                progress.console.print(safe(line), soft_wrap=True)

            def planned(count: int) -> None:
                progress.update(task, description="checks", total=count)

            def advanced() -> None:
                progress.advance(task)

            return _self_test(say, planned, advanced)
    return _self_test(lambda line: click.echo(safe(line)), lambda count: None, lambda: None)


def _self_test(
    say: Callable[[str], None], planned: Callable[[int], None], advanced: Callable[[], None]
) -> int:
    started = time.monotonic()

    def on_plan(version: str, labels: list[str]) -> None:
        say(f"crewai {version}: {len(labels)} checks (path x retry source [executor])")
        planned(len(labels))

    def on_result(result: dict[str, Any]) -> None:
        verdict = "pass" if result["passed"] else "FAIL"
        say(f"  {verdict}  {result['check']}: {result['detail']}")
        advanced()

    try:
        version, results, errors = run_in_subprocess(on_plan=on_plan, on_result=on_result)
    except subprocess.TimeoutExpired:
        say("self-test: did not finish within 600 s")
        return 1
    failed = sum(not r["passed"] for r in results)
    problem = ""
    if not results:
        problem = f"it did not run: {errors or 'no output'}"
        say(f"  FAIL  the self-test did not run: {errors or 'no output'}")
        failed += 1
    elapsed = time.monotonic() - started
    summary = "passed" if not failed else f"{failed} failed"
    say(f"self-test {summary} in {elapsed:.1f} s")
    if version != "unknown" and not is_tested(version):
        say(_keep(version, results, problem, elapsed))
    return failed


def _keep(version: str, results: list[dict[str, Any]], problem: str, seconds: float) -> str:
    """The verdict on a release newer than the newest tested, kept where the guard reads it."""
    try:
        subject = _verify.subject(version)
        verdict = _verify.record(subject, results, problem, seconds, "doctor --self-test")
    except (_verify.CacheUnusable, OSError) as exc:
        return f"verdict not kept: {exc}"
    if verdict.passed and is_supported(version) and untested_choice() is None:
        effect = "tools flagged idempotent run on this install"
    elif verdict.passed:
        effect = f"set {ALLOW_UNTESTED_ENV}=1 to run the guard on this release"
    else:
        effect = "tools flagged idempotent refuse to run on this install"
    return f"verdict kept in {verdict.path}: {effect}"


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
