"""The ledger's records: `ls`, `export`, `show`, `resolve`, `purge`."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import shutil
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click

from .. import Ledger, LedgerUnavailable, Record, Status
from ..gates._approvals import KIND as APPROVALS
from ..gates._gatestore import PREFIX, is_document
from ..gates._spend import KIND as SPEND
from ..ledger._ledger import streamed
from ..ledger._results import describe, unrestorable
from ..ledger._select import Order, Select
from ..notifications._outbox import OUTBOX, is_entry
from ._gates import TYPED_NAME_REFUSED
from ._keys import load_signing, signing_key_option
from ._output import (
    ago,
    check_key,
    console,
    dumps,
    duration,
    ledger_errors,
    machine,
    machine_array,
    safe,
    stamp,
    when,
)
from ._where import Where

if TYPE_CHECKING:
    pass

_STATUSES = ("pending", "committed", "failed", "uncertain")


def _lease_left(ledger: Ledger, record: Record, now: float) -> float | None:
    """Seconds left on a PENDING record's lease, by the clock the ledger judges it with
    (the host's, on an embedded ledger); None for a live lease another host holds, which
    this host cannot judge (a ledger folder shared between hosts)."""
    try:
        return record.lease_left(now, ledger.backend.host_clock)
    except LedgerUnavailable:
        return None


def _state(ledger: Ledger, record: Record, now: float) -> str:
    """The status as an operator needs to read it."""
    status = record.status.value
    if record.status is Status.PENDING:
        left = _lease_left(ledger, record, now)
        if left is None:
            return f"{status} (held on another host)"
        return status if left > 0 else f"{status} (stale)"
    if record.needs_operator:
        return f"{status} (needs operator)"
    return status


def is_stale(ledger: Ledger, record: Record, now: float) -> bool:
    if record.status is not Status.PENDING:
        return False
    left = _lease_left(ledger, record, now)
    return left is not None and left <= 0


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


def _query(filters: dict[str, Any], now: float, order: Order) -> Select | None:
    """The one `Select` the filters make, judged at the store's time `now`; None when no
    record can match (two prefixes that exclude each other, --stale with another status).
    --stale selects the PENDING records: their leases are judged by the caller."""
    older, newer = duration(filters["older_than"]), duration(filters["newer_than"])
    status, stale = filters["status"], filters["stale"]
    wanted = Status(status.upper()) if status else (Status.PENDING if stale else None)
    if stale and wanted is not Status.PENDING:
        return None
    prefix = ""
    for given in (filters["prefix"], None if filters["tool"] is None else f"{filters['tool']}:"):
        if given is None or prefix.startswith(given):
            continue
        if not given.startswith(prefix):
            return None  # "a:" and "b:": no key starts with both
        prefix = given
    # "At least AGE ago" is at or before now - AGE: the least time after it is the bound.
    before = None if older is None else math.nextafter(now - older, math.inf)
    since = None if newer is None else math.nextafter(now - newer, math.inf)
    return Select(
        status=wanted, needs_operator=filters["needs_operator"], prefix=prefix,
        updated_from=since, updated_before=before, order=order,
    )  # fmt: skip


def _select(
    where: Where, filters: dict[str, Any], order: Order, entries: bool = True
) -> tuple[Ledger, Iterator[Record], float]:
    """The ledger, the records `filters` pick in `order` (streamed from the store's
    indexes: iterate them inside `ledger_errors`, where a read that fails is said as the
    others are), and the store's time the filters were judged by. `Order.KEY` is read in
    the store's own order (`streamed`), for a reader that takes every record."""
    with ledger_errors(where.scrub):
        ledger = where.ledger()
        now = ledger.backend.now()
    query = _query(filters, now, order)
    if query is None:
        return ledger, iter(()), now
    # The outbox's entries have their own command (`notifications ls`); a --prefix that
    # names them shows them here too.
    hide_entries = not entries and not (
        query.prefix.startswith(OUTBOX[: len(query.prefix)]) and len(query.prefix) > len(PREFIX)
    )
    stale = filters["stale"]
    found = ledger.select(query) if order is not Order.KEY else streamed(ledger.backend, query)

    def shown(record: Record) -> bool:
        if stale and not is_stale(ledger, record, now):
            return False
        return not (hide_entries and is_entry(record))

    return ledger, filter(shown, found), now


#: Rows of an `ls` table laid out at once: its columns are as wide as the widest cell so
#: far, so the table streams with flat memory (a wider cell later widens the next rows).
_CHUNK = 200


@click.command("ls")
@_filters
@click.option(
    "--json", "as_json", is_flag=True, help="One JSON array instead of a table (streamed)."
)
@click.pass_obj
def list_records(where: Where, as_json: bool, **filters: Any) -> None:
    """List records, oldest update first (the outbox's entries: `notifications ls`).

    Streamed from the store's index of updates: the table is laid out a few hundred rows
    at a time, each column as wide as its widest cell so far."""
    ledger, found, now = _select(where, filters, Order.OLDEST, entries=False)
    with ledger_errors(where.scrub):
        if as_json:
            rows = (json.loads(r.to_json()) | {"stale": is_stale(ledger, r, now)} for r in found)
            for text in machine_array(rows):
                click.echo(text, nl=False)
            click.echo()
            return
        count = _table(ledger, found, now)
    if not count:
        click.echo(f"no records match in {where.label}")
        return
    click.echo(f"{count} record(s) in {where.label}")


def _table(ledger: Ledger, records: Iterator[Record], now: float) -> int:
    """Print `records` as `ls`'s table, a chunk at a time; how many there were. One line
    per record, every column whole except the note, which is cut to the terminal."""
    header = ["KEY", "STATUS", "TOKEN", "OWNER", "UPDATED", "NOTE"]
    widths = [len(name) for name in header[:5]]
    columns = shutil.get_terminal_size((100, 24)).columns
    count = 0
    while True:
        chunk = [_row(ledger, record, now) for record in itertools.islice(records, _CHUNK)]
        if not chunk:
            return count
        if not count:
            chunk.insert(0, header)
        widths = [max(widths[i], *(len(row[i]) for row in chunk)) for i in range(5)]
        room = max(30, columns - sum(widths) - 2 * 5)
        for row in chunk:
            cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
            note = row[5] if len(row[5]) <= room else row[5][: room - 1] + "…"
            click.echo("  ".join([*cells, note]).rstrip())
        count += len(chunk) - (0 if count else 1)


def _row(ledger: Ledger, record: Record, now: float) -> list[str]:
    note = record.error or ""
    if record.status is Status.PENDING:
        left = _lease_left(ledger, record, now)
        if left is None:
            note = "lease renewed by another host: this ledger is shared between hosts"
        else:
            note = f"lease {'expires' if left > 0 else 'expired'} {ago(-left)}"
    owner = record.owner.label if record.owner else "-"
    age = ago(now - record.updated_at)
    fields = (record.key, _state(ledger, record, now), str(record.token), owner, age, note)
    return [safe(field, lines=False) for field in fields]


@click.command("export")
@_filters
@click.pass_obj
def export(where: Where, **filters: Any) -> None:
    """Every record, with its full history and evidence, as JSON Lines (for audit).

    One JSON object per line, ASCII only: the record as `show --json` gives it, with each
    history event as an object (at, at_utc, kind, token, by, note), and its history's
    chain and signed decisions, so that `verify --export` checks it on any machine.
    Filters as for `ls`. Streamed in the store's order (the key's), so its memory stays
    flat however large the ledger is.
    """
    ledger, records, _ = _select(where, filters, Order.KEY)
    # Streamed: one record is written before the next is read, so an export of millions
    # holds one batch of the store's read.
    with ledger_errors(where.scrub):
        for record in records:
            doc = json.loads(record.to_json())
            # Named fields and readable times: an audit trail is read by people and tools.
            doc["history"] = [
                dataclasses.asdict(event) | {"at_utc": stamp(event.at)} for event in record.history
            ]
            doc["stale"] = ledger.is_stale(record)
            click.echo(machine(doc, None))


@click.command("show")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="The record as JSON.")
@click.pass_obj
def show(where: Where, key: str, as_json: bool) -> None:
    """Show one record: its state, result, evidence and full history."""
    check_key(key)
    with ledger_errors(where.scrub):
        ledger = where.ledger()
        record = ledger.get(key)
        now = ledger.backend.now()
    if record is None:
        raise click.ClickException(safe(f"no record for idempotency key {key!r} in {where.label}"))
    if as_json:
        click.echo(machine(json.loads(record.to_json()) | {"stale": is_stale(ledger, record, now)}))
        return

    # rich's tables cost start-up time that the other commands need not pay.
    from rich.table import Table

    out = console()
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column(overflow="fold")
    rows: list[tuple[str, str]] = [
        ("key", safe(record.key, lines=False)),
        ("status", _state(ledger, record, now)),
        ("token", str(record.token)),
        ("revision", str(record.revision)),
        ("attempts", str(record.attempts)),
        ("owner", safe(record.owner.label, lines=False) if record.owner else "-"),
        ("fingerprint", safe(record.fingerprint or "-", lines=False)),
        ("created", when(record.created_at, now)),
        ("updated", when(record.updated_at, now)),
    ]
    if record.lease_expires_at is not None:
        # The wall-clock time people read; "in"/"ago" by the clock the lease is judged by.
        left = _lease_left(ledger, record, now) if record.status is Status.PENDING else None
        lease = when(record.lease_expires_at, now)
        if left is not None:
            lease = f"{stamp(record.lease_expires_at)} ({ago(-left)})"
        rows.append(("lease expires", lease))
    if record.expires_at is not None:
        rows.append(("receipt expires", when(record.expires_at, now)))
    if record.error:
        rows.append(("error", safe(record.error, lines=False)))
    if record.result is not None:
        what, data = describe(record.result)
        rows.append((f"result ({what})", dumps(data)))
    if record.needs_operator:
        rows.append(("needs operator", "yes: two executions may have happened"))
    call = record.call or {}
    if call:  # what a sweeper asks with (`crewai-idempotent reconcile`)
        said = [f"{k} {call[k]}" for k in ("tool", "reconciler") if call.get(k)]
        # A tool without a reconciler of its own records its name, not its arguments.
        recorded = ["arguments recorded"] if "args" in call else []
        rows.append(("reconcile", safe(", ".join([*said, *recorded]), lines=False)))
    if record.reconciling is not None and record.reconciling[1] > now:
        rows.append(("being asked", safe(f"by {record.reconciling[0]}", lines=False)))
    for name, value in rows:
        facts.add_row(safe(name, lines=False), value)
    out.print(facts)

    if record.evidence:
        out.print()
        out.print(f"evidence ({len(record.evidence)} late finisher(s))", style="bold")
        for number, item in enumerate(record.evidence, 1):
            shown = dict(item)
            if "result" in shown:
                shown["result"] = describe(shown["result"])[1]
            if isinstance(shown.get("at"), int | float):
                shown["at"] = stamp(shown["at"])
            out.print(f"{number}. {dumps(shown)}")

    out.print()
    history = Table(title="history", title_justify="left", box=None, header_style="bold")
    for name in ("#", "AT (UTC)", "EVENT", "TOKEN", "BY"):
        history.add_column(name, no_wrap=True)
    history.add_column("NOTE", overflow="fold")
    for number, event in enumerate(record.history, 1):
        history.add_row(
            str(number),
            stamp(event.at),
            safe(event.kind, lines=False),
            str(event.token),
            safe(event.by, lines=False),
            safe(event.note, lines=False),
        )
    out.print(history)


