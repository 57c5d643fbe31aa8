"""What an entry says to a person, whatever the channel: a title, the facts, the call's
arguments, the commands that act on it, and the webhook body that carries all of it.

The channels shorten what they display (`shorten`); the entry and the webhook body keep
every argument whole. Money is printed as `format_money` prints it everywhere.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import command
from .._units import format_money
from ..ledger._backend import CacheBackend, ledger_option, url_of
from ..ledger._policy import readable_seconds
from ._outbox import TYPES, Entry

_TITLES = {
    "approval.requested": "Approval requested",
    "approval.approved": "Approved",
    "approval.denied": "Denied",
    "approval.expired": "Approval expired unused",
    "record.uncertain": "Outcome unknown: a person must check",
    "record.resolved": "Uncertain call resolved",
    "spend.refused": "Refused by a spend cap",
    "spend.threshold": "Spend cap warning",
    "ledger.unavailable": "The ledger did not answer",
    "alert.uncertain_too_long": "Open too long: a person must check",
    "alert.verifier_unknown": "A reconciler keeps answering Unknown",
}
#: The sweeper's alerts (reconciliation/_alerts.py): their fields, shown under these labels.
_SWEEPER_ALERTS = ("alert.uncertain_too_long", "alert.verifier_unknown")


def shorten(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, saying how long it was."""
    if len(text) <= limit:
        return text
    tail = f"… ({len(text):,} characters in all)"
    if limit <= len(tail):
        return text[: max(limit, 0)]
    return text[: limit - len(tail)] + tail


def display(value: Any) -> str:
    """An argument's value as one text: strings as they are, the rest as compact JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(", ", ": "))


def stamp(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def approval_link(console: str, request_id: str) -> str:
    """Where the console shows (and decides) an approval request: `<console>/approvals/<id>`.
    `console` is the console's public origin (a trailing `/` is dropped), `request_id` the
    request's `ap_...` id. Raises nothing."""
    return f"{console.rstrip('/')}/approvals/{request_id}"


