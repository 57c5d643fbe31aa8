"""What each page shows, read from the ledger: plain data the templates lay out.

Nothing here writes. Every read goes through the same objects the CLI uses (`Approvals`,
`Ledger`, the gate and outbox documents), so the console shows what `approvals show`,
`show`, `spend` and `notifications ls` print. The console's own documents (accounts,
sessions) are never shown.

**A page costs a page.** Each page asks the store for what it shows through `Select` (a
status, a key prefix, a time range, documents by state or call, in an order, after a
position, at most a page), so what it reads does not grow with the ledger. Where a page
drops rows the store cannot tell apart (the gates' documents among records, live leases
among PENDING records, notifications of another type), it reads at most `BUDGET` pages'
worth and continues from there on the next page: a page may then show fewer rows than it
could, never read more. Pages go by a cursor (`cursor`, the position of the last row
shown), never an offset.
"""

from __future__ import annotations

import base64
import fnmatch
import heapq
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Generic, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

from .._errors import ApprovalNotFound
from .._units import parse_duration
from ..gates import _gatestore, _spend
from ..gates._approvals import ApprovalRequest, Approvals, ApprovalState, _check_id
from ..gates._spend import Budget
from ..ledger._ledger import Ledger
from ..ledger._record import Record, Status
from ..ledger._results import describe
from ..ledger._select import Order, Position, Select
from ..notifications import _outbox
from ..notifications._outbox import Entry
from ._accounts import KEY as ACCOUNTS_KEY
from ._sessions import PREFIX as SESSIONS

CONSOLE_DOCS = f"{_gatestore.PREFIX}console/"

#: Rows per page, by page.
PENDING_SHOWN = 25  # pending approval requests: each a whole card
DECIDED_SHOWN = 50
UNCERTAIN_SHOWN = 25
RECORDS_SHOWN = 100
SPEND_SHOWN = 50
NOTIFICATIONS_SHOWN = 50
#: A call's approval requests read to find the earlier one (and listed on a record's
#: page): a key asked this many times has its latest ones shown.
SAME_KEY = 10
#: Pages' worth of rows a page reads at most when it drops rows the store cannot tell
#: apart (see the module's docstring).
BUDGET = 4
#: The longest cursor taken from a URL: a key of a few thousand characters, encoded.
MAX_CURSOR = 16_384

T = TypeVar("T")


def is_console_doc(key: str) -> bool:
    return key.startswith(CONSOLE_DOCS) or key == ACCOUNTS_KEY or key.startswith(SESSIONS)


# -- paging -----------------------------------------------------------------------------


_CURSOR = re.compile(r"[A-Za-z0-9_-]+")


def cursor(position: Position) -> str:
    """`position` (an `(updated_at, key)` pair) as text safe in a URL: base64url of its
    JSON, unpadded. Raises `ValueError` for a position that is not such a pair."""
    if not isinstance(position, tuple):
        raise ValueError(f"the console's pages go by time: not a time position {position!r}")
    at, key = position
    raw = json.dumps([at, key], ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode("ascii")).rstrip(b"=").decode("ascii")


def position(text: str) -> tuple[float, str]:
    """The position a `cursor` encodes. Raises `ValueError` for anything else."""
    bad = ValueError("That page link is damaged (its after= is not one the console made): "
                     "start again from the first page.")  # fmt: skip
    if len(text) > MAX_CURSOR or not _CURSOR.fullmatch(text):
        raise bad
    try:
        data = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode("ascii"))
        if not (isinstance(data, list) and len(data) == 2 and isinstance(data[1], str)):
            raise bad
        at = data[0]
        if isinstance(at, bool) or not isinstance(at, int | float):
            raise bad
        at = float(at)  # an integer past a float's range: OverflowError
    except (ValueError, RecursionError, OverflowError):
        raise bad from None
    if not math.isfinite(at):
        raise bad
    return at, data[1]


@dataclass(frozen=True, slots=True)
class Paging:
    """Where a listing starts: its order, and the position to continue after (None: the
    first page)."""

    order: Order
    after: Position | None = None


def paging(query: Mapping[str, str], default: Order, prefix: str = "") -> Paging:
    """The paging a page's `query` asks for: `order` (newest or oldest; else `default`)
    and `after` (a `cursor`), each under `prefix` (a page with two listings). Raises
    `ValueError`, saying what is wrong, for an order or a cursor it cannot read."""
    order = query.get(prefix + "order") or default.value
    if order not in (Order.NEWEST.value, Order.OLDEST.value):
        raise ValueError(f"No order {order!r}: newest or oldest.")
    after = query.get(prefix + "after")
    return Paging(Order(order), position(after) if after else None)


