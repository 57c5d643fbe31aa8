"""`crewai-idempotent demo` and `crewai-idempotent demo-approvals`: the offline demos the
integration runs (integration/offline/_demo.py, integration/offline/_demo_approvals.py).

Each runs on a throwaway ledger, deleted when it ends, unless asked for one: the group's
`--ledger URL` given on the command line (never CREWAI_IDEMPOTENCY_URL: a demo must not
write into the ledger a deployment uses because the variable is set), or `--ledger-path`.
`--receipt FILE` also runs the unguarded control and writes a JSON receipt of both runs
(docs/receipts.md); a path it cannot write is refused before the demo runs.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from ..integration import URL_ENV
from ._output import console
from ._where import Where

_PATH_HELP = (
    "SQLite file for the demo's ledger, kept after it. Default: a throwaway ledger, deleted "
    "when the demo ends; `crewai-idempotent --ledger URL {command}` runs it on any ledger "
    f"(${URL_ENV} is never used)."
)


def _ledger_url(where: Where, ledger_path: str | None) -> str | None:
    """The ledger URL the user gave with --ledger on this command line, if any."""
    given = where.url if where.source == "--ledger" else None
    if given is not None and ledger_path is not None:
        raise click.UsageError("give the demo's ledger with --ledger or --ledger-path, not both")
    return given


_RECEIPT_HELP = (
    "Also run the same crew without the guard (the control) and write a JSON receipt of "
    "both runs to FILE: versions, the action's key, each run's timeline and the effects "
    "counted at the fake provider (docs/receipts.md)."
)


def _receipt_path(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The receipt's file, refused now if it cannot be written (before the demo runs)."""
    if value is None:
        return None
    from ..integration.offline._scripted import receipt_unwritable

    problem = receipt_unwritable(value)
    if problem is not None:
        raise click.BadParameter(f"cannot write the receipt there: {problem}", ctx, param)
    return value


def _run(module: str, where: Where, ledger_path: str | None, receipt: str | None) -> None:
    # Deliberately late: the demos import crewai, which takes seconds and may be missing.
    try:
        run_demo: Any = importlib.import_module(module).run_demo
    except ImportError as exc:
        raise click.ClickException(f"the demo is not available: {exc}") from None
    url = _ledger_url(where, ledger_path)
    extra = {"receipt": receipt} if receipt is not None else {}
    sys.exit(int(run_demo(ledger_path, ledger_url=url, console=console(), **extra) or 0))


@click.command("demo")
@click.option(
    "--ledger-path",
    type=click.Path(dir_okay=False, path_type=str),
    help=_PATH_HELP.format(command="demo"),
)
@click.option("--receipt", metavar="FILE", callback=_receipt_path, help=_RECEIPT_HELP)
@click.pass_obj
def demo(where: Where, ledger_path: str | None, receipt: str | None) -> None:
    """Run an offline payment crew whose guardrail and agent retries replay the receipt."""
    _run("crewai_idempotent.integration.offline._demo", where, ledger_path, receipt)


@click.command("demo-approvals")
@click.option(
    "--ledger-path",
    type=click.Path(dir_okay=False, path_type=str),
    help=_PATH_HELP.format(command="demo-approvals"),
)
@click.option("--receipt", metavar="FILE", callback=_receipt_path, help=_RECEIPT_HELP)
@click.pass_obj
def demo_approvals(where: Where, ledger_path: str | None, receipt: str | None) -> None:
    """Run an offline crew whose large payment waits for approval and whose cap refuses one."""
    _run("crewai_idempotent.integration.offline._demo_approvals", where, ledger_path, receipt)
