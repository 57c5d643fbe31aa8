"""`crewai-idempotent`: inspect the ledger and settle uncertain operations.

    crewai-idempotent ls --status uncertain
    crewai-idempotent show KEY
    crewai-idempotent resolve KEY --happened --result-text ch_123 --reason "in the dashboard"
    crewai-idempotent resolve KEY --absent --reason "no charge at the provider"

The ledger is `--ledger URL`, else `CREWAI_IDEMPOTENCY_URL`, else the embedded default
(the SQLite file the crewai integration uses, in crewai's storage folder for the current
project). Only `demo` imports crewai; the other commands stay fast.

Exit status: 0 done; 1 refused, not found, or the ledger is unavailable; 2 bad usage
(including a malformed ledger URL or --result that is not JSON).
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import click

if TYPE_CHECKING:
    from rich.console import Console

    from ._ledger import Ledger
    from ._record import Record

URL_ENV = "CREWAI_IDEMPOTENCY_URL"
_STATUSES = ("pending", "committed", "failed", "uncertain")


class _Where:
    """The ledger the user named, opened on first use and closed at exit."""

    def __init__(self, url: str | None) -> None:
        self.url = url.strip() if url and url.strip() else None
        self._ledger: Ledger | None = None

    @property
    def label(self) -> str:
        return self.url or f"sqlite://{_default_path()} (default)"

    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._ledger = self._open()
        return self._ledger

    def _open(self) -> Ledger:
        from ._errors import LedgerUnavailable
        from ._ledger import Ledger
        from ._url import backend_from_url

        if self.url is None:
            path = _default_path()
            if not path.exists():
                raise click.ClickException(
                    f"no ledger at the default location {path} (crewai's storage folder for "
                    f"project {path.parent.name!r}, named after the current directory or "
                    f"CREWAI_STORAGE_DIR). Run from the project's directory, or pass --ledger "
                    f"URL / set {URL_ENV}"
                )
            url = f"sqlite://{path}"
        else:
            url = self.url
            _require_local_ledger(url)
        try:
            backend = backend_from_url(url)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--ledger") from None
        except LedgerUnavailable as exc:
            raise click.ClickException(f"ledger unavailable: {exc}") from None
        return Ledger(backend)

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()


def _default_path() -> Path:
    # The integration's own definition, so the CLI always looks where the tools write.
    from .integration._config import default_ledger_path

    return default_ledger_path()


def _require_local_ledger(url: str) -> None:
    """Refuse to create a ledger by looking at one: a typo would open an empty new file."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("sqlite", "file") or parts.netloc not in ("", "localhost"):
        return  # servers, or a malformed local URL that backend_from_url will explain
    path = Path(unquote(parts.path))
    if parts.path not in ("", "/") and not path.exists():
        raise click.ClickException(f"no ledger at {path} (from --ledger {url})")


@contextmanager
def _errors() -> Iterator[None]:
    """Turn the ledger's errors into one clear line and exit status 1."""
    from ._errors import IdempotencyError, InvalidIdempotencyKey, LedgerUnavailable

    try:
        yield
    except InvalidIdempotencyKey as exc:
        raise click.BadParameter(str(exc), param_hint="KEY") from None
    except LedgerUnavailable as exc:
        raise click.ClickException(f"ledger unavailable: {exc}") from None
    except IdempotencyError as exc:
        raise click.ClickException(str(exc)) from None


def _check_key(key: str) -> None:
    from ._keys import validate_key

    with _errors():
        validate_key(key)


def _console() -> Console:
    from rich.console import Console

    # Keys, errors and receipts are data: "[x]" or ":x:" in them must print as written.
    return Console(highlight=False, soft_wrap=False, markup=False, emoji=False)


def _stamp(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _when(at: float | None, now: float) -> str:
    return "-" if at is None else f"{_stamp(at)} ({_ago(now - at)})"


def _ago(seconds: float) -> str:
    future = seconds < 0
    seconds = abs(seconds)
    if seconds < 90:
        text = f"{seconds:.0f} s"
    elif seconds < 90 * 60:
        text = f"{seconds / 60:.0f} min"
    elif seconds < 48 * 3600:
        text = f"{seconds / 3600:.0f} h"
    else:
        text = f"{seconds / 86400:.0f} d"
    return f"in {text}" if future else f"{text} ago"


def _state(record: Record, now: float) -> str:
    """The status as an operator needs to read it."""
    status = record.status.value
    if record.status.value == "PENDING":
        return status if record.lease_live(now) else f"{status} (stale)"
    if record.needs_operator:
        return f"{status} (needs operator)"
    return status


def _payload(payload: Any) -> Any:
    """A stored result as data, without importing the class of a pydantic receipt."""
    if not isinstance(payload, dict):
        return payload
    return payload.get("v")


def _payload_type(payload: Any) -> str:
    if not isinstance(payload, dict):
        return "?"
    kind = payload.get("t")
    if kind == "pydantic":
        return str(payload.get("cls"))
    if kind == "str":
        return f"str() of {payload.get('type')}"
    return "json"


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--ledger",
    "url",
    metavar="URL",
    envvar=URL_ENV,
    help=f"Ledger URL (sqlite:///abs/file.db, file:///abs/dir, postgresql://…, redis://…). "
    f"Default: ${URL_ENV}, else the embedded SQLite ledger of the current project.",
)
@click.pass_context
def main(ctx: click.Context, url: str | None) -> None:
    """Inspect the idempotency ledger and settle uncertain operations.

    An UNCERTAIN record (or a stale PENDING one) is an operation whose effect may or may not
    have happened. Look it up at the provider, then `resolve` it. See docs/recovery.md.
    """
    where = _Where(url)
    ctx.obj = where
    ctx.call_on_close(where.close)


