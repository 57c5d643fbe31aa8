"""`crewai-idempotent notify` (the dispatcher) and `crewai-idempotent notifications ls /
show` (the outbox and every delivery try). See docs/notifications.md."""

from __future__ import annotations

import itertools
import json
import shlex
import signal
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import click

from .._errors import LedgerConfigurationError
from .._units import ago
from ..notifications._outbox import Entry, Outbox, check_id
from ._output import duration, ledger_errors, machine, machine_array, safe, stamp
from ._where import Where

if TYPE_CHECKING:
    from ..notifications._channels import Channel


def _seconds(value: str, name: str) -> float:
    seconds = duration(value)
    if seconds is None or seconds <= 0:
        raise click.BadParameter(
            f"{value!r} is not a positive duration (2s, 1m, 1h)", param_hint=name
        )
    return seconds


def channels_given(channels: tuple[str, ...]) -> tuple[Channel, ...]:
    """The channels `--channel` names, else `CREWAI_IDEMPOTENCY_NOTIFY`'s (the console
    finds its own the same way). A channel that cannot work is a usage error naming where
    it came from: `--channel`, or the variable (which the user never passed as an option)."""
    from ..notifications._channels import ENV, channels_from, env_channels

    if channels:
        try:
            return channels_from(list(channels), "--channel")
        except (LedgerConfigurationError, TypeError) as exc:
            raise click.BadParameter(safe(str(exc)), param_hint="--channel") from None
    try:
        return env_channels()
    except (LedgerConfigurationError, TypeError) as exc:
        raise click.UsageError(
            safe(
                f"${ENV} names a channel that cannot work: {exc}; fix the variable, or give "
                "--channel URL instead"
            )
        ) from None


@click.command("notify")
@click.option(
    "--channel",
    "channels",
    multiple=True,
    metavar="URL",
    help="A channel (webhook+https://..., slack+https://..., apprise+...); repeat for more. "
    "Default: $CREWAI_IDEMPOTENCY_NOTIFY.",
)
@click.option("--watch", is_flag=True, help="Keep delivering until stopped (SIGTERM, Ctrl-C).")
@click.option("--poll", default="1s", show_default=True, help="Time between passes.")
@click.option("--lease", default="60s", show_default=True, help="How long a claim holds an entry.")
@click.option("--backoff", default="2s", show_default=True, help="The first retry's pause.")
@click.option("--backoff-max", default="1h", show_default=True, help="The longest pause.")
@click.option("--name", metavar="NAME", help="This dispatcher's name in claims and logs.")
@click.pass_obj
def notify(
    where: Where,
    channels: tuple[str, ...],
    watch: bool,
    poll: str,
    lease: str,
    backoff: str,
    backoff_max: str,
    name: str | None,
) -> None:
    """Deliver the outbox to its channels: one pass, or until stopped with --watch.

    At least once to every channel, with the entry's id as the delivery id, one
    dispatcher per entry at a time however many run (on any host); a failed try is tried
    again later. Each delivery and failed try is printed, and kept: `notifications ls`."""
    from ..notifications._channels import ENV
    from ..notifications._dispatch import Dispatcher

    found = channels_given(channels)
    if not found:
        raise click.UsageError(f"no channel to deliver to: give --channel URL or set {ENV}")

    def said(event: str, entry: Entry) -> None:
        if event in ("sent", "failed", "void", "delivered"):
            click.echo(safe(_event_line(event, entry)), err=event == "failed")

    with ledger_errors(where.scrub):
        backend = where.ledger().backend
        try:
            dispatcher = Dispatcher(
                backend, found, poll_s=_seconds(poll, "--poll"), lease_s=_seconds(lease, "--lease"),
                backoff_s=_seconds(backoff, "--backoff"),
                backoff_max_s=_seconds(backoff_max, "--backoff-max"), name=name, listener=said,
            )  # fmt: skip
        except ValueError as exc:
            raise click.UsageError(safe(str(exc))) from None
        names = ", ".join(f"{c.name} ({c.url})" for c in found)
        click.echo(safe(f"dispatcher {dispatcher.name}: {where.label} to {names}"), err=True)
        if not watch:
            done = dispatcher.run_once()
            dispatcher.close()
            click.echo(
                f"{done.sent} delivered, {done.failed} failed, {done.pending} not yet "
                f"delivered, {done.waiting} waiting for their transition"
            )
            return
        stop = threading.Event()

        def end(signum: int, frame: Any) -> None:
            stop.set()
            dispatcher.wake()

        previous = signal.signal(signal.SIGTERM, end)
        try:
            dispatcher.run(stop)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
            dispatcher.close()


