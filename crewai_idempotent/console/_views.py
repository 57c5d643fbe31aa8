"""What each page shows, read from the ledger: plain data the templates lay out.

Nothing here writes. Every read goes through the same objects the CLI uses (`Approvals`,
`Ledger`, `SpendLedger`, `Outbox`), so the console shows what `approvals show`, `show`,
`spend` and `notifications ls` print. The console's own documents (accounts, sessions)
are never shown.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..gates import _gatestore
from ..gates._approvals import ApprovalRequest, Approvals, ApprovalState
from ..gates._spend import Budget, SpendLedger
from ..ledger._ledger import Ledger
from ..ledger._record import Record, Status
from ..ledger._results import describe
from ..notifications._outbox import Entry, Outbox
from ._accounts import KEY as ACCOUNTS_KEY
from ._sessions import PREFIX as SESSIONS

CONSOLE_DOCS = f"{_gatestore.PREFIX}console/"
RECORDS_SHOWN = 500


def is_console_doc(key: str) -> bool:
    return key.startswith(CONSOLE_DOCS) or key == ACCOUNTS_KEY or key.startswith(SESSIONS)


@dataclass(frozen=True, slots=True)
class Change:
    """One argument that differs from the earlier request of the same key."""

    name: str
    what: str  # "changed", "added", "removed"
    before: Any = None
    after: Any = None


@dataclass(frozen=True, slots=True)
class Earlier:
    """The request made before this one under the same idempotency key (other arguments),
    and what changed since."""

    request: ApprovalRequest
    changes: list[Change]


@dataclass(frozen=True, slots=True)
class Asking:
    """A request as the approvals page shows it."""

    request: ApprovalRequest
    earlier: Earlier | None
    live_approvals: list[dict[str, Any]]  # this round's approvals whose deadline has not passed
    rounds: list[dict[str, Any]]  # what ended the earlier rounds of this same call

    @property
    def needs(self) -> int:
        return max(self.request.approvers_needed - len(self.live_approvals), 0)

    def approved_by(self, name: str) -> bool:
        return any(a["by"] == name for a in self.live_approvals)


def _changes(before: dict[str, Any], after: dict[str, Any]) -> list[Change]:
    found = []
    for name in [*after, *(n for n in before if n not in after)]:
        if name not in before:
            found.append(Change(name, "added", after=after[name]))
        elif name not in after:
            found.append(Change(name, "removed", before=before[name]))
        elif before[name] != after[name]:
            found.append(Change(name, "changed", before[name], after[name]))
    return found


def _earlier(request: ApprovalRequest, same_key: list[ApprovalRequest]) -> Earlier | None:
    before = [r for r in same_key if r.id != request.id and r.created_at <= request.created_at]
    if not before:
        return None
    previous = max(before, key=lambda r: r.created_at)
    return Earlier(previous, _changes(previous.summary, request.summary))


def _rounds(request: ApprovalRequest) -> list[dict[str, Any]]:
    """The history of the earlier rounds of this exact call: each decision, and why a new
    round opened."""
    if request.round == 1:
        return []
    return [e for e in request.history if e["what"] in ("approved", "denied", "used", "reopened")]


def asking(requests: list[ApprovalRequest], now: float) -> list[Asking]:
    by_key: dict[str, list[ApprovalRequest]] = {}
    for r in requests:
        by_key.setdefault(r.key, []).append(r)
    out = []
    for r in requests:
        live = (
            [a for a in r.approvals if a["until"] > now] if r.state is ApprovalState.PENDING else []
        )
        out.append(Asking(r, _earlier(r, by_key[r.key]), live, _rounds(r)))
    return out


@dataclass(frozen=True, slots=True)
class ApprovalsPage:
    pending: list[Asking]
    decided: list[Asking]


def approvals_page(approvals: Approvals, now: float, *, decided_limit: int = 50) -> ApprovalsPage:
    everything = approvals.list("all")
    shown = asking(everything, now)
    pending = [a for a in shown if a.request.state is ApprovalState.PENDING]
    decided = [a for a in shown if a.request.state is not ApprovalState.PENDING]
    decided.sort(key=lambda a: a.request.decided_at or a.request.created_at, reverse=True)
    return ApprovalsPage(pending, decided[:decided_limit])


def one_request(approvals: Approvals, rid: str, now: float) -> Asking:
    request = approvals.get(rid)
    same_key = [r for r in approvals.list("all") if r.key == request.key]
    return asking(same_key, now)[[r.id for r in same_key].index(request.id)]


# -- records ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    record: Record
    state: str
    note: str
    stale: bool


def _state(ledger: Ledger, record: Record, now: float) -> tuple[str, bool]:
    if record.status is Status.PENDING:
        try:
            left = record.lease_left(now, ledger.backend.host_clock)
        except Exception:  # noqa: BLE001 - a live lease another host holds
            return "PENDING (held on another host)", False
        return ("PENDING", False) if left > 0 else ("PENDING (stale)", True)
    if record.needs_operator:
        return f"{record.status.value} (needs operator)", False
    return record.status.value, False


def row(ledger: Ledger, record: Record, now: float) -> Row:
    state, stale = _state(ledger, record, now)
    return Row(record, state, record.error or "", stale)


@dataclass(frozen=True, slots=True)
class Filters:
    status: str = ""
    tool: str = ""
    prefix: str = ""
    older_than: float | None = None
    newer_than: float | None = None
    documents: bool = False


@dataclass(frozen=True, slots=True)
class RecordsPage:
    rows: list[Row]
    matched: int
    total: int  # in the status asked for (gate documents only if asked for too)


def records_page(ledger: Ledger, filters: Filters, now: float) -> RecordsPage:
    wanted = Status(filters.status.upper()) if filters.status else None
    records = [r for r in ledger.records(wanted) if not is_console_doc(r.key)]
    if not filters.documents:
        records = [r for r in records if not _gatestore.is_document(r)]
    total = len(records)
    if filters.tool:
        records = [r for r in records if r.key.startswith(f"{filters.tool}:")]
    if filters.prefix:
        records = [r for r in records if r.key.startswith(filters.prefix)]
    if filters.older_than is not None:
        records = [r for r in records if now - r.updated_at >= filters.older_than]
    if filters.newer_than is not None:
        records = [r for r in records if now - r.updated_at < filters.newer_than]
    records.sort(key=lambda r: r.updated_at, reverse=True)
    return RecordsPage([row(ledger, r, now) for r in records[:RECORDS_SHOWN]], len(records), total)


@dataclass(frozen=True, slots=True)
class RecordView:
    row: Row
    result_kind: str | None
    result: Any
    evidence: list[dict[str, Any]]
    requests: list[ApprovalRequest] = field(default_factory=list)

    @property
    def resolvable(self) -> bool:
        return self.row.record.status is Status.UNCERTAIN or self.row.stale


def record_view(
    ledger: Ledger, record: Record, now: float, requests: Iterable[ApprovalRequest]
) -> RecordView:
    kind, data = describe(record.result) if record.result is not None else (None, None)
    evidence = []
    for item in record.evidence:
        shown = dict(item)
        if "result" in shown:
            shown["result"] = describe(shown["result"])[1]
        evidence.append(shown)
    mine = [r for r in requests if r.key == record.key]
    return RecordView(row(ledger, record, now), kind, data, evidence, mine)


def uncertain(ledger: Ledger, now: float, requests: list[ApprovalRequest]) -> list[RecordView]:
    """UNCERTAIN records and PENDING ones whose lease lapsed: what waits for a person."""
    found = []
    for record in ledger.records(Status.UNCERTAIN) + ledger.records(Status.PENDING):
        if is_console_doc(record.key):
            continue
        view = record_view(ledger, record, now, requests)
        if view.resolvable:
            found.append(view)
    found.sort(key=lambda v: v.row.record.updated_at)
    return found


def budgets(ledger: Ledger) -> list[Budget]:
    return SpendLedger(ledger.backend).budgets()


# -- notifications ----------------------------------------------------------------------

#: The states the notifications page filters by ("" is every entry), as `notifications ls`.
NOTIFICATION_STATES = ("", "pending", "failing", "delivered", "waiting")
NOTIFICATIONS_SHOWN = 300


@dataclass(frozen=True, slots=True)
class NotificationsPage:
    entries: list[Entry]  # newest first: what just happened is what a person looks for
    matched: int
    total: int


def failing(entry: Entry) -> bool:
    """A channel's last try failed, and none delivered since."""
    return any(d.last_error and d.state != "delivered" for d in entry.deliveries)


def notifications_page(outbox: Outbox, state: str, pattern: str) -> NotificationsPage:
    """The outbox's entries in `state` whose type matches `pattern` (`approval.*`), read
    as `notifications ls` reads them."""
    everything = outbox.entries(waiting=state == "waiting")
    if state == "waiting":
        everything = [e for e in everything if e.state == "waiting"]
    total = len(everything)
    found = everything
    if state == "pending":
        found = [e for e in found if e.undelivered]
    elif state == "delivered":
        found = [e for e in found if e.state == "delivered"]
    elif state == "failing":
        found = [e for e in found if failing(e)]
    if pattern:
        found = [e for e in found if fnmatch.fnmatchcase(e.type, pattern)]
    found = found[::-1]
    return NotificationsPage(found[:NOTIFICATIONS_SHOWN], len(found), total)