@main.command("ls")
@click.option(
    "--status",
    type=click.Choice(_STATUSES, case_sensitive=False),
    help="Only records in this status.",
)
@click.option("--stale", is_flag=True, help="Only PENDING records whose lease has expired.")
@click.option("--needs-operator", is_flag=True, help="Only records flagged for a person.")
@click.option("--json", "as_json", is_flag=True, help="One JSON array instead of a table.")
@click.pass_obj
def list_records(
    where: _Where, status: str | None, stale: bool, needs_operator: bool, as_json: bool
) -> None:
    """List records, oldest update first."""
    from ._record import Status

    with _errors():
        ledger = where.ledger()
        wanted = Status(status.upper()) if status else (Status.PENDING if stale else None)
        records = ledger.records(wanted)
        now = ledger.backend.now()
    if stale:
        records = [r for r in records if ledger.is_stale(r)]
    if needs_operator:
        records = [r for r in records if r.needs_operator]
    if as_json:
        click.echo(
            _dumps([json.loads(r.to_json()) | {"stale": ledger.is_stale(r)} for r in records])
        )
        return

    if not records:
        click.echo(f"no records match in {where.label}")
        return
    rows = [("KEY", "STATUS", "TOKEN", "OWNER", "UPDATED", "NOTE")]
    for record in records:
        note = record.error or ""
        if record.status is Status.PENDING:
            verb = "expires" if record.lease_live(now) else "expired"
            note = f"lease {verb} {_ago(now - (record.lease_expires_at or now))}"
        owner = record.owner.label if record.owner else "-"
        age = _ago(now - record.updated_at)
        rows.append((record.key, _state(record, now), str(record.token), owner, age, note))
    # One line per record, every column whole except the note, which is cut to the terminal.
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    room = max(30, shutil.get_terminal_size((100, 24)).columns - sum(widths) - 2 * 5)
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        note = row[5] if len(row[5]) <= room else row[5][: room - 1] + "…"
        click.echo("  ".join([*cells, note]).rstrip())
    click.echo(f"{len(records)} record(s) in {where.label}")


@main.command("show")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="The record as JSON.")
@click.pass_obj
def show(where: _Where, key: str, as_json: bool) -> None:
    """Show one record: its state, result, evidence and full history."""
    _check_key(key)
    with _errors():
        ledger = where.ledger()
        record = ledger.get(key)
        now = ledger.backend.now()
    if record is None:
        raise click.ClickException(f"no record for idempotency key {key!r} in {where.label}")
    if as_json:
        click.echo(_dumps(json.loads(record.to_json()) | {"stale": ledger.is_stale(record)}))
        return

    from rich.table import Table

    console = _console()
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column(overflow="fold")
    rows: list[tuple[str, str]] = [
        ("key", record.key),
        ("status", _state(record, now)),
        ("token", str(record.token)),
        ("revision", str(record.revision)),
        ("attempts", str(record.attempts)),
        ("owner", record.owner.label if record.owner else "-"),
        ("fingerprint", record.fingerprint or "-"),
        ("created", _when(record.created_at, now)),
        ("updated", _when(record.updated_at, now)),
    ]
    if record.lease_expires_at is not None:
        rows.append(("lease expires", _when(record.lease_expires_at, now)))
    if record.expires_at is not None:
        rows.append(("receipt expires", _when(record.expires_at, now)))
    if record.error:
        rows.append(("error", record.error))
    if record.result is not None:
        rows.append((f"result ({_payload_type(record.result)})", _dumps(_payload(record.result))))
    if record.needs_operator:
        rows.append(("needs operator", "yes: two executions may have happened"))
    for name, value in rows:
        facts.add_row(name, value)
    console.print(facts)

    if record.evidence:
        console.print()
        console.print(f"evidence ({len(record.evidence)} late finisher(s))", style="bold")
        for number, item in enumerate(record.evidence, 1):
            shown = dict(item)
            if "result" in shown:
                shown["result"] = _payload(shown["result"])
            if isinstance(shown.get("at"), int | float):
                shown["at"] = _stamp(shown["at"])
            console.print(f"{number}. {_dumps(shown)}")

    console.print()
    history = Table(title="history", title_justify="left", box=None, header_style="bold")
    for name in ("#", "AT (UTC)", "EVENT", "TOKEN", "BY"):
        history.add_column(name, no_wrap=True)
    history.add_column("NOTE", overflow="fold")
    for number, event in enumerate(record.history, 1):
        history.add_row(
            str(number), _stamp(event.at), event.kind, str(event.token), event.by, event.note
        )
    console.print(history)