def _event_line(event: str, entry: Entry) -> str:
    # For "sent" and "failed" the dispatcher hands the entry as it stood after the try the
    # event is about: the last one in its log.
    if event == "failed":
        last = entry.log[-1] if entry.log else {}
        waits = [d for d in entry.deliveries if d.channel == last.get("channel")]
        after = ""
        if waits and waits[0].next_at is not None and last.get("at") is not None:
            after = f"; next try {ago(float(last['at']) - waits[0].next_at)}"
        return (
            f"failed {entry.id} {entry.type} to {last.get('channel')} (try "
            f"{last.get('attempt')}): {last.get('error')}{after}"
        )
    if event == "sent":
        last = entry.log[-1] if entry.log else {}
        return f"sent {entry.id} {entry.type} to {last.get('channel')}: {entry.summary}"
    if event == "void":
        return f"void {entry.id} {entry.type}: its transition never happened"
    return f"delivered {entry.id} {entry.type} to every channel"


@click.group("notifications")
def notifications() -> None:
    """The outbox: what needs a person, and how each delivery went."""


_STATES = ("pending", "delivered", "failing", "waiting", "all")


@notifications.command("ls")
@click.option(
    "--state",
    type=click.Choice(_STATES, case_sensitive=False),
    default="all",
    show_default=True,
    help="pending: not yet delivered everywhere; failing: a try failed and none succeeded "
    "since; waiting: written before a transition that has not happened (yet).",
)
@click.option("--type", "type_", metavar="PATTERN", help="Only types matching (approval.*).")
@click.option(
    "--limit",
    default=50,
    show_default=True,
    type=click.IntRange(0),
    help="Delivered entries shown at most, the last delivered first (0: every one).",
)
@click.option(
    "--after",
    metavar="ENTRY_ID",
    help="Only the delivered entries delivered before this one (the next page).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON array instead of a table.")
@click.pass_obj
def list_notifications(
    where: Where, state: str, type_: str | None, limit: int, after: str | None, as_json: bool
) -> None:
    """The outbox's entries, each with its channels' deliveries: those not yet moved out
    (to deliver, failing, waiting; a granted approval until its grant ends) oldest first,
    then the delivered ones, the last delivered first, --limit at a time (kept until a
    dispatcher prunes them, 30 days by default)."""
    import fnmatch

    wanted = state.lower()
    if after is not None:
        try:
            check_id(after)
        except ValueError as exc:
            raise click.BadParameter(safe(str(exc)), param_hint="--after") from None
        if wanted not in ("all", "delivered"):
            raise click.UsageError("--after pages the delivered entries: --state delivered")

    def kept(entry: Entry) -> bool:
        if type_ and not fnmatch.fnmatchcase(entry.type, type_):
            return False
        if wanted == "waiting":
            return entry.state == "waiting"
        if wanted == "pending":
            return entry.undelivered
        if wanted == "delivered":
            return entry.state == "delivered"
        return not (wanted == "failing" and not entry.failing)

    with ledger_errors(where.scrub):
        outbox = Outbox(where.ledger().backend)
        now = where.ledger().backend.now()
        shown: list[Entry] = []
        if after is None:
            shown = [e for e in outbox.outstanding(waiting=wanted == "waiting") if kept(e)]
        found: Iterator[Entry] = iter(())
        if wanted in ("all", "delivered"):
            size = min(limit + 1, _PAGE) if limit else _PAGE
            found = _delivered(outbox, after, kept, {e.id for e in shown}, size)
        # One more than shown, to know whether to say where the next page starts.
        delivered = itertools.islice(found, limit + 1) if limit else found
        last: list[str] = []  # the id of the last delivered entry shown
        beyond: list[Entry] = []  # the one after it, when --limit left it out

        def listed() -> Iterator[Entry]:
            yield from shown
            for n, entry in enumerate(delivered):
                if limit and n == limit:
                    beyond.append(entry)
                    return
                last[:] = [entry.id]
                yield entry

        count = 0
        if as_json:
            for text in machine_array(_doc(e) for e in listed()):
                click.echo(text, nl=False)
            click.echo()
        else:
            for entry in listed():
                click.echo(safe(_line(entry, now), lines=False))
                count += 1
    if not as_json:
        if count:
            click.echo(f"{count} notification(s) in {where.label}")
        else:
            said = "" if wanted == "all" else wanted + " "
            click.echo(f"no {said}notifications in {where.label}")
    if beyond and last:
        more = last[0]
        words = ["notifications", "ls", "--state", "delivered", "--after", more]
        if type_:
            words += ["--type", type_]
        if limit != 50:
            words += ["--limit", str(limit)]
        click.echo(
            f"more delivered before {more}: {where.command(*map(shlex.quote, words))}",
            err=as_json,
        )


