"""What a sweeper raises an alarm about, and the channels an alarm goes to.

Three things need a person's attention, and the sweeper cannot fix any of them alone:

* `uncertain_too_long`: a record has been UNCERTAIN (or a claim stale) for longer than
  the threshold: nothing settled it, and nothing runs under its key until something does;
* `verifier_unknown`: its reconciler answered Unknown (raised, timed out, returned
  something else) that many times in a row, across every sweeper on the ledger;
* `ledger_unreachable`: the sweeper cannot read the ledger at all.

An `Alert` carries what a channel needs to say it (the kind, the key, the record, why,
which ledger) and an `id` that stays the same for the same condition (kind, key, fencing
token), so a receiver can drop the copies that several sweepers, or a repeat, send.

A channel is anything with `send(alert)`. `default_channels(backend)` is what a sweeper
uses unless told otherwise: a log line (logger `crewai_idempotent.reconciliation`), with
OpenTelemetry configured the `idempotency.reconcile.alerts` counter, and the outbox of
the ledger it sweeps (`OutboxAlerts`), so its dispatchers take an alert to a person's
webhook, Slack or apprise channels. A channel that raises is logged and skipped; an alarm
never stops a sweep.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .. import _otel
from ..ledger._backend import CacheBackend
from ..ledger._policy import readable_seconds
from ..ledger._record import Record, Status
from ..notifications import _incidents, _outbox

log = logging.getLogger("crewai_idempotent.reconciliation")

AlertKind = Literal["uncertain_too_long", "verifier_unknown", "ledger_unreachable"]
ALERT_KINDS: tuple[str, ...] = ("uncertain_too_long", "verifier_unknown", "ledger_unreachable")


@dataclass(frozen=True)
class Alert:
    """One condition that needs a person.

    `ledger` is the ledger's URL (a password as `***`); `key`, `record` and `tool` are
    None for `ledger_unreachable`. `age_s` is how long the record has been open,
    `unknowns` how many Unknown answers in a row its reconciler gave.
    """

    kind: AlertKind  # one of `ALERT_KINDS`
    reason: str  # why it is raised, as a person reads it
    ledger: str  # the ledger's URL
    key: str | None = None  # the record's idempotency key
    record: Record | None = field(default=None, repr=False, compare=False)  # as read
    tool: str | None = None  # the tool whose call made the record
    age_s: float | None = None  # how long the record has been open
    unknowns: int = 0  # Unknown answers in a row
    at: float = field(default_factory=time.time, compare=False)  # when (this host's clock)

    @property
    def id(self) -> str:
        """The same for every alert about the same condition (a receiver deduplicates on
        it): kind and key and fencing token, or kind and ledger."""
        if self.key is None:
            return f"{self.kind}:{self.ledger}"
        token = self.record.token if self.record is not None else 0
        return f"{self.kind}:{self.key}:{token}"

    def line(self) -> str:
        """The alert as one log line: kind, key and ledger, reason. Raises nothing."""
        where = f"{self.key!r} in {self.ledger}" if self.key is not None else self.ledger
        return f"{self.kind}: {where}: {self.reason}"


class AlertChannel(Protocol):
    """Where alerts go: `send` is called once per alert, from the sweeper's thread (an
    async sweeper's: one of its ledger's threads, never the event loop).

    Any object with `send` is one; subclassing is optional, and the protocol itself is
    never made (calling it raises `TypeError`)."""

    def send(self, alert: Alert) -> None:
        """Say `alert` to a person. It may raise anything: the sweeper logs it and goes on
        to the next channel (an alarm never stops a sweep)."""


class LogAlerts:
    """An alert as a WARNING (ERROR for an unreachable ledger) on the
    `crewai_idempotent.reconciliation` logger, and one on the `idempotency.reconcile.alerts`
    counter when OpenTelemetry is configured (attributes: kind, backend). `logger`
    replaces that logger. Raises nothing."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.log = logger or log

    def send(self, alert: Alert) -> None:
        """Log `alert` (its `line`, the alert itself as `idempotency_alert` on the record)
        and count it. Raises nothing."""
        level = logging.ERROR if alert.kind == "ledger_unreachable" else logging.WARNING
        self.log.log(level, "%s", alert.line(), extra={"idempotency_alert": alert})
        counter = _metrics().get("alerts")
        if counter is not None:
            counter.add(1, {"kind": alert.kind, "backend": _scheme(alert.ledger)})


