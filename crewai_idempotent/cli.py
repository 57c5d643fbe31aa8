"""`crewai-idempotent`: inspect the ledger and settle uncertain operations.

    crewai-idempotent ls --status uncertain
    crewai-idempotent show KEY
    crewai-idempotent resolve KEY --happened --result-text ch_123 --reason "in the dashboard"
    crewai-idempotent resolve KEY --absent --reason "no charge at the provider"
    crewai-idempotent doctor [--self-test]
    crewai-idempotent export > ledger.jsonl

The ledger is `--ledger URL`, else `CREWAI_IDEMPOTENCY_URL`, else the embedded default
(the SQLite file the crewai integration uses, in crewai's storage folder for the current
project). Only `demo` imports crewai; the other commands stay fast. No command creates a
ledger: a path that holds none is reported.

Everything printed for people is safe for a terminal: control and bidirectional-text
characters in keys, errors and receipts are shown escaped, and ledger passwords as `***`.

Exit status: 0 done; 1 refused, not found, or the ledger is unavailable; 2 bad usage
(including a malformed ledger URL or --result that is not JSON).
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import sys
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import click
from click.core import ParameterSource

from .integration import URL_ENV

if TYPE_CHECKING:
    from rich.console import Console

    from ._ledger import Ledger
    from ._record import Record

_STATUSES = ("pending", "committed", "failed", "uncertain")


_SOURCES = {
    ParameterSource.COMMANDLINE: "--ledger",
    ParameterSource.ENVIRONMENT: URL_ENV,
}
_SQLITE_HEADER = b"SQLite format 3\x00"


class _Where:
    """The ledger the user named, opened on first use and closed at exit."""

    def __init__(self, url: str | None, source: str = "--ledger") -> None:
        self.url = url.strip() if url and url.strip() else None
        self.source = source if self.url is not None else "default"
        self._ledger: Ledger | None = None
        self._secrets = _secrets(self.url) if self.url else []

    @property
    def label(self) -> str:
        if self.url is None:
            return f"{_sqlite_url(_default_path())} (default)"
        return _redact(self.url)

    def scrub(self, text: str) -> str:
        """`text` with the ledger's password replaced, wherever a message repeats it."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._ledger = self._open()
        return self._ledger

    def _open(self) -> Ledger:
        from ._errors import LedgerUnavailable
        from ._ledger import Ledger
        from .backends._url import backend_from_url

        if self.url is None:
            path = _default_path()
            if not path.exists():
                raise click.ClickException(
                    safe(
                        f"no ledger at the default location {path} (crewai's storage folder for "
                        f"project {path.parent.name!r}, named after the current directory or "
                        f"CREWAI_STORAGE_DIR). Run from the project's directory, or pass "
                        f"--ledger URL / set {URL_ENV}"
                    )
                )
            _require_ledger_file(path, "the default location")
            url = _sqlite_url(path)
        else:
            url = self.url
            self._require_existing(url)
        try:
            backend = backend_from_url(url)
        except ValueError as exc:
            raise click.BadParameter(self.scrub(safe(str(exc))), param_hint=self.source) from None
        except LedgerUnavailable as exc:
            raise click.ClickException(self.scrub(safe(f"ledger unavailable: {exc}"))) from None
        return Ledger(backend)

    def _require_existing(self, url: str) -> None:
        """Refuse to create a ledger by looking at one: a typo would open an empty new one."""
        from .backends._url import local_path

        try:
            path = local_path(url)
        except ValueError as exc:
            raise click.BadParameter(self.scrub(safe(str(exc))), param_hint=self.source) from None
        if path is None:
            return  # servers: the backend reports an unreachable one
        where = f"from {self.source} {self.label}"
        if urlsplit(url).scheme.lower() == "sqlite":
            _require_ledger_file(path, where)
        elif not (path / "records").is_dir():
            raise click.ClickException(
                safe(
                    f"no ledger at {path} ({where}): a file ledger is a folder holding "
                    "records/ and locks/"
                )
            )

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()


def _require_ledger_file(path: Path, where: str) -> None:
    """`path` is an existing SQLite database holding a ledger; anything else is refused
    before it is opened read-write (which would make it one)."""
    import sqlite3

    if not path.exists():
        raise click.ClickException(safe(f"no ledger at {path} ({where})"))
    try:
        with path.open("rb") as file:
            header = file.read(len(_SQLITE_HEADER))
    except OSError as exc:
        raise click.ClickException(safe(f"ledger unavailable: cannot read {path}: {exc}")) from None
    if header != _SQLITE_HEADER:
        what = "an empty file" if not header else "not a SQLite database"
        raise click.ClickException(safe(f"no ledger at {path} ({where}): it is {what}"))
    try:
        db = sqlite3.connect(
            f"{_sqlite_url(path).replace('sqlite:', 'file:', 1)}?mode=ro", uri=True
        )
        try:
            found = db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'idempotency_records'"
            ).fetchone()
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        raise click.ClickException(safe(f"ledger unavailable: {path}: {exc}")) from None
    if found is None:
        raise click.ClickException(
            safe(f"no ledger at {path} ({where}): a SQLite database without a ledger table")
        )


