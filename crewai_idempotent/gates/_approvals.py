"""Approval requests bound to one call: its idempotency key and its arguments' fingerprint.

A request is a document in the ledger (see `_gatestore`), one per (key, fingerprint), so
that any number of processes asking for the same call create it once (insert-if-absent)
and different arguments under the same key are a different request, never a reuse.

States:

    PENDING --approve--> APPROVED --a claim of the key starts its body--> USED
       |                    |  \\--grant expired when a body would start--> PENDING (new round)
       \\--deny--> DENIED    \\--deny--> DENIED

A grant is used by the ledger claim whose body it lets start (its fencing token and the
record's creation time are kept). The ledger runs a key's body at most once while its
outcome is known, so "used once" is the key's own promise: a takeover of the same record
after the body is known not to have run (FAILED, `resolve --absent`) may use the grant
again; once the key has committed, or under a new record for the key, the grant is spent
and a new round of approval is needed.

A request may need several distinct approvers (`approvers_needed`, the two-person rule):
each approval is kept in `approvals` while the request stays PENDING, and the grant goes
live, APPROVED, with the last one needed; it lasts until the earliest of their deadlines.
One identity counts once; an approval whose own deadline passed before the others came
no longer counts; one denial denies. A new round starts with none.

A grant lasts `ttl_s` seconds of real time. On an embedded ledger (one host) it is judged
by the host's clock (`_hostclock`), which no wall-clock step moves: a clock set back an
hour does not stretch a grant, one set forward does not end it. Its deadline on that clock
is kept beside the wall-clock one it was written with (`grant_host`), and used only while
the two still match: a grant written under another boot, or by a version that did not
write one, is judged by the wall clock.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._errors import (
    ApprovalAlreadyDecided,
    ApprovalDenied,
    ApprovalMovedOn,
    ApprovalNeedsAnother,
    ApprovalNotFound,
    ApprovalRequired,
    command,
)
from ..ledger._backend import CacheBackend, ledger_option, url_of
from ..ledger._hostclock import HostClock
from ..ledger._record import Record
from ..ledger._select import Order, Position, Select
from ..notifications._outbox import Note
from . import _gatestore

KIND = "approval/"
DEFAULT_APPROVAL_TTL = 24 * 3600.0
_HISTORY_LIMIT = 50


class ApprovalState(enum.StrEnum):
    PENDING = "PENDING"
    APPROVED = "APPROVED"
    DENIED = "DENIED"
    USED = "USED"


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    """One stored request, as `approvals show` prints it."""

    id: str
    key: str
    fingerprint: str
    tool: str
    state: ApprovalState
    summary: dict[str, Any]
    reason: str
    created_at: float
    crew: str | None = None
    task: str | None = None
    kickoff: str | None = None
    round: int = 1
    decided_at: float | None = None
    decided_by: str | None = None
    decision_reason: str = ""
    grant_expires_at: float | None = None
    used_at: float | None = None
    used_token: int | None = None
    history: tuple[dict[str, Any], ...] = field(default=())
    # The call's amount and the cap windows it counts against, as they stood when asked.
    spend: dict[str, Any] | None = None
    # The two-person rule: how many distinct identities must approve, and who has so far
    # in this round (by, at, until, reason, via).
    approvers_needed: int = 1
    approvals: tuple[dict[str, Any], ...] = field(default=())
    # The crew, task and agent that asked, as people name them (crew, task and kickoff
    # above are the keys the spend caps' windows use).
    origin: dict[str, Any] = field(default_factory=dict)
    # Not stored: the URL of the ledger it was read from (None: the CLI's default ledger).
    ledger: str | None = field(default=None, compare=False)
    # Not stored: where its document stands in a listing's order (`Approvals.select`):
    # give it as `after` for the next page. None when it was not read by a listing.
    position: Position | None = field(default=None, compare=False)

    @property
    def approve_command(self) -> str:
        """The command that approves it, naming the ledger when it is not the default."""
        return command(self.ledger, "approvals", "approve", self.id)

    @classmethod
    def from_doc(
        cls, d: Mapping[str, Any], ledger: str | None = None, position: Position | None = None
    ) -> ApprovalRequest:
        return cls(
            id=d["id"], key=d["key"], fingerprint=d["fingerprint"], tool=d["tool"],
            state=ApprovalState(d["state"]), summary=dict(d["summary"]), reason=d["reason"],
            created_at=d["created_at"], crew=d["crew"], task=d["task"], kickoff=d["kickoff"],
            round=d["round"], decided_at=d["decided_at"], decided_by=d["decided_by"],
            decision_reason=d["decision_reason"], grant_expires_at=d["grant_expires_at"],
            used_at=d["used_at"], used_token=d["used_token"], history=tuple(d["history"]),
            spend=d.get("spend"), approvers_needed=d.get("approvers_needed", 1),
            approvals=tuple(d.get("approvals", ())), origin=dict(d.get("origin") or {}),
            ledger=ledger, position=position,
        )  # fmt: skip


def request_id(key: str, fingerprint: str) -> str:
    """The id of the request for this exact call: the same in every process."""
    digest = hashlib.sha256(f"{key}\x00{fingerprint}".encode("utf-8", "surrogatepass"))
    return "ap_" + digest.hexdigest()[:20]


def _doc_key(rid: str) -> str:
    return f"{_gatestore.PREFIX}{KIND}{rid}"


def _state(state: ApprovalState | str | None) -> ApprovalState | None:
    if state is None or str(state).lower() == "all":
        return None
    try:
        return ApprovalState(str(state).upper())
    except ValueError:
        names = ", ".join(s.value.lower() for s in ApprovalState)
        raise ValueError(f"state must be one of {names} or all, not {state!r}") from None


def _check_id(rid: Any) -> str:
    if not isinstance(rid, str) or not rid.startswith("ap_") or len(rid) != 23:
        raise ValueError(f"not an approval request id (ap_ and 20 hex digits): {rid!r}")
    return rid


def _event(
    doc: dict[str, Any], now: float, what: str, by: str, note: str = "", via: str = ""
) -> None:
    entry = {"at": now, "what": what, "by": by, "note": note}
    if via:
        entry["via"] = via  # where the decision was made: "console", "slack", ...
    doc["history"] = [*doc["history"], entry][-_HISTORY_LIMIT:]


Listener = Callable[[str, ApprovalRequest], None]


class Approvals:
    """Approval requests kept in `backend`, next to the idempotency records. Raises
    nothing until used: each method says what it raises."""

    def __init__(self, backend: CacheBackend) -> None:
        self.backend = backend
        self._ledger = ledger_option(backend)  # what suggested commands add: --ledger URL

    def _request(self, doc: Mapping[str, Any]) -> ApprovalRequest:
        return ApprovalRequest.from_doc(doc, self._ledger)

    # -- operators ---------------------------------------------------------------------

    def get(self, rid: str) -> ApprovalRequest:
        """The request `rid` (`ap_...`). Raises `ValueError` for a malformed id,
        `ApprovalNotFound` if there is none, `LedgerUnavailable` if the store cannot be
        read."""
        doc = _gatestore.read(self.backend, _doc_key(_check_id(rid)))
        if doc is None:
            raise ApprovalNotFound(f"no approval request {rid!r} in {url_of(self.backend)}")
        return self._request(doc)

    def list(self, state: ApprovalState | str | None = None) -> list[ApprovalRequest]:
        """Every request (or those in `state`: an `ApprovalState`, its name in any case,
        or "all"), oldest first: a list, holding them all (`select` pages instead). Raises
        `ValueError` for an unknown state and `LedgerUnavailable` if the store cannot be
        read."""
        return sorted(self.select(state), key=lambda r: r.created_at)

    def select(
        self,
        state: ApprovalState | str | None = None,
        *,
        key: str | None = None,
        order: Order = Order.KEY,
        after: Position | None = None,
        limit: int | None = None,
    ) -> Iterator[ApprovalRequest]:
        """The requests in `state` (as for `list`; None or "all": every one), or for the
        call under the idempotency key `key`, in `order` (`Order.NEWEST`: the last decided
        or asked first) from `after` on (the `position` of the last request of the
        previous page), at most `limit`: read from the store's index of the documents by
        state, so a page costs a page. Raises `ValueError` for an unknown state and
        `LedgerUnavailable` while it is iterated, if the store cannot be read."""
        wanted = _state(state)
        found = _gatestore.select(
            self.backend, KIND, state=None if wanted is None else wanted.value, subject=key,
            order=order, after=after, limit=limit,
        )  # fmt: skip
        query = Select(order=order)
        for record, doc in found:
            yield ApprovalRequest.from_doc(doc, self._ledger, query.position(record))

    def approve(
        self,
        rid: str,
        *,
        by: str,
        reason: str = "",
        ttl_s: float = DEFAULT_APPROVAL_TTL,
        via: str = "",
        round: int | None = None,
    ) -> ApprovalRequest:
        """Grant the PENDING request `rid`; the grant must be used within `ttl_s` seconds.

        `by` is who approves, as authenticated where the decision is made (not blank);
        `via` where, and `reason` why (both kept in the history). With `round`, the
        decision is refused (`ApprovalMovedOn`) unless the request is still in that round:
        it binds what the approver looked at. A request that needs more approvers stays
        PENDING with this approval counted. Raises `ValueError` for a blank `by` or a
        `ttl_s` that is not a positive number, `ApprovalNotFound`, `ApprovalAlreadyDecided`
        for a request that is not PENDING, `ApprovalNeedsAnother` when `by` has approved
        this round already, and `LedgerUnavailable` if the store cannot be written.
        """
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not ttl_s > 0:
            raise ValueError(f"ttl_s must be a positive number of seconds, not {ttl_s!r}")
        return self._decide(rid, ApprovalState.APPROVED, by, reason, ttl_s, via, round)

    def deny(
        self, rid: str, *, by: str, reason: str = "", via: str = "", round: int | None = None
    ) -> ApprovalRequest:
        """Refuse the PENDING (or granted, unused) request `rid`: the call never runs.
        `by`, `reason`, `via` and `round` as for `approve`; raises what `approve` raises."""
        return self._decide(rid, ApprovalState.DENIED, by, reason, None, via, round)

    def _decide(
        self,
        rid: str,
        state: ApprovalState,
        by: str,
        reason: str,
        ttl_s: float | None,
        via: str,
        round: int | None,
    ) -> ApprovalRequest:
        if not isinstance(by, str) or not by.strip():
            raise ValueError("by= must name who decides, and it is blank")
        key = _doc_key(_check_id(rid))

        def change(doc: dict[str, Any] | None, now: float) -> dict[str, Any]:
            if doc is None:
                raise ApprovalNotFound(f"no approval request {rid!r} in {url_of(self.backend)}")
            if round is not None and doc["round"] != round:
                raise ApprovalMovedOn(
                    f"approval request {rid} is in round {doc['round']} now, not {round} "
                    f"({doc['state']}): the decision was made on what it showed then"
                )
            current = ApprovalState(doc["state"])
            allowed = (ApprovalState.PENDING,) + (
                (ApprovalState.APPROVED,) if state is ApprovalState.DENIED else ()
            )
            if current not in allowed:
                raise ApprovalAlreadyDecided(
                    f"approval request {rid} is {current.value}"
                    + (f" (by {doc['decided_by']})" if doc["decided_by"] else "")
                    + f"; only a PENDING request can be {state.value.lower()}"
                )
            host = self.backend.host_clock
            if ttl_s is not None:
                return _approved(doc, now, host, by, reason, ttl_s, via)
            doc = {**doc, "state": state.value, "decided_at": now, "decided_by": by}
            doc.update(decision_reason=reason, grant_expires_at=None, grant_host=None)
            _event(doc, now, state.value.lower(), by, reason, via)
            return doc

        decided = self._request(_gatestore.update(self.backend, key, change, _notes))
        _notify("decided", decided)
        return decided

    def expire(self, rid: str, round: int) -> ApprovalRequest | None:
        """Record that round `round` of a granted request ended unused: its grant expired
        (an "approval.expired" entry). None, and nothing written, while it has not, or
        once the request has moved on. The outbox's dispatcher calls it when the grant of
        an approval it delivered runs out; a later call of the key opens a new round.
        Raises `ValueError` for an `rid` that is not a request id, and `LedgerUnavailable`
        if the store cannot be written."""
        key = _doc_key(_check_id(rid))

        def change(doc: dict[str, Any] | None, now: float) -> dict[str, Any]:
            if (
                doc is None
                or doc["state"] != ApprovalState.APPROVED.value
                or doc["round"] != round
                or doc.get("expired_round") == round
                or not _grant_expired(doc, now, self.backend.host_clock)
            ):
                raise _gatestore.Unchanged({})  # nothing to say: `update` returns {}
            doc = {**doc, "expired_round": round}
            _event(doc, now, "expired", "dispatcher", "the grant expired before a call used it")
            return doc

        found = _gatestore.update(self.backend, key, change, _notes)
        return self._request(found) if found else None

    # -- the gated call ----------------------------------------------------------------

    def authorize(
        self,
        claim: Record,
        fingerprint: str,
        *,
        tool: str,
        reason: str,
        summary: Mapping[str, Any],
        crew: str | None = None,
        task: str | None = None,
        kickoff: str | None = None,
        spend: Mapping[str, Any] | None = None,
        approvers: int = 1,
        origin: Mapping[str, Any] | None = None,
    ) -> ApprovalRequest:
        """Let the holder of `claim` start its body, or raise.

        Called under the claim (so one caller per key at a time). The request is the one
        for the claim's key and the arguments' `fingerprint`; `tool`, `reason`, `summary`
        (the arguments as an operator sees them), the `crew`, `task` and `kickoff` it runs
        in, the amount it would `spend` and its `origin` (the crew, task and agent that
        asked, as people name them) are stored with a new one. `approvers`: how many
        distinct identities must approve; a stored request that asked for fewer is raised
        to it (a grant short of it is not live any more). Returns the grant it used; raises
        `ApprovalRequired` (a request was created, or is still waiting, or a grant expired
        or was spent and a new round begins), `ApprovalDenied`, `ValueError` for an
        `approvers` that is not a whole number of 1 or more, or `LedgerUnavailable` if the
        store cannot be used.
        """
        if isinstance(approvers, bool) or not isinstance(approvers, int) or approvers < 1:
            raise ValueError(f"approvers must be a whole number, 1 or more, not {approvers!r}")
        rid = request_id(claim.key, fingerprint)
        created: list[bool] = [False]
        refusal: list[BaseException | None] = [None]

        def change(doc: dict[str, Any] | None, now: float) -> dict[str, Any]:
            created[0] = False
            refusal[0] = None
            if doc is None:
                created[0] = True
                refusal[0] = ApprovalRequired(claim.key, rid, tool, reason, ledger=self._ledger)
                doc = {
                    "kind": "approval", "id": rid, "key": claim.key, "fingerprint": fingerprint,
                    "tool": tool, "state": ApprovalState.PENDING.value, "summary": dict(summary),
                    "reason": reason, "created_at": now, "crew": crew, "task": task,
                    "kickoff": kickoff, "round": 1, "decided_at": None, "decided_by": None,
                    "decision_reason": "", "grant_expires_at": None, "used_at": None,
                    "used_token": None, "used_record": None, "history": [],
                    "spend": dict(spend) if spend is not None else None,
                    "approvers_needed": approvers, "approvals": [], "origin": dict(origin or {}),
                }  # fmt: skip
                _event(doc, now, "requested", tool, reason)
                return doc
            state = ApprovalState(doc["state"])
            stricter = approvers > doc.get("approvers_needed", 1)
            if stricter:
                doc = _stricter(doc, now, approvers, self.backend.host_clock)
                if state is ApprovalState.APPROVED and doc["state"] == ApprovalState.PENDING:
                    created[0] = True  # a new wait for people: as a new round is
                state = ApprovalState(doc["state"])
            if state is ApprovalState.PENDING:
                needed, given = doc.get("approvers_needed", 1), len(doc.get("approvals", ()))
                waiting = f"{given} of {needed} approvers" if given else "still pending"
                refusal[0] = ApprovalRequired(
                    claim.key, rid, tool, f"{reason} ({waiting})", ledger=self._ledger
                )
                if stricter:
                    return doc
                raise _gatestore.Unchanged(doc)
            if state is ApprovalState.DENIED:
                refusal[0] = ApprovalDenied(
                    claim.key, rid, doc["decided_by"] or "?", doc["decision_reason"]
                )
                raise _gatestore.Unchanged(doc)
            expired = _grant_expired(doc, now, self.backend.host_clock)
            same_run = (
                state is ApprovalState.USED
                and doc["used_record"] == claim.created_at
                and not any(e.kind == "commit" for e in claim.history)
            )
            why_again = None
            if expired:
                why_again = "the approval expired before the call ran"
            elif state is ApprovalState.USED and not same_run:
                why_again = "the earlier approval was used by a run that finished"
            elif state is ApprovalState.USED and stricter:
                why_again = f"the tool now needs {approvers} approvers"
            if why_again is not None:
                if expired:
                    doc = {**doc, "expired_round": doc["round"]}
                if spend is not None:
                    doc = {**doc, "spend": dict(spend)}
                doc = _new_round(doc, now, why_again)
                created[0] = True
                refusal[0] = ApprovalRequired(
                    claim.key, rid, tool, f"{reason}; {why_again}", ledger=self._ledger
                )
                return doc
            doc = {**doc, "state": ApprovalState.USED.value, "used_at": now}
            doc["used_token"] = claim.token
            doc["used_record"] = claim.created_at
            _event(doc, now, "used", f"token {claim.token}")
            return doc

        doc = _gatestore.update(self.backend, _doc_key(rid), change, _notes)
        request = self._request(doc)
        if created[0]:
            _notify("created", request)
        if refusal[0] is not None:
            raise refusal[0]
        return request


def _notes(old: dict[str, Any] | None, new: dict[str, Any]) -> list[Note]:
    """What a change of a request means for a person: asked (a new request, or a new
    round of one), approved, denied, or expired unused."""
    if old is None:
        return [Note("approval.requested", _data(new))]
    notes = []
    if new.get("expired_round") is not None and new.get("expired_round") != old.get(
        "expired_round"
    ):
        notes.append(Note("approval.expired", _data({**old, "expired_round": old["round"]})))
    if new["round"] != old["round"]:
        notes.append(Note("approval.requested", _data(new)))
    elif new["state"] != old["state"] and new["state"] in ("APPROVED", "DENIED"):
        notes.append(Note(f"approval.{new['state'].lower()}", _data(new)))
    return notes


def _data(doc: dict[str, Any]) -> dict[str, Any]:
    """A request as its entries carry it: everything but its history, the whole call."""
    return {name: value for name, value in doc.items() if name not in ("history", "outbox")}


def _grant_expired(doc: dict[str, Any], now: float, host: HostClock | None) -> bool:
    """Whether a grant's time is up: by the host's clock when its deadline on it was read
    on this boot and still goes with the grant's wall-clock deadline, else by `now`."""
    at = doc["grant_expires_at"]
    if at is None:
        return False
    stamp = doc.get("grant_host")
    if (
        host is not None
        and isinstance(stamp, list)
        and len(stamp) == 3
        and stamp[0] == host.boot
        and stamp[2] == at
    ):
        return bool(stamp[1] <= host.elapsed())
    return bool(at <= now)