@dataclass(frozen=True, slots=True)
class Message:
    """One entry, ready to be said: `ledger` is the `--ledger` option the suggested
    commands need (None for the CLI's default ledger), `ledger_url` the ledger as shown.

    `id` (the delivery id), `type`, `at`, `subject` and `data` are the entry's, as in
    `Entry`. Made by `of`; making one raises nothing, and each method says what it raises.
    """

    id: str
    type: str
    at: float
    subject: str | None
    data: Mapping[str, Any]
    ledger: str | None
    ledger_url: str

    @classmethod
    def of(cls, entry: Entry, backend: CacheBackend) -> Message:
        return cls(
            entry.id, entry.type, entry.at, entry.subject, entry.data,
            ledger_option(backend), url_of(backend),
        )  # fmt: skip

    # -- what it says --------------------------------------------------------------------

    @property
    def title(self) -> str:
        data = self.data
        head = _TITLES.get(self.type)
        if self.type.startswith("approval.") and data.get("tool"):
            return f"{head}: {data['tool']}"
        if self.type == "spend.refused" and data.get("tool"):
            return f"{head}: {data['tool']}"
        if self.type in _SWEEPER_ALERTS and data.get("title"):
            return str(data["title"])  # the sweeper's own, naming the tool and how long
        if head is None:
            return str(data.get("title") or TYPES.get(self.type) or self.type)
        return head

    def facts(self) -> list[tuple[str, str]]:
        """(label, value) pairs a person reads first: what, where, how much, who.

        Raises nothing for the entries the package writes; an entry of one of its types
        `put` by hand with malformed data (no number where an amount or a time belongs, a
        cap without its name) raises `ValueError`, `TypeError` or `KeyError` (a dispatcher
        counts that as a failed try)."""
        d, t = self.data, self.type
        facts: list[tuple[str, str]] = []

        def add(label: str, value: Any) -> None:
            if value is not None and value != "":
                facts.append((label, value if isinstance(value, str) else display(value)))

        if t.startswith("approval."):
            add("Request", f"{d.get('id')} (round {d.get('round')})")
            add("Tool", d.get("tool"))
            add("Key", d.get("key"))
            add("Why", d.get("reason"))
            add("Crew", d.get("crew"))
            add("Task", d.get("task"))
            add("Kickoff", d.get("kickoff"))
            spend = d.get("spend")
            if isinstance(spend, Mapping):
                currency = spend.get("currency", "")
                add("Amount", format_money(int(spend.get("amount", 0)), currency))
                for cap in spend.get("caps") or ():
                    add(f"Cap {cap['cap']}", _against(cap, currency))
            if t != "approval.requested":
                add("Decided by", d.get("decided_by"))
                add("Reason given", d.get("decision_reason"))
            if t == "approval.approved" and d.get("grant_expires_at"):
                add("Grant until", stamp(float(d["grant_expires_at"])))
        elif t.startswith("record."):
            add("Key", d.get("key"))
            add("Status", d.get("status"))
            if d.get("needs_operator"):
                add("Flagged", "two executions may have happened: see its evidence")
            add("Why", d.get("error") or d.get("note"))
            add("By", d.get("by"))
            add("Owner", d.get("owner"))
        elif t == "spend.refused":
            currency = d.get("currency", "")
            add("Key", d.get("key"))
            add("Amount", format_money(int(d.get("amount", 0)), currency))
            add(f"Cap {d.get('cap')}", _against(d, currency))
            add("Crew", d.get("crew"))
            add("Task", d.get("task"))
            add("Kickoff", d.get("kickoff"))
        elif t == "spend.threshold":
            currency = d.get("currency", "")
            add("Cap", d.get("cap"))
            add("Used", f"{_against(d, currency)} ({float(d.get('share', 0)):.0%} reached)")
            add("Key that crossed it", d.get("key"))
        elif t == "ledger.unavailable":
            add("Host", d.get("host"))
            add("Process", d.get("process"))
            add("From", stamp(float(d["first_at"])) if d.get("first_at") else None)
            add("Until", stamp(float(d["last_at"])) if d.get("last_at") else None)
            add("Failed operations", d.get("count"))
            add("Last error", d.get("error"))
            add("Alert", d.get("alert"))
        elif t in _SWEEPER_ALERTS:
            f = d.get("fields") or {}
            add("Key", f.get("key") or self.subject)
            add("Tool", f.get("tool"))
            add("Status", f.get("status"))
            add("Open for", _duration(f.get("age_s")))
            if f.get("unknowns"):
                add("Unknown answers", f"{f['unknowns']} in a row")
        else:  # an alert of someone's own
            add("About", self.subject)
            for name, value in (d.get("fields") or {}).items():
                add(str(name), value)
        add("Ledger", self.ledger_url)
        return facts

    @property
    def text(self) -> str:
        """An alert's own text, or what the entry type means."""
        return str(self.data.get("text") or TYPES.get(self.type, ""))

    def arguments(self) -> list[tuple[str, Any]]:
        """The call's arguments, whole, when the entry is about a call (else none).
        Raises nothing."""
        summary = self.data.get("summary")
        return list(summary.items()) if isinstance(summary, Mapping) else []

    def commands(self) -> dict[str, str]:
        """The commands that act on what the entry is about, naming the ledger (by name:
        "approve", "deny", "show", "resolve"). Raises nothing."""
        d, ledger = self.data, self.ledger
        if self.type == "approval.requested":
            rid = str(d.get("id"))
            return {
                "approve": command(ledger, "approvals", "approve", rid),
                "deny": command(ledger, "approvals", "deny", rid, "--reason", "'...'"),
                "show": command(ledger, "approvals", "show", rid),
            }
        if self.type.startswith("approval."):
            return {"show": command(ledger, "approvals", "show", str(d.get("id")))}
        if self.type in ("record.uncertain", *_SWEEPER_ALERTS) and self.subject:
            key = _quoted(self.subject)
            return {
                "show": command(ledger, "show", key),
                "resolve": command(
                    ledger, "resolve", key, "--happened|--absent", "--reason", "'...'"
                ),
            }
        if self.subject:
            return {"show": command(ledger, "show", _quoted(self.subject))}
        return {}

    def body(self) -> dict[str, Any]:
        """The webhook payload (Standard Webhooks' `type`, `timestamp`, `data`), whole.
        Raises nothing."""
        return {
            "type": self.type, "timestamp": dt.datetime.fromtimestamp(self.at, dt.UTC).isoformat(),
            "id": self.id, "subject": self.subject, "title": self.title,
            "ledger": self.ledger_url, "commands": self.commands(), "data": dict(self.data),
        }  # fmt: skip

    def plain(self, limit: int = 4000) -> str:
        """The message as plain text (apprise, logs), arguments shortened to fit `limit`
        characters, which the whole text never exceeds. Raises what `facts` raises."""
        lines = [self.text, ""] if self.text else []
        lines += [f"{label}: {value}" for label, value in self.facts()]
        args = self.arguments()
        if args:
            lines += ["", "Arguments:"]
            each = max(80, (limit // 2) // max(len(args), 1))
            lines += [f"  {name} = {shorten(display(value), each)}" for name, value in args]
        commands = self.commands()
        if commands:
            lines += ["", *(f"{name}: {line}" for name, line in commands.items())]
        lines += ["", f"entry {self.id} at {stamp(self.at)}"]
        return shorten("\n".join(lines), limit)


def _against(window: Mapping[str, Any], currency: str) -> str:
    committed, reserved = int(window.get("committed", 0)), int(window.get("reserved", 0))
    limit = int(window.get("limit", 0))
    return (
        f"{format_money(committed, currency)} spent + {format_money(reserved, currency)} "
        f"reserved of {format_money(limit, currency)}"
    )


def _duration(seconds: Any) -> str | None:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return None
    return readable_seconds(seconds)


def _quoted(key: str) -> str:
    import shlex

    return shlex.quote(key)