#: Parameters that say what a form just did: not carried to another page of a listing.
_NOTICES = ("done", "id", "n")


def link(path: str, query: Mapping[str, str], **changes: Position | str | None) -> str:
    """`path` with `query` (the filters kept) changed by `changes`: a position is given
    as its cursor, None removes the parameter. Raises `ValueError` for a position that is
    not a time position."""
    params = {k: v for k, v in query.items() if k not in _NOTICES}
    for name, value in changes.items():
        if value is None:
            params.pop(name, None)
        else:
            params[name] = value if isinstance(value, str) else cursor(value)
    return f"{path}?{urlencode(params)}" if params else path


def _time_position(record: Record) -> tuple[float, str]:
    return (record.updated_at, record.key)


def _stream(
    read: Callable[[Position | None, int], Iterable[T]],
    where: Callable[[T], Position],
    after: Position | None,
    chunk: int,
) -> Iterator[T]:
    """What `read(after, limit)` finds, asked for `chunk` at a time as it is used: a
    consumer that stops early has read at most a chunk past what it used."""
    while True:
        count, last = 0, None
        for item in read(after, chunk):
            count, last = count + 1, item
            yield item
        if count < chunk or last is None:
            return
        after = where(last)


@dataclass(frozen=True, slots=True)
class Paged(Generic[T]):
    """One page of a listing: what it shows, and where the next page starts (None: no
    further page)."""

    items: list[T]
    next: Position | None


def _take(
    rows: Iterable[T],
    keep: Callable[[T], bool],
    size: int,
    where: Callable[[T], Position],
    budget: int,
) -> Paged[T]:
    """The first `size` rows `keep` keeps, reading at most `budget` rows: a page of them,
    and where the next starts (after the last row read when the budget ran out)."""
    shown: list[T] = []
    for read, row in enumerate(rows, 1):
        if keep(row):
            if len(shown) == size:
                return Paged(shown, where(shown[-1]))
            shown.append(row)
        if read >= budget:
            return Paged(shown, where(row))
    return Paged(shown, None)


def _merge(streams: Iterable[Iterable[T]], where: Callable[[T], Any], order: Order) -> Iterator[T]:
    return heapq.merge(*streams, key=where, reverse=order is Order.NEWEST)


# -- approvals --------------------------------------------------------------------------


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


def _earlier(request: ApprovalRequest, same_key: Iterable[ApprovalRequest]) -> Earlier | None:
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


def same_key(approvals: Approvals, key: str) -> list[ApprovalRequest]:
    """The latest `SAME_KEY` requests for the call under idempotency key `key`, the last
    changed first: one read of the store's index of them."""
    return list(approvals.select(key=key, order=Order.NEWEST, limit=SAME_KEY))


def asking(request: ApprovalRequest, now: float, same: Iterable[ApprovalRequest] = ()) -> Asking:
    """`request` as a card shows it: its live approvals at `now`, the earlier request of
    its key among `same` (the key's requests) and what changed since, its earlier
    rounds."""
    live = (
        [a for a in request.approvals if a["until"] > now]
        if request.state is ApprovalState.PENDING
        else []
    )
    return Asking(request, _earlier(request, same), live, _rounds(request))


def _request_position(request: ApprovalRequest) -> Position:
    assert request.position is not None  # read by a listing
    return request.position


@dataclass(frozen=True, slots=True)
class ApprovalsPage:
    pending: Paged[Asking]  # in `order` (oldest first: who waited longest)
    decided: Paged[Asking]  # the last decided first
    order: Order


#: Each listing's order when its page's query names none.
PENDING_ORDER = Order.OLDEST  # who waited longest first
RECORDS_ORDER = Order.NEWEST
UNCERTAIN_ORDER = Order.OLDEST
SPEND_ORDER = Order.NEWEST
NOTIFICATIONS_ORDER = Order.NEWEST


def approvals_paging(query: Mapping[str, str]) -> tuple[Paging, Paging]:
    """The approvals page's two listings' paging (pending, decided) in `query`. Raises
    `ValueError` as `paging` does."""
    decided = paging(query, Order.NEWEST, "decided_")
    return paging(query, PENDING_ORDER, "pending_"), Paging(Order.NEWEST, decided.after)