def _sqlite_url(path: Path) -> str:
    return "sqlite:///" + quote(str(path.absolute()), safe="/")


def _redact(url: str) -> str:
    from .backends._url import redact

    return safe(redact(url))


def _secrets(url: str) -> list[str]:
    """The password a URL carries, raw and percent-encoded, longest first."""
    from urllib.parse import parse_qsl, unquote

    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found = set()
    userinfo = parts.netloc.rpartition("@")[0]
    if ":" in userinfo:
        found.add(userinfo.split(":", 1)[1])
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name.lower() in ("password", "passwd", "pass"):
            found.add(value)
    found |= {unquote(secret) for secret in found}
    found |= {quote(secret, safe="") for secret in found}
    return sorted((s for s in found if s), key=len, reverse=True)


def _default_path() -> Path:
    # The integration's own definition, so the CLI always looks where the tools write.
    from .integration import default_ledger_path

    return default_ledger_path()


_UNSAFE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f"
    "\ufeff\ufff9-\ufffb\ud800-\udfff]"
)


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe(text: str, *, lines: bool = True) -> str:
    """`text` with every character that could move the cursor, change colours or reorder
    what the terminal shows (C0/C1 controls, escape, bidi overrides and isolates,
    zero-width and format characters, lone surrogates) written as `\\xNN`/`\\uNNNN`.
    Newlines and tabs stay when `lines` (multi-line text we laid out), else they too are
    escaped (one table cell)."""
    text = _UNSAFE.sub(_escape_char, text)
    if not lines:
        text = text.replace("\n", "\\n").replace("\t", "\\t")
    # Any other format character (category Cf) is escaped too.
    if not text.isascii():
        text = "".join(f"\\u{ord(c):04x}" if unicodedata.category(c) == "Cf" else c for c in text)
    return text


@contextmanager
def _errors(where: _Where | None = None) -> Iterator[None]:
    """Turn the ledger's errors into one clear, terminal-safe line and exit status 1."""
    from ._errors import IdempotencyError, InvalidIdempotencyKey, LedgerUnavailable

    def clean(text: str) -> str:
        return safe(where.scrub(text) if where is not None else text)

    try:
        yield
    except InvalidIdempotencyKey as exc:
        raise click.BadParameter(clean(str(exc)), param_hint="KEY") from None
    except LedgerUnavailable as exc:
        raise click.ClickException(clean(f"ledger unavailable: {exc}")) from None
    except IdempotencyError as exc:
        raise click.ClickException(clean(str(exc))) from None


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


_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}


def _duration(value: str | None) -> float | None:
    """`90`, `90s`, `15m`, `2h`, `7d`, `1w` as seconds."""
    if value is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d|w)?\s*", value)
    if match is None:
        raise click.BadParameter(f"not a duration (90, 90s, 15m, 2h, 7d, 1w): {value!r}")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


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
    if kind == "typed":
        return "json with tagged types"
    return "json"


def _dumps(value: Any) -> str:
    """JSON for people: laid out, then made terminal-safe."""
    return safe(json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True))


def _machine(value: Any, indent: int | None = 2) -> str:
    """JSON for programs: ASCII only, so no byte of it can act on a terminal either."""
    return json.dumps(value, indent=indent, ensure_ascii=True, sort_keys=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--ledger",
    "url",
    metavar="URL",
    envvar=URL_ENV,
    help=f"Ledger URL (sqlite:///relative.db, sqlite:////abs/file.db, file:///abs/dir, "
    f"postgresql://…, redis://…). Default: ${URL_ENV}, else the embedded SQLite ledger of "
    "the current project.",
)
@click.pass_context
def main(ctx: click.Context, url: str | None) -> None:
    """Inspect the idempotency ledger and settle uncertain operations.

    An UNCERTAIN record (or a stale PENDING one) is an operation whose effect may or may not
    have happened. Look it up at the provider, then `resolve` it. See docs/recovery.md.
    """
    source = _SOURCES.get(ctx.get_parameter_source("url"), "--ledger")  # type: ignore[arg-type]
    where = _Where(url, source)
    ctx.obj = where
    ctx.call_on_close(where.close)