def _delivered(
    outbox: Outbox, after: str | None, kept: Callable[[Entry], bool], shown: set[str], size: int
) -> Iterator[Entry]:
    """The delivered entries that `kept` keeps, the last moved first, after the entry
    `after`, read `size` at a time: a --type that few match reads on until it finds them.
    An entry listed already (`shown`: moved while the outbox was read) is skipped."""
    position = None
    if after is not None:
        position = outbox.position(after)
        if position is None:
            raise click.ClickException(safe(f"no delivered notification {after}"))
    while True:
        page = list(outbox.delivered(after=position, limit=size))
        for entry in page:
            if entry.id not in shown and kept(entry):
                yield entry
        if len(page) < size:
            return
        position = page[-1].position


#: Delivered entries read per select, at most.
_PAGE = 200


def _line(entry: Entry, now: float) -> str:
    deliveries = ", ".join(
        f"{d.channel} {d.state}" + (f" after {_tries(d.attempts)}" if d.attempts > 1 else "")
        for d in entry.deliveries
    ) or ("waiting for its transition" if entry.state == "waiting" else "not yet tried")
    line = (
        f"{entry.id}  {entry.type:<19} {entry.state:<10} {ago(now - entry.at):>8}  "
        f"{entry.summary}  [{deliveries}]"
    )
    errors = [d for d in entry.deliveries if d.last_error and d.state != "delivered"]
    if errors:
        line += f"  last error: {errors[0].last_error}"
    return line


@notifications.command("show")
@click.argument("entry_id")
@click.option("--json", "as_json", is_flag=True, help="The entry as JSON.")
@click.pass_obj
def show_notification(where: Where, entry_id: str, as_json: bool) -> None:
    """One entry: what it says, and every try to every channel."""
    try:
        check_id(entry_id)
    except ValueError as exc:
        raise click.BadParameter(safe(str(exc)), param_hint="ENTRY_ID") from None
    with ledger_errors(where.scrub):
        entry = Outbox(where.ledger().backend).get(entry_id)
    if entry is None:
        raise click.ClickException(safe(f"no notification {entry_id} in {where.label}"))
    if as_json:
        click.echo(machine(_doc(entry)))
        return
    click.echo(safe(f"{entry.id}  {entry.type}  {entry.state}  {stamp(entry.at)}"))
    click.echo(safe(f"  {entry.summary}"))
    if entry.subject:
        click.echo(safe(f"  subject: {entry.subject}"))
    for d in entry.deliveries:
        when = f" at {stamp(d.delivered_at)}" if d.delivered_at else ""
        nxt = f", next try {stamp(d.next_at)}" if d.next_at and d.state != "delivered" else ""
        click.echo(safe(f"  {d.channel}: {d.state}{when} after {_tries(d.attempts)}{nxt}"))
    click.echo(f"  tries ({entry.tries} in all, the latest {len(entry.log)} kept):")
    for one in entry.log:
        outcome = "delivered" if one.get("ok") else f"failed: {one.get('error')}"
        click.echo(
            safe(
                f"    {stamp(float(one['at']))}  {one.get('channel')} try {one.get('attempt')} "
                f"by {one.get('by')} ({one.get('took_s')} s): {outcome}",
                lines=False,
            )
        )
    click.echo(safe("  data: " + json.dumps(entry.data, sort_keys=True, default=str)[:2000]))


def _tries(n: int) -> str:
    return f"{n} try" if n == 1 else f"{n} tries"


def _doc(entry: Entry) -> dict[str, Any]:
    return {
        "id": entry.id, "type": entry.type, "at": entry.at, "state": entry.state,
        "subject": entry.subject, "confirmed_at": entry.confirmed_at, "tries": entry.tries,
        "claimed_by": entry.claimed_by, "data": entry.data, "log": list(entry.log),
        "deliveries": [
            {"channel": d.channel, "state": d.state, "attempts": d.attempts,
             "next_at": d.next_at, "delivered_at": d.delivered_at, "last_error": d.last_error}
            for d in entry.deliveries
        ],
    }  # fmt: skip