def approvals_page(
    approvals: Approvals, ahead: Paging, behind: Paging, now: float
) -> ApprovalsPage:
    """A page of pending requests as `ahead` says (each with the earlier request of its
    key) and one of decided ones after `behind.after`, the last decided first. Raises
    `LedgerUnavailable` if the store cannot be read."""
    pending = list(approvals.select(
        ApprovalState.PENDING, order=ahead.order, after=ahead.after, limit=PENDING_SHOWN + 1,
    ))  # fmt: skip
    more = len(pending) > PENDING_SHOWN
    pending = pending[:PENDING_SHOWN]
    cards = [asking(r, now, same_key(approvals, r.key)) for r in pending]
    shown = Paged(cards, _request_position(pending[-1]) if more else None)
    return ApprovalsPage(shown, decided_page(approvals, behind.after, now), ahead.order)


def decided_page(approvals: Approvals, after: Position | None, now: float) -> Paged[Asking]:
    """Decided requests (approved, denied, used) after `after`, the last changed first: a
    page from each state's index, merged."""
    states = [s for s in ApprovalState if s is not ApprovalState.PENDING]
    streams = [
        approvals.select(s, order=Order.NEWEST, after=after, limit=DECIDED_SHOWN + 1)
        for s in states
    ]
    found = _take(_merge(streams, _request_position, Order.NEWEST), lambda _r: True,
                  DECIDED_SHOWN, _request_position, len(states) * (DECIDED_SHOWN + 1))  # fmt: skip
    return Paged([asking(r, now) for r in found.items], found.next)


def one_request(approvals: Approvals, rid: str, now: float) -> Asking:
    """Request `rid` with the earlier request of its key. Raises `ApprovalNotFound` and
    `ValueError` (not a request id) as `Approvals.get` does."""
    request = approvals.get(rid)
    return asking(request, now, same_key(approvals, request.key))


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


def filters(query: Mapping[str, str]) -> tuple[Filters, str]:
    """The records page's filters in `query`, and what is wrong with them ("" when
    nothing: a wrong filter gives the unfiltered page and the error). Raises nothing."""
    status = (query.get("status") or "").lower()
    if status not in ("", "pending", "committed", "failed", "uncertain"):
        return Filters(), f"No status {status!r}: pending, committed, failed or uncertain."
    older = parse_duration(query["older"]) if query.get("older") else None
    newer = parse_duration(query["newer"]) if query.get("newer") else None
    if (query.get("older") and older is None) or (query.get("newer") and newer is None):
        return Filters(), "An age is a duration such as 90s, 15m, 2h or 7d."
    return Filters(
        status=status, tool=(query.get("tool") or "").strip(), prefix=query.get("prefix") or "",
        older_than=older, newer_than=newer, documents=query.get("documents") == "1",
    ), ""  # fmt: skip


def _key_prefix(f: Filters) -> str | None:
    """The one key prefix the tool and prefix filters both ask for; None when they
    contradict each other (nothing matches)."""
    prefixes = [p for p in (f"{f.tool}:" if f.tool else "", f.prefix) if p]
    longest = max(prefixes, key=len, default="")
    return longest if all(longest.startswith(p) for p in prefixes) else None


@dataclass(frozen=True, slots=True)
class RecordsPage:
    rows: list[Row]
    next: Position | None
    order: Order


def records_page(ledger: Ledger, f: Filters, at: Paging, now: float) -> RecordsPage:
    """A page of the records `f` selects, as `at` says."""
    prefix = _key_prefix(f)
    if prefix is None:
        return RecordsPage([], None, at.order)
    select = Select(
        status=Status(f.status.upper()) if f.status else None, prefix=prefix,
        updated_from=now - f.newer_than if f.newer_than is not None else None,
        updated_before=now - f.older_than if f.older_than is not None else None,
        order=at.order,
    )  # fmt: skip

    def read(after: Position | None, limit: int) -> Iterator[Record]:
        return ledger.select(replace(select, after=after, limit=limit))

    def keep(record: Record) -> bool:
        return not is_console_doc(record.key) and (
            f.documents or not _gatestore.is_document(record)
        )

    rows = _stream(read, _time_position, at.after, RECORDS_SHOWN + 1)
    page = _take(rows, keep, RECORDS_SHOWN, _time_position, BUDGET * RECORDS_SHOWN)
    return RecordsPage([row(ledger, r, now) for r in page.items], page.next, at.order)


