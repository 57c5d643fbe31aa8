"""`crewai-idempotent demo` and `crewai-idempotent demo-approvals`: the offline demos the
integration runs (integration/_demo.py, integration/_demo_approvals.py)."""

from __future__ import annotations

import sys

import click

from ..integration import URL_ENV
from ._output import console


@click.command("demo")
@click.option(
    "--ledger-path",
    type=click.Path(dir_okay=False, path_type=str),
    help="SQLite file for the demo's ledger (default: the embedded SQLite ledger in crewai's "
    "storage folder). The demo never uses --ledger or $" + URL_ENV + ".",
)
def demo(ledger_path: str | None) -> None:
    """Run an offline payment crew whose guardrail and agent retries replay the receipt."""
    # Deliberately late: the demo imports crewai, which takes seconds and may be missing.
    try:
        from ..integration._demo import run_demo
    except ImportError as exc:
        raise click.ClickException(f"the demo is not available: {exc}") from None
    sys.exit(int(run_demo(ledger_path, console=console()) or 0))


@click.command("demo-approvals")
@click.option(
    "--ledger-path",
    type=click.Path(dir_okay=False, path_type=str),
    help="SQLite file for the demo's ledger (default: a fresh temporary one).",
)
def demo_approvals(ledger_path: str | None) -> None:
    """Run an offline crew whose large payment waits for approval and whose cap refuses one."""
    # Deliberately late, as for `demo`.
    try:
        from ..integration._demo_approvals import run_demo
    except ImportError as exc:
        raise click.ClickException(f"the demo is not available: {exc}") from None
    sys.exit(int(run_demo(ledger_path, console=console()) or 0))
