"""`crewai-idempotent`: inspect the ledger and settle uncertain operations.

    crewai-idempotent ls --status uncertain
    crewai-idempotent show KEY
    crewai-idempotent resolve KEY --happened --result-text ch_123 --reason "in the dashboard"
    crewai-idempotent resolve KEY --absent --reason "no charge at the provider"
    crewai-idempotent reconcile [--watch] [--dry-run] [--import myapp.reconcilers]
    crewai-idempotent doctor [--self-test]
    crewai-idempotent export > ledger.jsonl
    crewai-idempotent verify [KEY] [--export FILE] [--against OLD_EXPORT]

The ledger is `--ledger URL`, else `CREWAI_IDEMPOTENCY_URL`, else the embedded default
(the SQLite file the crewai integration uses, in crewai's storage folder for the current
project). `--ledger` goes before the command or after it, the same for every command and
subcommand (`crewai-idempotent approvals ls --ledger URL`); given in both places with
different URLs it is refused rather than one silently chosen. Only `demo` imports crewai;
the other commands stay fast. No command creates a ledger but `console users add` (the
console's accounts live in the ledger, and a new operator adds one before any crew ran):
a path that holds none is reported.

Everything printed for people is safe for a terminal: control and bidirectional-text
characters in keys, errors and receipts are shown escaped, and ledger passwords as `***`.

The commands live beside this module: `_ledger` (ls, show, resolve, purge, export),
`_gates` (approvals, spend), `_doctor`, `_demos`, `_reconcile` (the sweeper), `_notify`
(notify, notifications), `_console` (the web console), `_verify` (the histories' chains);
they print through `_output` and find the ledger through `_where`, never through this
module.

Exit status: 0 done; 1 refused, not found, or the ledger is unavailable; 2 bad usage
(including a malformed ledger URL or --result that is not JSON).
"""

from __future__ import annotations

import click
from click.core import ParameterSource

from ..backends._options import redact
from ..integration import URL_ENV
from ._console import console
from ._demos import demo, demo_approvals
from ._doctor import doctor
from ._gates import approvals, spend
from ._keys import keys
from ._ledger import build_indexes, export, list_records, purge, resolve, show
from ._notify import notifications, notify
from ._output import safe
from ._reconcile import reconcile
from ._verify import verify
from ._where import Where

__all__ = ["main"]

_LEDGER_HELP = (
    f"Ledger URL (sqlite:///relative.db, sqlite:////abs/file.db, file:///abs/dir, "
    f"postgresql://…, redis://…). Default: ${URL_ENV}, else the embedded SQLite ledger of "
    "the current project. Before or after the command."
)

_SOURCES = {
    ParameterSource.COMMANDLINE: "--ledger",
    ParameterSource.ENVIRONMENT: URL_ENV,
}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--ledger",
    "url",
    metavar="URL",
    envvar=URL_ENV,
    help=_LEDGER_HELP,
)
@click.pass_context
def main(ctx: click.Context, url: str | None) -> None:
    """Inspect the idempotency ledger and settle uncertain operations.

    An UNCERTAIN record (or a stale PENDING one) is an operation whose effect may or may not
    have happened. Look it up at the provider, then `resolve` it. See docs/recovery.md.
    """
    source = _SOURCES.get(ctx.get_parameter_source("url"), "--ledger")  # type: ignore[arg-type]
    where = Where(url, source)
    ctx.obj = where
    ctx.call_on_close(where.close)


def _ledger_after_command(ctx: click.Context, param: click.Parameter, url: str | None) -> None:
    """`--ledger URL` given after a command name: that command's (and its subcommands')
    ledger. One given before too must name the same URL."""
    if url is None:
        return
    where = Where(url, "--ledger")
    before = ctx.find_object(Where)
    if (
        before is not None
        and before.source == "--ledger"
        and before.url is not None
        and where.url != before.url
    ):
        raise click.UsageError(
            safe(
                f"--ledger is given twice with different URLs ({redact(before.url)} and "
                f"{redact(where.url or '')}): give it once, before or after the command"
            ),
            ctx,
        )
    ctx.obj = where
    ctx.call_on_close(where.close)


def _accept_ledger(command: click.Command) -> None:
    """Give `command`, and every subcommand under it, the group's `--ledger`."""
    command.params.append(
        click.Option(
            ["--ledger"], metavar="URL", expose_value=False, callback=_ledger_after_command,
            help="The ledger, as --ledger before the command (where it must agree).",
        )
    )  # fmt: skip
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _accept_ledger(sub)


for _command in (
    list_records,
    export,
    show,
    resolve,
    purge,
    build_indexes,
    doctor,
    demo,
    approvals,
    spend,
    demo_approvals,
    reconcile,
    notify,
    notifications,
    console,
    verify,
):
    _accept_ledger(_command)
    main.add_command(_command)
main.add_command(keys)  # trusted keys live outside the ledger: no --ledger