@dataclass(frozen=True, slots=True)
class RecordView:
    row: Row
    result_kind: str | None
    result: Any
    evidence: list[dict[str, Any]]
    requests: list[ApprovalRequest] = field(default_factory=list)  # the latest SAME_KEY

    @property
    def resolvable(self) -> bool:
        return self.row.record.status is Status.UNCERTAIN or self.row.stale

    @property
    def requests_cut(self) -> bool:
        """Whether the key may have more requests than the latest ones shown."""
        return len(self.requests) >= SAME_KEY


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


def record_page(ledger: Ledger, approvals: Approvals, key: str, now: float) -> RecordView | None:
    """The record under `key` with its call's latest approval requests; None when there
    is none (or it is one of the console's own). Raises nothing of its own."""
    record = ledger.get(key) if key and not is_console_doc(key) else None
    if record is None:
        return None
    return record_view(ledger, record, now, same_key(approvals, key))


@dataclass(frozen=True, slots=True)
class UncertainPage:
    views: list[RecordView]
    next: Position | None
    order: Order


def uncertain(ledger: Ledger, approvals: Approvals, at: Paging, now: float) -> UncertainPage:
    """UNCERTAIN records and PENDING ones whose lease lapsed: what waits for a person,
    paged as `at` says; a page from each status's index, merged."""

    def read(status: Status) -> Iterator[Record]:
        def page(after: Position | None, limit: int) -> Iterator[Record]:
            return ledger.select(Select(status=status, order=at.order, after=after, limit=limit))

        return _stream(page, _time_position, at.after, UNCERTAIN_SHOWN + 1)

    def keep(record: Record) -> bool:
        if is_console_doc(record.key):
            return False
        return record.status is Status.UNCERTAIN or row(ledger, record, now).stale

    rows = _merge([read(Status.UNCERTAIN), read(Status.PENDING)], _time_position, at.order)
    page = _take(rows, keep, UNCERTAIN_SHOWN, _time_position, BUDGET * UNCERTAIN_SHOWN)
    views = [record_view(ledger, r, now, same_key(approvals, r.key)) for r in page.items]
    return UncertainPage(views, page.next, at.order)


# -- spend ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SpendPage:
    budgets: list[Budget]
    next: Position | None
    order: Order


def spend_page(ledger: Ledger, at: Paging) -> SpendPage:
    """A page of cap windows as `at` says; each with its reservations whose call is over
    settled where they belong (nothing is written), as `crewai-idempotent spend` shows
    them."""
    found = list(_gatestore.select(ledger.backend, _spend.KIND, order=at.order, after=at.after,
                                   limit=SPEND_SHOWN + 1))  # fmt: skip
    more = len(found) > SPEND_SHOWN
    found = found[:SPEND_SHOWN]
    budgets = [_budget(ledger, doc) for _record, doc in found]
    return SpendPage(budgets, _time_position(found[-1][0]) if more else None, at.order)


def _budget(ledger: Ledger, doc: dict[str, Any]) -> Budget:
    # As SpendLedger.budgets() makes each, for one window read by a page.
    _spend._settle_stale(ledger.backend, doc)
    return Budget(
        key=f"{_gatestore.PREFIX}{_spend.KIND}{doc['scope']}/{doc['cap']}/{doc['window']}",
        scope=doc["scope"], cap=doc["cap"], per=doc["per"], window=doc["window"],
        currency=doc["currency"], limit=int(doc["limit"]), committed=int(doc["committed"]),
        reserved=_spend._reserved(doc), reservations=dict(doc["reserved"]),
    )  # fmt: skip


# -- notifications ----------------------------------------------------------------------

#: The states the notifications page filters by ("" is every entry), as `notifications ls`.
NOTIFICATION_STATES = ("", "pending", "failing", "delivered", "waiting")


@dataclass(frozen=True, slots=True)
class NotificationsPage:
    entries: list[Entry]  # newest first: what just happened is what a person looks for
    next: Position | None
    order: Order


def failing(entry: Entry) -> bool:
    """A channel's last try failed, and none delivered since."""
    return any(d.last_error and d.state != "delivered" for d in entry.deliveries)


