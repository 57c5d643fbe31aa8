"""`reconcile`: settle UNCERTAIN records and stale claims by asking their reconcilers.

One pass by default (a progress bar on a terminal, then a line per record and a
summary), or `--watch` for a long-running worker that sweeps every `--interval` until
SIGTERM or SIGINT. The sweeper itself is `crewai_idempotent.reconciliation.Sweeper`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

import click

from ._keys import load_signing, signing_key_option
from ._output import duration, ledger_errors, machine, safe
from ._where import Where

if TYPE_CHECKING:
    from ..reconciliation import Report, Result, Sweeper

_SHOWN = {
    "found": "found",
    "absent": "absent",
    "unknown": "unknown",
    "left": "left",
    "due": "would ask",
    "skipped": "skipped",
    "overtaken": "overtaken",
    "error": "error",
}


@click.command("reconcile")
@click.option("--watch", is_flag=True, help="Keep sweeping every --interval until stopped.")
@click.option(
    "--interval",
    default="30s",
    show_default=True,
    metavar="AGE",
    help="With --watch: the pause between passes.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Say what each record's reconciler would be asked: ask nothing, write nothing.",
)
@click.option(
    "--import",
    "imports",
    multiple=True,
    metavar="MODULE",
    help="Import MODULE first (its register() calls and tools count), and trust the "
    "import paths records name under it. Repeatable.",
)
@click.option(
    "--trust",
    multiple=True,
    metavar="MODULE",
    help="Trust the reconciler paths records name under MODULE without importing it "
    "first. Repeatable.",
)
@click.option(
    "--tool",
    "tools",
    multiple=True,
    metavar="NAME",
    help="Only records of this tool: the name its claims record, or the key's prefix before "
    "the first ':'. Repeatable.",
)
@click.option("--key", "keys", multiple=True, metavar="KEY", help="Only this key. Repeatable.")
@click.option(
    "--timeout", metavar="AGE", help="How long each reconciler is waited for (default 30s)."
)
@click.option(
    "--backoff",
    default="60s",
    show_default=True,
    metavar="AGE",
    help="After an Unknown answer, ask again after this long (doubling).",
)
@click.option("--max-backoff", default="1h", show_default=True, metavar="AGE")
@click.option(
    "--alert-after",
    default="1h",
    show_default=True,
    metavar="AGE",
    help="Alert on records open (UNCERTAIN, or a stale claim) this long.",
)
@click.option(
    "--alert-unknowns",
    default=3,
    show_default=True,
    type=click.IntRange(0),
    help="Alert when a reconciler answered Unknown this many times in a row (0: never).",
)
@click.option(
    "--concurrency",
    default=4,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Records worked on at once.",
)
@click.option(
    "--no-entry-points", is_flag=True, help="Ignore the reconcilers installed packages register."
)
@click.option(
    "--json", "as_json", is_flag=True, help="The report as JSON (a line per pass, watching)."
)
@signing_key_option("its settlements", flag="--signing-key")
@click.option("--passes", type=click.IntRange(1), hidden=True)
@click.pass_obj
def reconcile(
    where: Where,
    watch: bool,
    interval: str,
    dry_run: bool,
    imports: tuple[str, ...],
    trust: tuple[str, ...],
    tools: tuple[str, ...],
    keys: tuple[str, ...],
    timeout: str | None,
    backoff: str,
    max_backoff: str,
    alert_after: str,
    alert_unknowns: int,
    concurrency: int,
    no_entry_points: bool,
    as_json: bool,
    key_file: str | None,
    passes: int | None,
) -> None:
    """Settle UNCERTAIN records and stale claims by asking each tool's reconciler.

    Found commits the receipt it returns; Absent marks the record FAILED, so the next call
    runs; Unknown leaves it UNCERTAIN with the attempt in its history, asked again after a
    back-off. A record whose owner renews its lease, one another sweeper is asking about,
    and one that needs an operator are left alone. Many sweepers may run on one ledger.
    Reconcilers are found by tool name (--import, entry points) or by the import path a
    record names under an --import or --trust module. See docs/recovery.md.

    --signing-key FILE (or $CREWAI_IDEMPOTENCY_SIGNING_KEY) signs the settlements: workers
    with trusted keys obey a sweeper's settlement only when its key's line says `sweeper`.
    With $CREWAI_IDEMPOTENCY_TRUSTED_KEYS set, the sweeper checks its settlements against
    them, and without a key it leaves an absent answer unwritten.
    """
    # Every duration read before anything is opened or imported.
    pause, timeout_s = _seconds(interval), duration(timeout)
    backoff_s, max_backoff_s = _seconds(backoff), _seconds(max_backoff)
    alert_after_s = _seconds(alert_after)
    # A console script's sys.path lacks the current folder, where `myapp` usually is.
    if imports and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    _log_to_stderr(verbose=watch)
    signer, trusted = load_signing(key_file)
    with ledger_errors(where.scrub):
        ledger = where.ledger()
        if trusted is not None:
            ledger.trusted_keys = trusted
    try:
        from ..reconciliation import Sweeper

        sweeper = Sweeper(
            ledger,
            imports=imports,
            trust=trust,
            entry_points=not no_entry_points,
            alert_unknowns=alert_unknowns,
            concurrency=concurrency,
            tools=tools or None,
            keys=keys or None,
            dry_run=dry_run,
            timeout_s=timeout_s,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            alert_after_s=alert_after_s,
            signer=signer,
        )
    except ImportError as exc:
        raise click.ClickException(safe(f"--import: {type(exc).__name__}: {exc}")) from None
    except (ValueError, TypeError) as exc:
        raise click.UsageError(safe(str(exc))) from None
    if watch:
        _watch(sweeper, where, pause, as_json, passes)
        return
    report = _one_pass(sweeper, as_json)
    if as_json:
        click.echo(machine(_as_json(report)))
    else:
        _print(report, where)
    if report.error is not None:
        raise click.ClickException(where.scrub(safe(f"ledger unavailable: {report.error}")))


def _seconds(value: str) -> float:
    seconds = duration(value)
    assert seconds is not None
    return seconds


def _one_pass(sweeper: Sweeper, as_json: bool) -> Report:
    if as_json or not sys.stderr.isatty():
        return sweeper.sweep()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from ..reconciliation import Progress as Hooks

    bar = Progress(
        TextColumn("reconciling"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[last]}"),
        console=Console(stderr=True),
        transient=True,
    )

    class Shown(Hooks):
        task: Any = None

        def started(self, total: int) -> None:
            self.task = bar.add_task("sweep", total=total, last="")

        def done(self, result: Result) -> None:
            bar.update(self.task, advance=1, last=safe(f"{result.outcome} {result.key}")[:60])

    with bar:
        return sweeper.sweep(Shown())


def _line(result: Result) -> str:
    what = _SHOWN.get(result.outcome, result.outcome)
    text = f"{what:<10} {result.key}"
    record = result.record
    if result.outcome == "found" and record is not None:
        from ..ledger._results import describe

        text += f"  receipt {machine(describe(record.result)[1], None)}"
    elif result.reason and result.outcome not in ("absent",):
        text += f"  {result.reason}"
    if result.reconciler and result.outcome in ("found", "absent", "unknown", "due"):
        text += f"  [{result.reconciler}]"
    return safe(text, lines=False)


def _print(report: Report, where: Where) -> None:
    for result in sorted(report.results, key=lambda r: (r.outcome, r.key)):
        click.echo(_line(result))
    if report.error is None:
        counts = {k: v for k, v in report.counts().items() if v}
        said = ", ".join(f"{n} {_SHOWN[k]}" for k, n in counts.items()) or "nothing to settle"
        verb = "dry run: " if report.dry_run else ""
        tail = ""
        if report.open_uncertain is not None and not report.dry_run:
            tail = f"; {report.open_uncertain} UNCERTAIN left"
        click.echo(f"{verb}{len(report.results)} record(s) in {where.label}: {said}{tail}")


def _as_json(report: Report) -> dict[str, Any]:
    return {
        "ledger": report.ledger,
        "dry_run": report.dry_run,
        "started": report.started,
        "finished": report.finished,
        "error": report.error,
        "counts": report.counts(),
        "open_uncertain": report.open_uncertain,
        "results": [
            {
                "key": r.key,
                "outcome": r.outcome,
                "reason": r.reason,
                "tool": r.tool,
                "reconciler": r.reconciler,
                "status": r.record.status.value if r.record is not None else None,
                "token": r.record.token if r.record is not None else None,
            }
            for r in report.results
        ],
        "alerts": [
            {"id": a.id, "kind": a.kind, "key": a.key, "reason": a.reason, "tool": a.tool}
            for a in report.alerts
        ],
    }


def _watch(
    sweeper: Sweeper, where: Where, interval: float, as_json: bool, passes: int | None
) -> None:
    stop = threading.Event()

    def stopping(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stopping)
    click.echo(
        f"sweeping {where.label} every {interval:g} s"
        + (" (dry run)" if sweeper.dry_run else "")
        + "; stop with SIGTERM or Ctrl-C",
        err=True,
    )

    def said(report: Report) -> None:
        if as_json:
            click.echo(machine(_as_json(report), None))
            return
        for result in report.results:
            if result.outcome in ("found", "absent", "unknown", "due", "error"):
                click.echo(_line(result))

    sweeper.watch(interval, stop=stop, passes=passes, on_report=said)
    click.echo("stopped", err=True)


def _log_to_stderr(verbose: bool) -> None:
    """Alerts (and, while watching, the sweeper's own notes) as lines on stderr, for as
    long as the command runs."""
    logger = logging.getLogger("crewai_idempotent")
    handler = _Stderr()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)

    def restore() -> None:
        logger.removeHandler(handler)
        logger.setLevel(level)

    click.get_current_context().call_on_close(restore)


class _Stderr(logging.StreamHandler[Any]):
    """Writes to whatever `sys.stderr` is when a line is written."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)