def _filters(function: Any) -> Any:
    options = [
        click.option(
            "--status",
            type=click.Choice(_STATUSES, case_sensitive=False),
            help="Only records in this status.",
        ),
        click.option("--stale", is_flag=True, help="Only PENDING records whose lease expired."),
        click.option("--needs-operator", is_flag=True, help="Only records flagged for a person."),
        click.option(
            "--tool",
            metavar="NAME",
            help="Only keys of this tool: keys starting NAME: (the default keys, and templates "
            "that start with the tool name). Records do not store the tool itself.",
        ),
        click.option("--prefix", metavar="TEXT", help="Only keys starting with TEXT."),
        click.option(
            "--older-than",
            metavar="AGE",
            help="Only records last updated at least AGE ago (90s, 15m, 2h, 7d).",
        ),
        click.option("--newer-than", metavar="AGE", help="Only records updated less than AGE ago."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _select(where: _Where, filters: dict[str, Any]) -> tuple[Ledger, list[Record], float]:
    from ._record import Status

    older, newer = _duration(filters["older_than"]), _duration(filters["newer_than"])
    status, stale = filters["status"], filters["stale"]
    prefixes = [p for p in (filters["prefix"],) if p is not None]
    if filters["tool"] is not None:
        prefixes.append(f"{filters['tool']}:")
    with _errors(where):
        ledger = where.ledger()
        wanted = Status(status.upper()) if status else (Status.PENDING if stale else None)
        records = ledger.records(wanted)
        now = ledger.backend.now()
        if stale:
            records = [r for r in records if ledger.is_stale(r)]
    if filters["needs_operator"]:
        records = [r for r in records if r.needs_operator]
    for prefix in prefixes:
        records = [r for r in records if r.key.startswith(prefix)]
    if older is not None:
        records = [r for r in records if now - r.updated_at >= older]
    if newer is not None:
        records = [r for r in records if now - r.updated_at < newer]
    return ledger, records, now


@main.command("ls")
@_filters
@click.option("--json", "as_json", is_flag=True, help="One JSON array instead of a table.")
@click.pass_obj
def list_records(where: _Where, as_json: bool, **filters: Any) -> None:
    """List records, oldest update first."""
    from ._record import Status

    ledger, records, now = _select(where, filters)
    if as_json:
        click.echo(
            _machine([json.loads(r.to_json()) | {"stale": ledger.is_stale(r)} for r in records])
        )
        return

    if not records:
        click.echo(f"no records match in {where.label}")
        return
    rows: list[list[str]] = [["KEY", "STATUS", "TOKEN", "OWNER", "UPDATED", "NOTE"]]
    for record in records:
        note = record.error or ""
        if record.status is Status.PENDING:
            verb = "expires" if record.lease_live(now) else "expired"
            note = f"lease {verb} {_ago(now - (record.lease_expires_at or now))}"
        owner = record.owner.label if record.owner else "-"
        age = _ago(now - record.updated_at)
        fields = (record.key, _state(record, now), str(record.token), owner, age, note)
        rows.append([safe(field, lines=False) for field in fields])
    # One line per record, every column whole except the note, which is cut to the terminal.
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    room = max(30, shutil.get_terminal_size((100, 24)).columns - sum(widths) - 2 * 5)
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        note = row[5] if len(row[5]) <= room else row[5][: room - 1] + "…"
        click.echo("  ".join([*cells, note]).rstrip())
    click.echo(f"{len(records)} record(s) in {where.label}")


@main.command("export")
@_filters
@click.pass_obj
def export(where: _Where, **filters: Any) -> None:
    """Every record, with its full history and evidence, as JSON Lines (for audit).

    One JSON object per line, ASCII only: the record as `show --json` gives it, with each
    history event as an object (at, at_utc, kind, token, by, note). Filters as for `ls`.
    """
    import dataclasses

    ledger, records, _ = _select(where, filters)
    for record in records:
        doc = json.loads(record.to_json())
        # Named fields and readable times: an audit trail is read by people and tools alike.
        doc["history"] = [
            dataclasses.asdict(event) | {"at_utc": _stamp(event.at)} for event in record.history
        ]
        doc["stale"] = ledger.is_stale(record)
        click.echo(_machine(doc, None))


@main.command("show")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="The record as JSON.")
@click.pass_obj
def show(where: _Where, key: str, as_json: bool) -> None:
    """Show one record: its state, result, evidence and full history."""
    _check_key(key)
    with _errors(where):
        ledger = where.ledger()
        record = ledger.get(key)
        now = ledger.backend.now()
    if record is None:
        raise click.ClickException(safe(f"no record for idempotency key {key!r} in {where.label}"))
    if as_json:
        click.echo(_machine(json.loads(record.to_json()) | {"stale": ledger.is_stale(record)}))
        return

    from rich.table import Table

    console = _console()
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column(overflow="fold")
    rows: list[tuple[str, str]] = [
        ("key", safe(record.key, lines=False)),
        ("status", _state(record, now)),
        ("token", str(record.token)),
        ("revision", str(record.revision)),
        ("attempts", str(record.attempts)),
        ("owner", safe(record.owner.label, lines=False) if record.owner else "-"),
        ("fingerprint", safe(record.fingerprint or "-", lines=False)),
        ("created", _when(record.created_at, now)),
        ("updated", _when(record.updated_at, now)),
    ]
    if record.lease_expires_at is not None:
        rows.append(("lease expires", _when(record.lease_expires_at, now)))
    if record.expires_at is not None:
        rows.append(("receipt expires", _when(record.expires_at, now)))
    if record.error:
        rows.append(("error", safe(record.error, lines=False)))
    if record.result is not None:
        rows.append((f"result ({_payload_type(record.result)})", _dumps(_payload(record.result))))
    if record.needs_operator:
        rows.append(("needs operator", "yes: two executions may have happened"))
    for name, value in rows:
        facts.add_row(safe(name, lines=False), value)
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
            str(number),
            _stamp(event.at),
            safe(event.kind, lines=False),
            str(event.token),
            safe(event.by, lines=False),
            safe(event.note, lines=False),
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
                safe(f"not JSON ({exc}): {result_json!r}"), param_hint="--result"
            ) from None
    elif result_text is not None:
        result = result_text

    with _errors(where):
        ledger = where.ledger()
        before = ledger.get(key)
        if before is None:
            raise click.ClickException(
                safe(f"no record for idempotency key {key!r} in {where.label}")
            )
        if happened and result_json is None and result_text is None:
            result = _kept_result(before)
        if absent:
            record = ledger.resolve(key, absent=True, by=by, reason=reason)
        else:
            record = ledger.resolve(key, result=result, by=by, reason=reason)

    console = _console()
    if before.needs_operator:
        console.print(
            safe(
                f"note: {key!r} was flagged because two executions may have happened "
                f"({len(before.evidence)} late finisher(s) in its evidence); the evidence "
                "stays on the record"
            )
        )
    if absent:
        console.print(
            safe(f"resolved {key!r} as absent: FAILED; the next attempt runs the operation")
        )
    else:
        replayed = json.dumps(_payload(record.result), ensure_ascii=False)
        console.print(
            safe(
                f"resolved {key!r} as happened: COMMITTED (token {record.token}); every later "
                f"call replays {replayed}"
            )
        )