@click.command("resolve")
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
@signing_key_option("the resolution")
@TYPED_NAME_REFUSED
@click.pass_obj
def resolve(
    where: Where,
    key: str,
    happened: bool,
    absent: bool,
    result_json: str | None,
    result_text: str | None,
    reason: str,
    key_file: str | None,
) -> None:
    """Settle an UNCERTAIN (or stale PENDING) record after checking the provider. The
    resolution is recorded as yours (user@host), as an approval is.

    --happened: the record becomes COMMITTED and --result/--result-text is replayed to every
    later call (without either, the result already stored on the record is kept, if any).
    --absent: the record becomes FAILED and the next attempt runs the operation.

    --key FILE (or $CREWAI_IDEMPOTENCY_SIGNING_KEY): the resolution is signed with that key,
    as its identity, and workers with trusted keys obey it only if they trust the key for
    resolve. A signed resolution may also replace one they refuse (an unsigned one). With
    $CREWAI_IDEMPOTENCY_TRUSTED_KEYS set, a resolution those keys would refuse is refused
    here, before anything is written.
    """
    check_key(key)
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
    signer, trusted = load_signing(key_file)

    with ledger_errors(where.scrub):
        ledger = where.ledger()
        if trusted is not None:
            ledger.trusted_keys = trusted
        before = ledger.get(key)
        if before is None:
            raise click.ClickException(
                safe(f"no record for idempotency key {key!r} in {where.label}")
            )
        if happened and result_json is None and result_text is None:
            result = _kept_result(before)
        signed: dict[str, Any] = {"signer": signer, "via": "cli"} if signer else {}
        if absent:
            record = ledger.resolve(key, absent=True, reason=reason, **signed)
        else:
            record = ledger.resolve(key, result=result, reason=reason, **signed)

    out = console()
    if before.needs_operator:
        out.print(
            safe(
                f"note: {key!r} was flagged because two executions may have happened "
                f"({len(before.evidence)} late finisher(s) in its evidence); the evidence "
                "stays on the record"
            )
        )
    if signer is not None:
        out.print(safe(f"signed by {signer.identity} (key {signer.key_id})"))
    if absent:
        out.print(safe(f"resolved {key!r} as absent: FAILED; the next attempt runs the operation"))
    else:
        replayed = json.dumps(describe(record.result)[1], ensure_ascii=False)
        out.print(
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


@click.command("build-indexes")
@click.option(
    "--rescan",
    is_flag=True,
    help="Redis: walk every record again, for a ledger the previous release went on "
    "writing after its indexes were complete.",
)
@click.pass_obj
def build_indexes(where: Where, rescan: bool) -> None:
    """Build the listing indexes of a ledger an earlier version made, now, and wait for them.

    SQLite and PostgreSQL build them in the background (claims go on meanwhile) when this
    version first opens such a ledger: this waits for that, or does it. Redis fills them
    only when asked: run this once no worker of the previous release writes the ledger.
    Until they are complete, listings answer right by reading more of the ledger.
    """
    with ledger_errors(where.scrub):
        backend = where.ledger().backend
        ready = getattr(backend, "indexes_ready", None)
        if not callable(ready):
            click.echo(f"{where.label} keeps no listing indexes to build (docs/backends.md)")
            return
        if rescan and not hasattr(backend, "backfill_indexes"):
            raise click.UsageError("--rescan is for a Redis ledger")
        if ready() and not rescan:
            click.echo(f"the listing indexes of {where.label} are complete")
            return
        click.echo(f"building the listing indexes of {where.label} (claims go on meanwhile)")
        backfill = getattr(backend, "backfill_indexes", None)
        if backfill is not None:
            done = backfill(rescan=rescan)
        else:
            done = backend.build_indexes()  # type: ignore[attr-defined]
            while not done:
                time.sleep(1.0)  # another process holds the build: wait for it to finish
                done = ready()
    if not done:
        raise click.ClickException(
            "the indexes are not complete: a worker of the previous release is still "
            f"writing this ledger; run {where.command('build-indexes')} again once none does"
        )
    click.echo(f"the listing indexes of {where.label} are complete")


@click.command("purge")
@click.option(
    "--all",
    "everything",
    is_flag=True,
    help="Also COMMITTED records whose TTL has not passed, and FAILED ones.",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (with --all).")
@click.pass_obj
def purge(where: Where, everything: bool, yes: bool) -> None:
    """Delete COMMITTED records whose TTL has passed (never PENDING or UNCERTAIN ones).

    With --all, every COMMITTED and FAILED record goes, and with them the approval
    requests, spend-cap budgets and notifications the ledger keeps as records: the
    confirmation counts each."""
    if everything and not yes:
        with ledger_errors(where.scrub):
            counts = _purgeable(where.ledger())
        click.confirm(_purge_warning(where, counts), abort=True, err=True)
    with ledger_errors(where.scrub):
        removed = where.ledger().purge(expired_only=not everything)
    click.echo(f"purged {removed} record(s) from {where.label}")


def _purgeable(ledger: Ledger) -> dict[str, int]:
    """What `purge --all` would delete, by kind: receipts and failures, approval
    requests, spend-cap windows, notifications, the console's accounts. Read as the purge
    reads them, the COMMITTED and then the FAILED records, streamed: the question costs
    what the purge deletes, never the PENDING or UNCERTAIN records it keeps."""
    counts = {"receipts": 0, "approvals": 0, "spend": 0, "notifications": 0, "console": 0}
    for status in (Status.COMMITTED, Status.FAILED):
        for record in streamed(ledger.backend, Select(status=status)):
            if is_entry(record):
                counts["notifications"] += 1
            elif not is_document(record):
                counts["receipts"] += 1
            elif record.key.startswith(PREFIX + APPROVALS):
                counts["approvals"] += 1
            elif record.key.startswith(PREFIX + SPEND):
                counts["spend"] += 1
            elif record.key.startswith(PREFIX + "console/"):
                counts["console"] += 1
    return counts


def _purge_warning(where: Where, counts: dict[str, int]) -> str:
    return (
        f"--all deletes, from {where.label}: {counts['receipts']} COMMITTED and FAILED "
        "record(s), whose receipts are lost (a retry of any of those operations runs it "
        f"again); {counts['approvals']} approval request(s) with their decisions (approved "
        f"calls ask again); {counts['spend']} spend-cap budget(s), with the spend counted so "
        f"far (the caps start again from zero); and {counts['notifications']} notification(s) "
        "of the outbox, with their deliveries (those not yet delivered never will be)"
        + (
            "; the web console's accounts and sessions too (nobody can log in to it until "
            "accounts are added again)"
            if counts["console"]
            else ""
        )
        + ". Continue?"
    )