@main.command("resolve")
@click.argument("key")
@click.option("--happened", is_flag=True, help="The operation happened at the provider.")
@click.option("--absent", is_flag=True, help="It did not happen; the next attempt runs it.")
@click.option(
    "--result",
    "result_json",
    metavar="JSON",
    help="With --happened: the receipt to replay, as JSON.",
)
@click.option("--result-text", metavar="TEXT", help="With --happened: the receipt, as plain text.")
@click.option("--reason", required=True, help="Why: what you checked at the provider.")
@click.option("--by", metavar="NAME", help="Who resolves (default: user@host).")
@click.pass_obj
def resolve(
    where: _Where,
    key: str,
    happened: bool,
    absent: bool,
    result_json: str | None,
    result_text: str | None,
    reason: str,
    by: str | None,
) -> None:
    """Settle an UNCERTAIN (or stale PENDING) record after checking the provider.

    --happened: the record becomes COMMITTED and --result/--result-text is replayed to every
    later call (without either, the result already stored on the record is kept, if any).
    --absent: the record becomes FAILED and the next attempt runs the operation.
    """
    _check_key(key)
    if happened == absent:
        raise click.UsageError("say either --happened or --absent")
    if absent and (result_json is not None or result_text is not None):
        raise click.UsageError("--result/--result-text go with --happened, not --absent")
    if result_json is not None and result_text is not None:
        raise click.UsageError("give --result JSON or --result-text TEXT, not both")
    if not reason.strip():
        raise click.BadParameter("say what you checked", param_hint="--reason")
    result: Any = None
    if result_json is not None:
        try:
            result = json.loads(result_json)
        except ValueError as exc:
            raise click.BadParameter(
                f"not JSON ({exc}): {result_json!r}", param_hint="--result"
            ) from None
    elif result_text is not None:
        result = result_text

    with _errors():
        ledger = where.ledger()
        before = ledger.get(key)
        if before is None:
            raise click.ClickException(f"no record for idempotency key {key!r} in {where.label}")
        if happened and result_json is None and result_text is None:
            result = _kept_result(before)
        if absent:
            record = ledger.resolve(key, absent=True, by=by, reason=reason)
        else:
            record = ledger.resolve(key, result=result, by=by, reason=reason)

    console = _console()
    if before.needs_operator:
        console.print(
            f"note: {key!r} was flagged because two executions may have happened "
            f"({len(before.evidence)} late finisher(s) in its evidence); the evidence stays "
            "on the record"
        )
    if absent:
        console.print(f"resolved {key!r} as absent: FAILED; the next attempt runs the operation")
    else:
        console.print(
            f"resolved {key!r} as happened: COMMITTED (token {record.token}); every later "
            f"call replays {json.dumps(_payload(record.result), ensure_ascii=False)}"
        )


def _kept_result(record: Record) -> Any:
    if record.result is None:
        raise click.UsageError(
            f"{record.key!r} has no stored result to keep; give the provider's receipt "
            "with --result JSON or --result-text TEXT"
        )
    value = record.value()
    if record.result.get("t") == "pydantic" and isinstance(value, dict):
        raise click.UsageError(
            f"the stored result is a {record.result.get('cls')} that cannot be imported here; "
            "give it with --result JSON"
        )
    return value


@main.command("purge")
@click.option(
    "--all",
    "everything",
    is_flag=True,
    help="Also COMMITTED records whose TTL has not passed, and FAILED ones.",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (with --all).")
@click.pass_obj
def purge(where: _Where, everything: bool, yes: bool) -> None:
    """Delete COMMITTED records whose TTL has passed (never PENDING or UNCERTAIN ones)."""
    if everything and not yes:
        click.confirm(
            "--all deletes every COMMITTED and FAILED record: their receipts are lost and a "
            "retry of any of those operations runs it again. Continue?",
            abort=True,
            err=True,
        )
    with _errors():
        removed = where.ledger().purge(expired_only=not everything)
    click.echo(f"purged {removed} record(s) from {where.label}")


@main.command("demo")
@click.option(
    "--ledger-path",
    type=click.Path(dir_okay=False, path_type=str),
    help="SQLite file for the demo's ledger (default: the embedded SQLite ledger in crewai's "
    "storage folder). The demo never uses --ledger or $" + URL_ENV + ".",
)
def demo(ledger_path: str | None) -> None:
    """Run an offline payment crew whose guardrail and agent retries replay the receipt."""
    try:
        from .demo import run_demo
    except ImportError as exc:
        raise click.ClickException(f"the demo is not available: {exc}") from None
    code = run_demo(ledger_path, console=_console())
    sys.exit(int(code or 0))


if __name__ == "__main__":  # `python -m crewai_idempotent.cli`
    main(prog_name="crewai-idempotent")