class OutboxAlerts:
    """An alert as an entry in the outbox of the ledger `backend` holds, for its
    dispatchers to deliver: `alert.uncertain_too_long` or `alert.verifier_unknown`, once
    per alert `id` however many sweepers, or passes, raise it (the entry's dedupe key).

    `ledger_unreachable` cannot be written to the ledger that does not answer: it joins
    the ledger's open incident (`notifications._incidents`, which the failed read opened),
    kept on this host and put in the outbox as one `ledger.unavailable` entry once the
    ledger answers."""

    def __init__(self, backend: CacheBackend) -> None:
        self.backend = backend

    def __repr__(self) -> str:
        return f"OutboxAlerts({self.backend!r})"

    def send(self, alert: Alert) -> None:
        """Put `alert` in the outbox (`ledger_unreachable`: in the ledger's open incident,
        which never raises). Raises what `notifications.alert` raises: `LedgerUnavailable`
        if the store cannot be written."""
        if alert.kind == "ledger_unreachable":
            _incidents.alerted(self.backend, alert.id, alert.reason)
            return
        _outbox.alert(
            self.backend,
            f"alert.{alert.kind}",
            _title(alert),
            alert.reason,
            subject=alert.key,
            fields=entry_fields(alert),
            dedupe=alert.id,
        )


def _title(alert: Alert) -> str:
    what = alert.tool or alert.key
    if alert.kind == "uncertain_too_long":
        record = alert.record
        stale = record is not None and record.status is Status.PENDING
        head = "A stale claim nothing settled" if stale else "UNCERTAIN too long"
        return f"{head}: {what} for {readable_seconds(alert.age_s or 0.0)}"
    return f"Its reconciler keeps answering Unknown: {what} ({alert.unknowns} times in a row)"


def entry_fields(alert: Alert) -> dict[str, Any]:
    """What an outbox entry of `alert` carries: enough to act without opening the ledger."""
    record = alert.record
    return {
        "alert": alert.kind, "alert_id": alert.id, "key": alert.key, "tool": alert.tool,
        "status": record.status.value if record is not None else None,
        "token": record.token if record is not None else None,
        "age_s": round(alert.age_s, 1) if alert.age_s is not None else None,
        "unknowns": alert.unknowns, "reason": alert.reason, "ledger": alert.ledger,
    }  # fmt: skip


def default_channels(backend: CacheBackend | None = None) -> list[AlertChannel]:
    """The channels a sweeper sends alerts to when it is given none: the log and
    OpenTelemetry, and with `backend` (the sweeper's ledger) that ledger's outbox.
    Raises nothing."""
    channels: list[AlertChannel] = [LogAlerts()]
    if backend is not None:
        channels.append(OutboxAlerts(backend))
    return channels


def send_all(channels: Iterable[AlertChannel], alert: Alert) -> None:
    for channel in channels:
        try:
            channel.send(alert)
        except Exception:  # an alarm never stops the sweep
            log.exception("alert channel %r failed on %s", channel, alert.id)


# -- OpenTelemetry -------------------------------------------------------------------------

_made: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_made_lock = threading.Lock()


def _metrics() -> dict[str, Any]:
    """The sweeper's instruments on the guard's meter, made once per meter; empty while
    OpenTelemetry is off."""
    instruments = _otel._instruments()
    meter = getattr(instruments, "meter", None)
    if instruments is None or meter is None:
        return {}
    with _made_lock:
        made = _made.get(instruments)
        if made is None:
            made = _made[instruments] = {
                "alerts": meter.create_counter(
                    "idempotency.reconcile.alerts",
                    unit="{alert}",
                    description="Sweeper alerts: a record open too long, a reconciler that "
                    "keeps answering Unknown, a ledger the sweeper cannot reach",
                ),
                "swept": meter.create_counter(
                    "idempotency.reconcile.records",
                    unit="{record}",
                    description="Records a sweeper looked at, by what came of it (found, "
                    "absent, unknown, left, skipped, overtaken)",
                ),
            }
    return made


def count_swept(outcome: str, tool: str | None, backend: Any) -> None:
    counter = _metrics().get("swept")
    if counter is not None:
        attributes = {"outcome": outcome, "backend": _otel.backend_label(backend)}
        if tool:
            attributes["idempotency.tool"] = tool
        counter.add(1, attributes)


def report_open(backend: Any, count: int) -> None:
    """The open-UNCERTAIN gauge (`idempotency.uncertain.open`) for this ledger."""
    if _otel._instruments() is not None:
        _otel.report_uncertain(backend, count)


def _scheme(url: str) -> str:
    scheme = url.partition("://")[0].lower()
    return {"postgresql": "postgres", "file": "filelock"}.get(scheme, scheme or "unknown")