def _entry(ledger: Ledger, record: Record, waiting: bool) -> Entry | None:
    """The entry a record holds as `Outbox.entries` reads it: a waiting one is looked up
    (and shown only with `waiting`), a void one is not shown."""
    if not _outbox.is_entry(record):
        return None
    doc = _outbox.doc_of(record)
    if _outbox.waits(doc):
        verdict = _outbox.confirmation(ledger.backend, doc)
        if verdict == _outbox.VOID or (verdict == _outbox.WAITING and not waiting):
            return None
        if verdict == _outbox.HAPPENED:
            doc = {**doc, "state": "due"}
    return Entry.of(doc)


_WANTED: dict[str, Callable[[Entry], bool]] = {
    "": lambda e: True,
    "pending": lambda e: e.undelivered,
    "delivered": lambda e: e.state == "delivered",
    "failing": failing,
    "waiting": lambda e: e.state == "waiting",
}


def notifications_page(ledger: Ledger, state: str, pattern: str, at: Paging) -> NotificationsPage:
    """A page of the outbox's entries in `state` whose type matches `pattern`
    (`approval.*`), by their last change as `at` says, read as `notifications ls` reads
    them."""
    prefixes = [_outbox.OUTBOX]
    if state in ("", "delivered"):
        prefixes.append(_outbox.DELIVERED)

    def read(prefix: str) -> Iterator[Record]:
        def page(after: Position | None, limit: int) -> Iterator[Record]:
            return ledger.select(Select(prefix=prefix, order=at.order, after=after, limit=limit))

        return _stream(page, _time_position, at.after, NOTIFICATIONS_SHOWN + 1)

    wanted = _WANTED[state]

    def read_entries() -> Iterator[tuple[Record, Entry | None]]:
        rows = _merge([read(p) for p in prefixes], _time_position, at.order)
        for record in rows:
            yield record, _entry(ledger, record, waiting=state == "waiting")

    def keep(found: tuple[Record, Entry | None]) -> bool:
        entry = found[1]
        return (
            entry is not None
            and wanted(entry)
            and (not pattern or fnmatch.fnmatchcase(entry.type, pattern))
        )

    def where(found: tuple[Record, Entry | None]) -> Position:
        return _time_position(found[0])

    page = _take(read_entries(), keep, NOTIFICATIONS_SHOWN, where, BUDGET * NOTIFICATIONS_SHOWN)
    # A dispatcher copies a delivered entry before deleting the outbox's, and between the
    # two writes both exist: one entry, delivered.
    shown: dict[str, Entry] = {}
    for record, entry in page.items:
        assert entry is not None
        if entry.id not in shown or record.key.startswith(_outbox.DELIVERED):
            shown[entry.id] = entry
    return NotificationsPage(list(shown.values()), page.next, at.order)


# -- what an open page shows, for live updates without a change mark -------------------


def shown(ledger: Ledger, approvals: Approvals, url: str) -> Any:
    """What the page at `url` (a path and query, as the browser asked for it) shows now:
    the data its template lays out, read as the page reads it (a page's worth), or None
    for a URL that is no such page. Live updates compare it between refreshes when the
    store cannot say whether it changed (`CacheBackend.changes` is None). Raises
    `LedgerUnavailable` if the store cannot be read."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    path = parts.path
    now = ledger.backend.now()
    read: Callable[[], Any]
    try:
        if path == "/approvals":
            pagings = approvals_paging(query)
            read = partial(approvals_page, approvals, *pagings, now)
        elif path.startswith("/approvals/"):
            rid = _check_id(path.removeprefix("/approvals/"))
            read = partial(_maybe_request, approvals, rid, now)
        elif path == "/uncertain":
            at = paging(query, UNCERTAIN_ORDER)
            read = partial(uncertain, ledger, approvals, at, now)
        elif path == "/records":
            at = paging(query, RECORDS_ORDER)
            read = partial(records_page, ledger, filters(query)[0], at, now)
        elif path == "/record":
            read = partial(record_page, ledger, approvals, query.get("key", ""), now)
        elif path == "/spend":
            at = paging(query, SPEND_ORDER)
            read = partial(spend_page, ledger, at)
        elif path == "/notifications":
            state = (query.get("state") or "").lower()
            state = state if state in NOTIFICATION_STATES else ""
            kind = (query.get("type") or "").strip()
            at = paging(query, NOTIFICATIONS_ORDER)
            read = partial(notifications_page, ledger, state, kind, at)
        else:
            return None
    except ValueError:  # a query the page itself refuses
        return None
    return read()


def _maybe_request(approvals: Approvals, rid: str, now: float) -> Asking | None:
    try:
        return one_request(approvals, rid, now)
    except ApprovalNotFound:
        return None