def _kept_result(record: Record) -> Any:
    if record.result is None:
        raise click.UsageError(
            safe(
                f"{record.key!r} has no stored result to keep; give the provider's receipt "
                "with --result JSON or --result-text TEXT"
            )
        )
    from ._results import unrestorable

    missing = unrestorable(record.result)
    if missing:
        # Kept as it is, it would be stored again as plain data: the type would be lost.
        raise click.UsageError(
            safe(
                f"the stored result holds {', '.join(sorted(set(missing)))}, which cannot be "
                "imported here; give the receipt with --result JSON, or run resolve where "
                "that class is importable"
            )
        )
    return record.value()


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
    with _errors(where):
        removed = where.ledger().purge(expired_only=not everything)
    click.echo(f"purged {removed} record(s) from {where.label}")


@main.command("doctor")
@click.option(
    "--self-test",
    "self_test",
    is_flag=True,
    help="Run the guard's own checks (every execution path, every retry source) against "
    "the installed crewai, offline with a scripted model, and report pass/fail.",
)
@click.pass_obj
def doctor(where: _Where, self_test: bool) -> None:
    """Which ledger is in effect and why, its files and their modes, whether it answers
    and how durable it is, whether this crewai is supported and the integration active.

    Exit status 1 when something needs fixing (or a self-test check fails). Never creates
    a ledger.
    """
    if self_test:
        from ._doctor import self_test_report

        lines, problems = self_test_report()
        for line in lines:
            click.echo(safe(line))
        if problems:
            click.echo(f"{problems} self-test check(s) failed", err=True)
            sys.exit(1)
        return
    from ._doctor import report

    lines, problems = report(where)
    for line in lines:
        click.echo(safe(where.scrub(line)))
    if problems:
        click.echo(f"{problems} problem(s) found", err=True)
        sys.exit(1)


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


from ._cli_gates import register  # noqa: E402 - its commands attach to `main`, defined above

register(main)

if __name__ == "__main__":  # `python -m crewai_idempotent.cli`
    main(prog_name="crewai-idempotent")