def _lapsed(approval: Mapping[str, Any], now: float, host: HostClock | None) -> bool:
    """Whether one approver's own deadline has passed (judged as a grant is)."""
    stamp = approval.get("host")
    if host is not None and isinstance(stamp, list) and len(stamp) == 2 and stamp[0] == host.boot:
        return bool(stamp[1] <= host.elapsed())
    return bool(approval["until"] <= now)


def _approved(
    doc: dict[str, Any],
    now: float,
    host: HostClock | None,
    by: str,
    reason: str,
    ttl_s: float,
    via: str,
) -> dict[str, Any]:
    """`doc` with `by`'s approval counted: APPROVED once enough distinct identities have
    approved (the grant ends at the earliest of their deadlines), else still PENDING."""
    needed = int(doc.get("approvers_needed", 1))
    live = [a for a in doc.get("approvals", ()) if not _lapsed(a, now, host)]
    if any(a["by"] == by for a in live):
        raise ApprovalNeedsAnother(
            f"{by} has already approved {doc['id']} (round {doc['round']}); it needs "
            f"{needed} distinct approvers, {len(live)} so far"
        )
    entry: dict[str, Any] = {"by": by, "at": now, "until": now + ttl_s, "reason": reason}
    entry.update(via=via, host=[host.boot, host.elapsed() + ttl_s] if host is not None else None)
    live.append(entry)
    doc = {**doc, "approvals": live}
    if len(live) < needed:
        _event(doc, now, "approved", by, f"{len(live)} of {needed} approvers; {reason}", via)
        return doc
    first = min(live, key=lambda a: a["until"])
    until = first["until"]
    doc.update(state=ApprovalState.APPROVED.value, decided_at=now, grant_expires_at=until)
    doc["decided_by"] = ", ".join(a["by"] for a in live)
    doc["decision_reason"] = (
        reason
        if needed == 1
        else "; ".join(f"{a['by']}: {a['reason']}" for a in live if a["reason"])
    )
    if host is None:
        doc["grant_host"] = None
    else:
        left = min(
            a["host"][1] - host.elapsed() if a["host"] and a["host"][0] == host.boot
            else a["until"] - now
            for a in live
        )  # fmt: skip
        doc["grant_host"] = [host.boot, host.elapsed() + left, until]
    _event(doc, now, "approved", by, reason, via)
    return doc


