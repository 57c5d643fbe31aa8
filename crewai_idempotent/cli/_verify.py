"""`crewai-idempotent verify`: is every record's history what was written?

    crewai-idempotent verify                               # the whole ledger
    crewai-idempotent verify pay:inv-1                     # one key
    crewai-idempotent verify --export ledger.jsonl         # an export, on any machine
    crewai-idempotent verify --trusted-keys /etc/crewai/trusted_keys
    crewai-idempotent verify --against last-month.jsonl    # today's must extend it
    crewai-idempotent verify --since 2025-03-01T00:00:00Z  # accept unchained before then

Each record's history is a hash chain (`ledger/_chain`): every event an editor of the
ledger changed, removed, inserted or moved without recomputing the digests after it is
named, with its key. `--trusted-keys` also checks every signed decision (a resolution)
against keys trusted outside the ledger, and says where a resolution is unsigned.
`--against` an earlier export catches what a chain alone cannot: a history rewritten
with every digest recomputed (anyone who can write the ledger can), a record deleted
while its outcome was open. `--since` accepts records, or the first part of them, that
were written unchained (by the release before chains, during a rolling upgrade) before
a time; without it they are reported.

The ledger is streamed in its store's batches, so memory stays flat however large it is;
`--against` keeps one short entry per key of the earlier export. Exit status: 0 every
history verifies, 1 a history does not (each key named, with what was wrong), 2 bad
usage.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import pydantic_core

from .._errors import DecisionRefused, SigningConfigurationError
from ..ledger._chain import Chain, Problem, check, events_of, seq_of
from ..ledger._record import HISTORY_LIMIT
from ._output import ledger_errors, safe
from ._where import Where

if TYPE_CHECKING:
    from ..signing._trusted import TrustedKeys

# What a record's history is compared by with an earlier export: its status, the digest
# of its first event, the sequence number and digest of its last, and of its cut's anchor.
_Kept = tuple[str, str, int, str]

# The events that make a resolution, and the kinds of decision each may carry.
_RESOLVING = {
    "resolve": ("resolve-found", "resolve-absent"),
    "absent": ("resolve-absent",),
    "reconcile": ("resolve-found",),
}


def _time(value: str | None) -> float | None:
    """--since: ISO 8601 (a time without a zone is UTC) or seconds since the epoch."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if math.isfinite(seconds):
            return seconds
    try:
        when = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(
            f"not a time (2025-03-01, 2025-03-01T12:00:00Z, or seconds since the epoch): {value!r}",
            param_hint="--since",
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def _lines(path: str, what: str) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """The records of an export file, one per line (None for a line that is not one)."""
    try:
        handle = Path(path).expanduser().open("rb")
    except OSError as exc:
        raise click.ClickException(safe(f"cannot read {what} {path}: {exc.strerror}")) from None
    with handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                doc = pydantic_core.from_json(line, allow_inf_nan=True)
            except ValueError:
                yield number, None
                continue
            yield number, doc if isinstance(doc, dict) and isinstance(doc.get("key"), str) else None


def _kept(doc: dict[str, Any]) -> _Kept | None:
    """What `--against` keeps of a record of the earlier export (None: it has no chain)."""
    try:
        chain = Chain.of(doc)
        events = events_of(doc)
    except ValueError:
        return None
    if chain is None or not chain.digests or len(chain.digests) != len(events):
        return None
    last = seq_of(len(events) - 1, chain.cut)
    return (str(doc.get("status")), chain.digests[0], last, chain.digests[-1])


def _against(doc: dict[str, Any], old: _Kept) -> tuple[list[Problem], list[str]]:
    """Whether the history the earlier export held (`old`) is where today's began."""
    status, first, last, head = old
    try:
        chain = Chain.of(doc)
        events = events_of(doc)
    except ValueError:
        return [], []  # `check` reports it
    if chain is None or len(chain.digests) != len(events) or not events:
        if chain is None and events:
            problem = "its chain is gone since the earlier export, which had one: stripped"
            return [Problem("unchained", problem)], []
        return [], []
    if chain.digests[0] != first:
        if status in ("COMMITTED", "FAILED"):
            return [], ["its history began anew since the earlier export (purged, used again)"]
        return [
            Problem(
                "rewritten",
                f"its history is not the one the earlier export holds (which was {status}: a "
                "record purge never deletes): replaced",
            )
        ], []
    cut = chain.cut
    places = {seq_of(index, cut): index for index in range(len(events))}
    if last in places:
        if chain.digests[places[last]] == head:
            return [], []
        return [
            Problem(
                "rewritten",
                f"its first {last + 1} events differ from the earlier export's, though each "
                "digest agrees with its event: rewritten and recomputed",
            )
        ], []
    newest = seq_of(len(events) - 1, cut)
    if last > newest:
        return [
            Problem(
                "truncated",
                f"the earlier export holds {last + 1} events of it, today's history "
                f"{newest + 1}: events removed, with their digests",
            )
        ], []
    if cut is not None and last == cut[0]:
        if cut[1] == head:
            return [], []
        return [
            Problem("rewritten", f"its first {last + 1} events differ from the earlier export's")
        ], []
    return [], [
        "the history limit has cut it past the end of the earlier export's copy: compared at "
        "its first event only"
    ]


def _signatures(doc: dict[str, Any], trusted: TrustedKeys, since: float | None) -> list[Problem]:
    """Every decision signed with an event: trusted, verified, about this record and
    event; and every resolution without one (unless made before `since`)."""
    from ..signing._decision import Decision, receipt_digest
    from ..signing._verify import verify

    try:
        chain = Chain.of(doc)
        events = events_of(doc)
    except ValueError:
        return []  # `check` reports it
    if chain is None:
        return []
    key = doc["key"]
    cut = chain.cut
    at_seq = {seq_of(index, cut): (index, event) for index, event in enumerate(events)}
    attached = {seq: (decision, signature) for seq, decision, signature in chain.signed}
    problems = []
    for seq, (index, event) in at_seq.items():
        kinds = _RESOLVING.get(event.kind)
        entry = attached.get(seq)
        name = f"event #{index + 1} ({event.kind} by {event.by})"
        if entry is None:
            marked = chain.resolved == seq
            resolving = event.kind in ("resolve", "absent") or marked
            if resolving and (since is None or event.at >= since):
                problems.append(
                    Problem("unsigned", f"{name} is a resolution that carries no signature")
                )
            continue
        decision_doc, signature = entry
        try:
            verify(decision_doc, signature, trusted)
        except DecisionRefused as refused:
            problems.append(Problem("signature", f"{name}: {refused.reason}: {refused.detail}"))
            continue
        decision = Decision.from_json(decision_doc)
        wrong = None
        if kinds is None or decision.kind not in kinds:
            wrong = f"a {decision.kind} decision does not go with a {event.kind} event"
        elif decision.key != key:
            wrong = f"it settles idempotency key {decision.key!r}"
        elif decision.token != event.token:
            wrong = f"it settles token {decision.token}, the event is under {event.token}"
        elif (
            chain.resolved == seq
            and decision.receipt is not None
            and doc.get("status") == "COMMITTED"
            and decision.receipt != receipt_digest(doc.get("result"))
        ):
            wrong = "the receipt stored is not the one it signed"
        if wrong is not None:
            problems.append(
                Problem("subject", f"{name}: its signed decision is about something else: {wrong}")
            )
    return problems


@click.command("verify")
@click.argument("key", required=False)
@click.option(
    "--export",
    "export_file",
    metavar="FILE",
    help="Verify this export (`crewai-idempotent export` JSON Lines) instead of a ledger.",
)
@click.option(
    "--trusted-keys",
    "trusted_file",
    metavar="FILE",
    help="Also check every signed resolution against these keys, and report unsigned ones.",
)
@click.option(
    "--since",
    metavar="TIME",
    help="Accept what was written unchained (or unsigned) before TIME: the end of a rolling "
    "upgrade (2025-03-01T12:00:00Z, or seconds since the epoch). It trusts the times the "
    "records carry.",
)
@click.option(
    "--against",
    "against_file",
    metavar="OLD_EXPORT",
    help="An earlier export: each history it holds must be where today's began.",
)
@click.pass_obj
def verify(
    where: Where,
    key: str | None,
    export_file: str | None,
    trusted_file: str | None,
    since: str | None,
    against_file: str | None,
) -> None:
    """Check that every record's history is what was written: each key whose history was
    edited, truncated, reordered or re-signed is named, with what was wrong (exit 1).

    A chain alone cannot tell a history rewritten with every digest recomputed: keep
    exports, and check today's ledger --against one of them. See docs/recovery.md.
    """
    after = _time(since)
    trusted = None
    if trusted_file is not None:
        from ..signing._trusted import TrustedKeys

        try:
            trusted = TrustedKeys.from_file(trusted_file)
        except SigningConfigurationError as exc:
            raise click.ClickException(safe(str(exc))) from None
    older: dict[str, _Kept | None] = {}
    if against_file is not None:
        for number, doc in _lines(against_file, "the earlier export"):
            if doc is None:
                raise click.ClickException(
                    safe(f"{against_file} line {number} is not a record of an export")
                )
            if key is None or doc["key"] == key:
                older[doc["key"]] = _kept(doc)

    checked = broken = 0
    label = safe(export_file) if export_file is not None else where.label

    def judge(doc: dict[str, Any]) -> None:
        nonlocal checked, broken
        checked += 1
        problems = check(doc, since=after, limit=HISTORY_LIMIT)
        notes: list[str] = []
        if trusted is not None:
            problems += _signatures(doc, trusted, after)
        if against_file is not None:
            old = older.pop(doc["key"], None)
            if old is not None:
                more, notes = _against(doc, old)
                problems += more
        name = safe(repr(doc["key"]), lines=False)
        for note in notes:
            click.echo(f"note: {name}: {safe(note, lines=False)}")
        if problems:
            broken += 1
            for problem in problems:
                click.echo(f"{name}: {problem.kind}: {safe(problem.detail, lines=False)}")

    if export_file is not None:
        for number, doc in _lines(export_file, "the export"):
            if doc is None:
                broken += 1
                click.echo(f"{safe(export_file)} line {number}: malformed: not a record")
            elif key is None or doc["key"] == key:
                judge(doc)
    else:
        with ledger_errors(where.scrub):
            ledger = where.ledger()
            records = ledger.scan() if key is None else iter([ledger.get(key)])
            for record in records:
                if record is not None:
                    judge(pydantic_core.from_json(record.to_json(), allow_inf_nan=True))
    if key is not None and checked == 0:
        raise click.ClickException(safe(f"no record for idempotency key {key!r} in {label}"))
    for gone, old in older.items():
        if old is None:
            continue
        name = safe(repr(gone), lines=False)
        if old[0] in ("PENDING", "UNCERTAIN"):
            broken += 1
            click.echo(
                f"{name}: deleted: the earlier export holds it {old[0]}, and it is gone (a purge "
                "never deletes an open outcome; without its record, the next call runs again)"
            )
        else:
            click.echo(f"note: {name}: gone since the earlier export (purged)")
    said = f"verified {checked} record(s) of {label}"
    if broken:
        click.echo(f"{said}: {broken} with a history that does not verify", err=True)
        click.get_current_context().exit(1)
    click.echo(f"{said}: every history verifies", err=True)
