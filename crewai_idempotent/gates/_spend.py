"""Spend caps shared by every process that uses the same ledger.

A cap window (one cap, one kickoff / crew / task / day, or for ever) is one document in
the ledger (see `_gatestore`) holding:

- `committed`: the sum of the calls that ran and finished, or whose outcome is taken as
  spent;
- `reserved`: one entry per idempotency key whose call holds the money now, with the
  claim's fencing token and the amount.

A call reserves its amount after the ledger gave it the claim on its key and before its
body starts, by a compare-and-set of the document: it fits, or nothing is written and
`SpendCapExceeded` says why. Because only the claim's holder reserves, a key has at most
one live reservation, and reserving again under the same key (a takeover after a
failure) replaces the entry instead of adding to it.

When the body returns the entry moves to `committed`; when it fails before any effect
(FAILED) the entry is released; when its outcome is unknown (UNCERTAIN) the entry is kept.
Entries left behind by a process that died are settled from the ledger itself whenever a
call would not otherwise fit, and whenever budgets are shown: the key's record says
FAILED (released; `resolve --absent` ends there too), COMMITTED (spent), or anything
else (kept: the money may be gone).

Each write also keeps the window's `state` (held, standing, settled), so that `budgets`
reads the windows that count now from the store's index of documents by state and by
time: a per-kickoff cap leaves one window per kickoff behind, which are never read again
unless asked for (`every=True`, `spend --all`).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from .._errors import SpendCapExceeded
from .._units import format_money
from ..ledger._backend import CacheBackend
from ..ledger._record import Record, Status
from ..notifications._outbox import Note
from . import _gatestore

Per = Literal["kickoff", "crew", "task", "day", "total"]
PERIODS: tuple[str, ...] = get_args(Per)
KIND = "spend/"
_CURRENCY = re.compile(r"^[A-Z]{3}$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _check_amount(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an int of minor units (cents), not {type(value).__name__} {value!r}"
        )
    if value < 0:
        raise ValueError(f"{name} must be 0 or more minor units, not {value}")
    return value


def _check_currency(value: Any) -> str:
    if not isinstance(value, str) or not _CURRENCY.match(value):
        raise ValueError(
            f"currency must be a three-letter ISO 4217 code such as 'EUR', not {value!r}"
        )
    return value


@dataclass(frozen=True, slots=True)
class Money:
    """An amount in integer minor units (cents) and an ISO 4217 currency code."""

    amount: int
    currency: str

    def __post_init__(self) -> None:
        _check_amount("Money.amount", self.amount)
        _check_currency(self.currency)

    def __str__(self) -> str:
        return format_money(self.amount, self.currency)


@dataclass(frozen=True, slots=True)
class SpendCap:
    """At most `limit` minor units of `currency` per window.

    `per`: "kickoff", "crew", "task", "day" (UTC, by the ledger's clock) or "total".
    `name` tells caps apart in the ledger and in `crewai-idempotent spend`; by default
    "<per>-<currency>". Calls in another currency do not count against the cap.
    `warn_at` (a share of the limit, such as 0.8): the reservation that takes a window's
    spent and reserved money to that share puts a "spend.threshold" entry in the outbox,
    once per window.
    """

    limit: int
    currency: str
    per: Per = "total"
    name: str | None = None
    warn_at: float | None = None

    def __post_init__(self) -> None:
        _check_amount("SpendCap.limit", self.limit)
        _check_currency(self.currency)
        if self.per not in PERIODS:
            raise ValueError(f"SpendCap.per must be one of {', '.join(PERIODS)}, not {self.per!r}")
        if self.name is not None and (not isinstance(self.name, str) or not _NAME.match(self.name)):
            raise ValueError(
                f"SpendCap.name must be 1-64 letters, digits, '_', '.' or '-', not {self.name!r}"
            )
        share = self.warn_at
        if share is not None and (
            isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1
        ):
            raise ValueError(
                f"SpendCap.warn_at must be a share of the limit above 0 and at most 1 (0.8 "
                f"warns at 80%), not {share!r}"
            )

    @property
    def label(self) -> str:
        return self.name or f"{self.per}-{self.currency}"


@dataclass(frozen=True, slots=True)
class Where:
    """What a call runs inside; picks each cap's window. A cap whose window is unknown
    (a per-task cap for a call outside any task) falls back to "none"."""

    kickoff: str | None = None
    crew: str | None = None
    task: str | None = None


@dataclass(frozen=True, slots=True)
class Window:
    """One cap applied to one window: the document a reservation goes to."""

    cap: SpendCap
    scope: str  # the tool's name for a cap on a tool, "crew" for caps set on a crew
    window: str

    @property
    def key(self) -> str:
        return f"{_gatestore.PREFIX}{KIND}{self.scope}/{self.cap.label}/{self.window}"


@dataclass(frozen=True, slots=True)
class Budget:
    """What `crewai-idempotent spend` shows for one cap window."""

    key: str
    scope: str
    cap: str
    per: str
    window: str
    currency: str
    limit: int
    committed: int
    reserved: int
    reservations: dict[str, dict[str, Any]]

    @property
    def available(self) -> int:
        return max(self.limit - self.committed - self.reserved, 0)


def windows(caps: Iterable[tuple[str, SpendCap]], where: Where, now: float) -> list[Window]:
    """The window each (scope, cap) falls in for a call made `now` (store clock)."""
    found = []
    for scope, cap in caps:
        if cap.per == "total":
            window = "total"
        elif cap.per == "day":
            window = dt.datetime.fromtimestamp(now, dt.UTC).date().isoformat()
        elif cap.per == "kickoff":
            window = f"kickoff-{where.kickoff or 'none'}"
        elif cap.per == "crew":
            window = f"crew-{where.crew or 'none'}"
        else:
            window = f"task-{where.kickoff or 'none'}-{where.task or 'none'}"
        found.append(Window(cap, scope, window))
    return sorted(found, key=lambda w: w.key)  # one order for everyone


#: A window's `state`, kept in its document so that `budgets` reads the windows a person
#: needs from the store's index of documents by state: HELD while calls hold money in it;
#: else STANDING for a cap every later call counts against (per "total" or "crew"), and
#: SETTLED for a kickoff's, a task's or a day's, which later calls leave behind (shown
#: while it was written recently).
HELD, STANDING, SETTLED = "held", "standing", "settled"
_STANDING_PERIODS = ("total", "crew")
#: How long a settled window is shown by `budgets` after it was last written (a day).
RECENT_S = 86400.0


def _stated(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with the state its reservations and period give it (in place)."""
    if doc["reserved"]:
        doc["state"] = HELD
    else:
        doc["state"] = STANDING if doc["per"] in _STANDING_PERIODS else SETTLED
    return doc


def _empty(w: Window) -> dict[str, Any]:
    return {
        "kind": "spend",
        "scope": w.scope,
        "cap": w.cap.label,
        "per": w.cap.per,
        "window": w.window,
        "currency": w.cap.currency,
        "limit": w.cap.limit,
        "committed": 0,
        "reserved": {},
        "log": [],
    }


def _reserved(doc: dict[str, Any], but: str | None = None) -> int:
    return sum(int(e["amount"]) for k, e in doc["reserved"].items() if k != but)


_LOG_LIMIT = 50  # settled entries kept for `spend --show`; the sum lives in "committed"


def _settle_stale(backend: CacheBackend, doc: dict[str, Any]) -> bool:
    """Settle reservations whose call is over, from the ledger's own records. In place;
    True if anything changed. Reads other keys: the caller's compare-and-set on the cap
    document still decides, and a stale read only keeps money reserved longer."""
    changed = False
    for key, entry in list(doc["reserved"].items()):
        record = backend.get(key)
        if record is None or (record.status is Status.COMMITTED and record.token == entry["token"]):
            # A record gone (purged) after its claim is counted as spent: failing closed.
            del doc["reserved"][key]
            doc["committed"] += int(entry["amount"])
            _log(doc, key, entry, "committed")
            changed = True
        elif record.status in (Status.FAILED, Status.COMMITTED):
            # FAILED: the body failed before any effect, or was resolved absent. A newer
            # token that committed: the ledger took the key over, which it does only once
            # the older call is known not to have happened; the newer call reserved anew.
            del doc["reserved"][key]
            _log(doc, key, entry, "released")
            changed = True
    return changed


def _log(doc: dict[str, Any], key: str, entry: dict[str, Any], what: str) -> None:
    doc["log"] = [*doc["log"], {"key": key, "amount": entry["amount"], "as": what}][-_LOG_LIMIT:]


class SpendLedger:
    """Reservations against spend caps, kept in `backend` next to the idempotency records.
    Raises nothing until used: each method says what it raises."""

    def __init__(self, backend: CacheBackend) -> None:
        self.backend = backend

    def check(self, key: str, amount: Money, caps: Sequence[Window]) -> list[dict[str, Any]]:
        """Raise `SpendCapExceeded` if `amount` does not fit in every cap window of `caps`
        now, for the call under `key` (read only; for refusing before asking anyone to
        approve). `reserve` decides for good. Returns where each window of the amount's
        currency stands (for an approver); `LedgerUnavailable` if the store cannot be
        read."""
        standing = []
        for w in caps:
            if w.cap.currency != amount.currency:
                continue
            doc = _gatestore.read(self.backend, w.key) or _empty(w)
            if not _fits(doc, key, amount.amount, w):
                _settle_stale(self.backend, doc)
                if not _fits(doc, key, amount.amount, w):
                    raise _exceeded(key, amount, doc, w)
            standing.append(
                {"cap": f"{w.scope}/{w.cap.label}/{w.window}", "limit": w.cap.limit,
                 "committed": int(doc["committed"]), "reserved": _reserved(doc, but=key)}
            )  # fmt: skip
        return standing

    def reserve(self, key: str, token: int, amount: Money, caps: Sequence[Window]) -> None:
        """Reserve `amount` for the claim (`key`, `token`) in every window of `caps` in its
        currency, or in none: raises `SpendCapExceeded` naming the first cap it does not
        fit in, `LedgerUnavailable` if the store cannot be written."""
        done: list[Window] = []
        try:
            for w in caps:
                if w.cap.currency != amount.currency:
                    continue
                self._reserve_one(key, token, amount, w)
                done.append(w)
        except BaseException:
            # Windows reserved before the refusal give the money back; a crash here
            # leaves it reserved until the key's record says FAILED (fails closed).
            self.settle(key, token, done, spent=False)
            raise

    def _reserve_one(self, key: str, token: int, amount: Money, w: Window) -> None:
        def change(doc: dict[str, Any] | None, now: float) -> dict[str, Any]:
            doc = _fresh(doc, w)
            held = doc["reserved"].get(key)
            if held is not None and held["token"] == token and held["amount"] == amount.amount:
                raise _gatestore.Unchanged(doc)
            if not _fits(doc, key, amount.amount, w) and not (
                _settle_stale(self.backend, doc) and _fits(doc, key, amount.amount, w)
            ):
                raise _exceeded(key, amount, doc, w)
            doc["reserved"][key] = {"token": token, "amount": amount.amount, "at": now}
            share = w.cap.warn_at
            used = int(doc["committed"]) + _reserved(doc)
            if share is not None and used >= share * w.cap.limit:
                warned = list(doc.get("warned") or ())
                if share not in warned:
                    doc["warned"] = [*warned, share]
                    doc["warned_by"] = key
            return _stated(doc)

        _gatestore.update(self.backend, w.key, change, _threshold_notes)

    def settle(self, key: str, token: int, caps: Sequence[Window], *, spent: bool) -> None:
        """The body of the claim (`key`, `token`) is over: its reservation in every window
        of `caps` becomes spent (`spent=True`) or is released. Raises `LedgerUnavailable`
        if the store cannot be written."""
        for w in caps:

            def change(doc: dict[str, Any] | None, now: float, w: Window = w) -> dict[str, Any]:
                doc = _fresh(doc, w)
                held = doc["reserved"].get(key)
                if held is None or held["token"] != token:
                    raise _gatestore.Unchanged(doc)
                del doc["reserved"][key]
                if spent:
                    doc["committed"] += int(held["amount"])
                _log(doc, key, held, "committed" if spent else "released")
                return _stated(doc)

            _gatestore.update(self.backend, w.key, change)

    def budgets(
        self, *, settle: bool = True, every: bool = False, recent_s: float = RECENT_S
    ) -> list[Budget]:
        """The cap windows that count now: those holding reservations, every "total" and
        "crew" window (each later call counts against them), and the others written in
        the last `recent_s` seconds (today's, the kickoffs' and tasks' running now), by
        key. Read from the store's index of the documents by state and by time, so the
        windows of the kickoffs of months ago, one per kickoff, are not read; `every`: every
        window in the ledger instead (reading them all). With `settle`, reservations whose
        call is over are shown where they belong (nothing is written). Raises `ValueError`
        for a `recent_s` that is not a number of seconds, 0 or more, and
        `LedgerUnavailable` if the store cannot be read."""
        if isinstance(recent_s, bool) or not isinstance(recent_s, int | float) or recent_s < 0:
            raise ValueError(f"recent_s must be a number of seconds, 0 or more, not {recent_s!r}")
        found: dict[str, Budget] = {}
        for record, doc in self._windows(every, recent_s):
            if record.key in found:
                continue  # a window in two of the selects (held, and written recently)
            if settle:
                _settle_stale(self.backend, doc)
            found[record.key] = Budget(
                key=record.key,
                scope=doc["scope"],
                cap=doc["cap"],
                per=doc["per"],
                window=doc["window"],
                currency=doc["currency"],
                limit=int(doc["limit"]),
                committed=int(doc["committed"]),
                reserved=_reserved(doc),
                reservations=dict(doc["reserved"]),
            )
        return sorted(found.values(), key=lambda b: b.key)

    def _windows(self, every: bool, recent_s: float) -> Iterator[tuple[Record, dict[str, Any]]]:
        if every:
            yield from _gatestore.select(self.backend, KIND)
            return
        for state in (HELD, STANDING):
            yield from _gatestore.select(self.backend, KIND, state=state)
        # Recent ones whatever their state: a window an earlier version wrote has none.
        since = self.backend.now() - recent_s
        yield from _gatestore.select(self.backend, KIND, updated_from=since)


def _threshold_notes(old: dict[str, Any] | None, new: dict[str, Any]) -> list[Note]:
    """A window whose spent and reserved money reached a cap's warning share."""
    crossed = set(new.get("warned") or ()) - set((old or {}).get("warned") or ())
    notes = []
    for share in sorted(crossed):
        data = {
            "cap": f"{new['scope']}/{new['cap']}/{new['window']}", "scope": new["scope"],
            "name": new["cap"], "per": new["per"], "window": new["window"],
            "currency": new["currency"], "limit": int(new["limit"]),
            "committed": int(new["committed"]), "reserved": _reserved(new), "share": share,
            "key": new.get("warned_by"),
        }  # fmt: skip
        notes.append(Note("spend.threshold", data))
    return notes


def _fresh(doc: dict[str, Any] | None, w: Window) -> dict[str, Any]:
    if doc is None:
        return _empty(w)
    doc = {**doc, "reserved": dict(doc["reserved"])}
    doc["limit"] = w.cap.limit  # the configuration in force is the limit; the document follows
    return doc


def _fits(doc: dict[str, Any], key: str, amount: int, w: Window) -> bool:
    return int(doc["committed"]) + _reserved(doc, but=key) + amount <= w.cap.limit


def _exceeded(key: str, amount: Money, doc: dict[str, Any], w: Window) -> SpendCapExceeded:
    return SpendCapExceeded(
        key, f"{w.scope}/{w.cap.label}/{w.window}", amount.amount, amount.currency,
        w.cap.limit, int(doc["committed"]), _reserved(doc, but=key),
    )  # fmt: skip