def _stricter(
    doc: dict[str, Any], now: float, needed: int, host: HostClock | None
) -> dict[str, Any]:
    """The request now needs `needed` approvers: a grant that had fewer is not live."""
    doc = {**doc, "approvers_needed": needed}
    live = [a for a in doc.get("approvals", ()) if not _lapsed(a, now, host)]
    if doc["state"] == ApprovalState.APPROVED.value and len(live) < needed:
        doc.update(state=ApprovalState.PENDING.value, approvals=live, decided_at=None)
        doc.update(decided_by=None, decision_reason="", grant_expires_at=None, grant_host=None)
        _event(doc, now, "reopened", "guard", f"the tool now needs {needed} approvers")
    return doc


def _new_round(doc: dict[str, Any], now: float, why: str) -> dict[str, Any]:
    doc = {**doc, "state": ApprovalState.PENDING.value, "round": doc["round"] + 1}
    doc.update(decided_at=None, decided_by=None, decision_reason="", grant_expires_at=None)
    doc["grant_host"] = None
    doc["approvals"] = []
    doc.update(used_at=None, used_token=None, used_record=None)
    _event(doc, now, "reopened", "guard", why)
    return doc


_listeners: list[Listener] = []


def add_listener(listener: Listener) -> None:
    """Call `listener(kind, request)` in this process when a request is created
    ("created") or decided ("decided") here. The crewAI integration puts them on
    crewAI's event bus."""
    if listener not in _listeners:
        _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def _notify(kind: str, request: ApprovalRequest) -> None:
    import logging

    for listener in list(_listeners):
        try:
            listener(kind, request)
        except Exception:  # a notifier never changes what the gate decides
            logging.getLogger("crewai_idempotent").exception(
                "approval listener failed for %s", request.id
            )


def summarize(args: Mapping[str, Any], redact: tuple[str, ...] = ()) -> dict[str, Any]:
    """What an approver sees of the arguments: the whole call, every value in full (the
    channels and the CLI shorten what they display, the request never does), JSON values
    as they are, anything else by its repr; values named in `redact` hidden."""
    return {name: "<redacted>" if name in redact else _plain(value) for name, value in args.items()}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, bool | str):
        return value
    if type(value) in (int, float):
        return value if math.isfinite(value) else repr(value)
    if type(value) is dict and all(isinstance(k, str) for k in value):
        return {k: _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return [_plain(v) for v in value]
    return repr(value)
