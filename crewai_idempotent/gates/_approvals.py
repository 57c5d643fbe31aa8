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

Signed decisions (`signing`): an approval or denial made with a signer (an operator's key,
an approver's passkey through the console) keeps its `Decision` and `SignatureEnvelope`
beside it, signed over exactly what it decides: the request, its round, the call (key and
fingerprint) and, for an approval, the grant's deadline. `Approvals` made with trusted
keys (the guard's, from configure() or the environment) refuse to use a grant unless every
approval of its round verifies against them and is about this call as the guard computed
it (`_checked_grant`), and count the two-person rule in distinct identities of the keys
that signed. A grant refused so starts a new round: the request is asked again and nothing
runs. A denial is obeyed signed or not: it only stops a call, so a forged one can stop a
payment, never make one (docs/security.md).

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
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import signing
from .._errors import (
    ApprovalAlreadyDecided,
    ApprovalDenied,
    ApprovalMovedOn,
    ApprovalNeedsAnother,
    ApprovalNotFound,
    ApprovalRequired,
    DecisionRefused,
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
    doc: dict[str, Any],
    now: float,
    what: str,
    by: str,
    note: str = "",
    via: str = "",
    proof: Mapping[str, Any] | None = None,
) -> None:
    entry = {"at": now, "what": what, "by": by, "note": note}
    if via:
        entry["via"] = via  # where the decision was made: "console", "slack", ...
    if proof is not None:
        entry["signed"] = proof["signature"]["key"]  # the id of the key that signed it
    doc["history"] = [*doc["history"], entry][-_HISTORY_LIMIT:]


def _where(trusted: signing.TrustedKeys) -> str:
    return str(trusted.path) if trusted.path is not None else "the lines configured"


def _agreeing(
    signed: tuple[signing.Decision, signing.SignatureEnvelope],
    rid: str,
    grant: bool,
    by: str | None,
    via: str,
    reason: str,
) -> tuple[str, str, str]:
    """The `by`, `via` and `reason` of a decision signed elsewhere, checked against
    what the caller says of it (each may be left out)."""
    if not isinstance(signed, tuple) or len(signed) != 2:
        raise ValueError("signed= is a (Decision, SignatureEnvelope) pair")
    decision, envelope = signed
    if not isinstance(decision, signing.Decision) or not isinstance(
        envelope, signing.SignatureEnvelope
    ):
        raise ValueError(
            "signed= is a (Decision, SignatureEnvelope) pair, not "
            f"({type(decision).__name__}, {type(envelope).__name__})"
        )
    kind = "approve" if grant else "deny"
    if decision.kind != kind:
        raise ValueError(f"signed= holds a {decision.kind} decision, not a {kind} one")
    if decision.request != rid:
        raise ValueError(f"the signed decision is about request {decision.request}, not {rid}")
    for name, given, its in (("by", by, decision.by), ("via", via, decision.via),
                             ("reason", reason, decision.reason)):  # fmt: skip
        if given and given != its:
            raise ValueError(f"{name}={given!r}, but the signed decision says {its!r}")
    return decision.by, decision.via, decision.reason


def _about(decision: signing.Decision, doc: Mapping[str, Any], now: float) -> None:
    """Raise `ValueError` unless `decision` is about the request `doc` as it is now: its
    round and call, and (an approval) a deadline still ahead."""
    for name in ("round", "key", "fingerprint"):
        if getattr(decision, name) != doc[name]:
            raise (ApprovalMovedOn if name == "round" else ValueError)(
                f"the signed decision is about {name} {getattr(decision, name)!r} of request "
                f"{doc['id']}, which is at {doc[name]!r} now: sign the request as it is"
            )
    if decision.until is not None and decision.until <= now:
        raise ValueError(
            f"the signed approval of {doc['id']} ended at {decision.until:.0f} (seconds "
            "since the epoch), before it was written"
        )


Listener = Callable[[str, ApprovalRequest], None]


class Approvals:
    """Approval requests kept in `backend`, next to the idempotency records.

    `signer` (a `signing.Signer`): the key approvals and denials made here are signed
    with, as its identity, unless a call gives its own. `trusted_keys`
    (`signing.TrustedKeys`): the keys decisions must be signed with. With them, an
    approval without a signature is refused before anything is written, a signed one
    is checked before it is written (a key they do not trust is refused here rather
    than by the workers), and `authorize` uses a grant only if every approval of its
    round verifies and is about the call. `accept_unsigned_grants_until` (seconds since
    the epoch): until then, by this process's clock, `authorize` also counts approvals
    that carry no signature (made before signing was turned on); a badly signed one is
    refused all the same. Raises `TypeError` for a `signer` or `trusted_keys` of
    another type, `ValueError` for an `accept_unsigned_grants_until` that is not a
    number or is given without `trusted_keys`; each method says what else it raises.
    """

    def __init__(
        self,
        backend: CacheBackend,
        signer: signing.Signer | None = None,
        *,
        trusted_keys: signing.TrustedKeys | None = None,
        accept_unsigned_grants_until: float | None = None,
    ) -> None:
        self.backend = backend
        self._ledger = ledger_option(backend)  # what suggested commands add: --ledger URL
        if signer is not None and not isinstance(signer, signing.Signer):
            raise TypeError(f"signer must be a signing.Signer, not {type(signer).__name__}")
        if trusted_keys is not None and not isinstance(trusted_keys, signing.TrustedKeys):
            raise TypeError(
                f"trusted_keys must be signing.TrustedKeys, not {type(trusted_keys).__name__}"
            )
        until = accept_unsigned_grants_until
        if until is not None:
            if isinstance(until, bool) or not isinstance(until, int | float) or until != until:
                raise ValueError(
                    f"accept_unsigned_grants_until must be seconds since the epoch, not {until!r}"
                )
            if trusted_keys is None:
                raise ValueError(
                    "accept_unsigned_grants_until applies only with trusted_keys: without "
                    "them every grant is used unsigned"
                )
        self.signer = signer
        self.trusted_keys = trusted_keys
        self.accept_unsigned_grants_until = None if until is None else float(until)

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
        by: str | None = None,
        reason: str = "",
        ttl_s: float = DEFAULT_APPROVAL_TTL,
        via: str = "",
        round: int | None = None,
        signer: signing.Signer | None = None,
        signed: tuple[signing.Decision, signing.SignatureEnvelope] | None = None,
    ) -> ApprovalRequest:
        """Grant the PENDING request `rid`; the grant must be used within `ttl_s` seconds.

        `by` is who approves, as authenticated where the decision is made (not blank);
        `via` where, and `reason` why (both kept in the history). With `round`, the
        decision is refused (`ApprovalMovedOn`) unless the request is still in that round:
        it binds what the approver looked at. A request that needs more approvers stays
        PENDING with this approval counted.

        Signed: with `signer` (or the one `Approvals` was made with), the approval is a
        `signing.Decision` about this request's round, call and deadline, signed by
        that key as its identity (`by`, if given, must be that identity; `via` one of
        `signing.VIAS`, "api" by default). `signed=(decision, envelope)` is a signature
        made elsewhere (an approver's passkey in the console): the decision must approve
        this request's current round and call with a deadline still ahead, and its
        `by`, `via`, `reason` and `until` are the approval's (`by`, `via` and `reason`,
        if given, must agree; `ttl_s` is not used). The request keeps the decision and
        its signature with the approval.

        Raises `ValueError` for a blank `by` (unsigned), a `ttl_s` that is not a positive
        number, `signer` with `signed`, a decision that is not this request's or whose
        deadline passed, or a `by`, `via` or `reason` it does not agree with;
        `DecisionRefused` with trusted keys for an approval without a signature, or one
        they refuse (nothing is written); `ApprovalNotFound`, `ApprovalAlreadyDecided`
        for a request that is not PENDING, `ApprovalMovedOn`, `ApprovalNeedsAnother` when
        this identity has approved this round already, `SigningConfigurationError` if a
        trusted keys file changed and no longer passes, and `LedgerUnavailable` if the
        store cannot be written.
        """
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not ttl_s > 0:
            raise ValueError(f"ttl_s must be a positive number of seconds, not {ttl_s!r}")
        return self._decide(
            rid, ApprovalState.APPROVED, by, reason, ttl_s, via, round, signer, signed
        )

    def deny(
        self,
        rid: str,
        *,
        by: str | None = None,
        reason: str = "",
        via: str = "",
        round: int | None = None,
        signer: signing.Signer | None = None,
        signed: tuple[signing.Decision, signing.SignatureEnvelope] | None = None,
    ) -> ApprovalRequest:
        """Refuse the PENDING (or granted, unused) request `rid`: the call never runs.
        `by`, `reason`, `via`, `round`, `signer` and `signed` as for `approve` (a
        signed denial is a `signing.Decision.denial`). With trusted keys a denial
        without a signature is still written and obeyed: it only stops a call (a signed
        one is checked before it is written). Raises what `approve` raises, but no
        `DecisionRefused` for a denial without a signature."""
        return self._decide(rid, ApprovalState.DENIED, by, reason, None, via, round, signer, signed)

    def _decide(
        self,
        rid: str,
        state: ApprovalState,
        by: str | None,
        reason: str,
        ttl_s: float | None,
        via: str,
        round: int | None,
        signer: signing.Signer | None,
        signed: tuple[signing.Decision, signing.SignatureEnvelope] | None,
    ) -> ApprovalRequest:
        key = _doc_key(_check_id(rid))
        grant = state is ApprovalState.APPROVED
        if signer is not None and signed is not None:
            raise ValueError("give signer= or signed= (a signature made elsewhere), not both")
        if signer is not None and not isinstance(signer, signing.Signer):
            raise TypeError(f"signer must be a signing.Signer, not {type(signer).__name__}")
        if signed is None:
            signer = signer or self.signer
        if signed is not None:
            by, via, reason = _agreeing(signed, rid, grant, by, via, reason)
        elif signer is not None:
            if by is not None and by != signer.identity:
                raise ValueError(
                    f"by={by!r}, but the signing key belongs to {signer.identity!r}: a signed "
                    "decision is recorded under its key's identity"
                )
            by, via = signer.identity, via or "api"
            if via not in signing.VIAS:
                raise ValueError(f"via must be one of {', '.join(signing.VIAS)}, not {via!r}")
        elif not isinstance(by, str) or not by.strip():
            raise ValueError("by= must name who decides, and it is blank")
        elif grant and self.trusted_keys is not None:
            raise DecisionRefused(
                f"approval request {rid}", "unsigned",
                "this process trusts only signed approvals (trusted keys: "
                f"{_where(self.trusted_keys)}): give a signer (Approvals(backend, signer="
                "Signer.from_file(PATH)), or `crewai-idempotent approvals approve "
                f"{rid} --key FILE`); nothing was written",
                kind="approve",
            )  # fmt: skip
        assert by is not None

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
            proof = self._proof(doc, now, state, by, reason, ttl_s, via, signer, signed)
            host = self.backend.host_clock
            if grant:
                assert ttl_s is not None
                return _approved(doc, now, host, by, reason, ttl_s, via, proof)
            doc = {**doc, "state": state.value, "decided_at": now, "decided_by": by}
            doc.update(decision_reason=reason, grant_expires_at=None, grant_host=None)
            doc["denial"] = proof
            _event(doc, now, state.value.lower(), by, reason, via, proof)
            return doc

        decided = self._request(_gatestore.update(self.backend, key, change, _notes))
        _notify("decided", decided)
        return decided

    def _proof(
        self,
        doc: dict[str, Any],
        now: float,
        state: ApprovalState,
        by: str,
        reason: str,
        ttl_s: float | None,
        via: str,
        signer: signing.Signer | None,
        signed: tuple[signing.Decision, signing.SignatureEnvelope] | None,
    ) -> dict[str, Any] | None:
        """The signed decision this one is, as the request keeps it (None: unsigned):
        made here with `signer` for the request as it is now, or `signed` checked to be
        about it; either checked against the trusted keys, if any, before it is written."""
        if signed is not None:
            decision, envelope = signed
            _about(decision, doc, now)
        elif signer is not None:
            fields: dict[str, Any] = {
                "request": doc["id"], "round": doc["round"], "key": doc["key"],
                "fingerprint": doc["fingerprint"], "by": by, "via": via, "at": now,
                "reason": reason,
            }  # fmt: skip
            if state is ApprovalState.APPROVED:
                assert ttl_s is not None
                decision = signing.Decision.approval(until=now + ttl_s, **fields)
            else:
                decision = signing.Decision.denial(**fields)
            envelope = signer.sign(decision)
        else:
            return None
        if self.trusted_keys is not None:
            try:
                signing.verify(decision, envelope, self.trusted_keys, role="approve")
            except DecisionRefused as exc:
                raise DecisionRefused(
                    exc.subject, exc.reason,
                    f"{exc.detail}; the workers would refuse it, so nothing was written",
                    kind=exc.kind, key_id=exc.key_id,
                ) from None  # fmt: skip
        return {"decision": decision.to_json(), "signature": envelope.to_json()}

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

        With trusted keys, the grant is used only if every approval of its round is
        signed by a trusted key with the approve role, about this request (the id made
        here from the claim's key and `fingerprint`), round and call, with a deadline
        still ahead, and the keys belong to at least `approvers` distinct identities (a
        person's several keys count once); the grant then ends at the earliest deadline
        they signed. Otherwise `DecisionRefused` naming the request and what failed:
        nothing runs, and the request starts a new round, asked again.
        `SigningConfigurationError` if a trusted keys file changed and no longer passes.
        """
        if isinstance(approvers, bool) or not isinstance(approvers, int) or approvers < 1:
            raise ValueError(f"approvers must be a whole number, 1 or more, not {approvers!r}")
        rid = request_id(claim.key, fingerprint)
        created: list[bool] = [False]
        refusal: list[BaseException | None] = [None]
        trusted = self.trusted_keys
        told = reason  # what ApprovalRequired says: the reason, and how to approve
        if trusted is not None:
            told = (
                f"{reason}; approvals are signed: approve with --key FILE or "
                "$CREWAI_IDEMPOTENCY_SIGNING_KEY naming a key the workers trust"
            )

        def change(doc: dict[str, Any] | None, now: float) -> dict[str, Any]:
            created[0] = False
            refusal[0] = None
            if doc is None:
                created[0] = True
                refusal[0] = ApprovalRequired(claim.key, rid, tool, told, ledger=self._ledger)
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
                    claim.key, rid, tool, f"{told} ({waiting})", ledger=self._ledger
                )
                if stricter:
                    return doc
                raise _gatestore.Unchanged(doc)
            if state is ApprovalState.DENIED:
                why = doc["decision_reason"]
                if trusted is not None and not _signed_denial(doc, rid, trusted):
                    why = f"{why} ({_UNSIGNED_DENIAL})" if why else _UNSIGNED_DENIAL
                refusal[0] = ApprovalDenied(claim.key, rid, doc["decided_by"] or "?", why)
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
            refused: DecisionRefused | None = None
            if why_again is None and trusted is not None:
                try:
                    needed = max(approvers, int(doc.get("approvers_needed", 1)))
                    if self._checked_grant(doc, claim.key, fingerprint, rid, needed) <= now:
                        expired = True
                        why_again = "the approval expired before the call ran"
                except DecisionRefused as exc:
                    refused = exc
                    why_again = f"an approval was refused ({exc.reason}): {exc.detail}"
            if why_again is not None:
                if expired:
                    doc = {**doc, "expired_round": doc["round"]}
                if spend is not None:
                    doc = {**doc, "spend": dict(spend)}
                doc = _new_round(doc, now, why_again)
                created[0] = True
                refusal[0] = ApprovalRequired(
                    claim.key, rid, tool, f"{told}; {why_again}", ledger=self._ledger
                )
                if refused is not None:
                    approve = command(self._ledger, "approvals", "approve", rid, "--key", "FILE")
                    refusal[0] = DecisionRefused(
                        f"approval request {rid}", refused.reason,
                        f"{refused.detail}; nothing was run. The request is asked again, "
                        f"in round {doc['round']}: approve it with a key the workers trust "
                        f"(`{approve}`)",
                        kind="approve", key_id=refused.key_id,
                    )  # fmt: skip
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

    def _checked_grant(
        self, doc: Mapping[str, Any], key: str, fingerprint: str, rid: str, needed: int
    ) -> float:
        """The deadline the approvals of `doc`'s round signed (the earliest), once each is
        checked against the trusted keys and found to approve request `rid` of the call
        under `key` with `fingerprint` (as the guard computed them, never read from the
        ledger), and their keys belong to `needed` distinct identities; else
        `DecisionRefused`. Unsigned approvals count only while unsigned grants are
        accepted."""
        trusted = self.trusted_keys
        assert trusted is not None
        subject = f"approval request {rid}"

        def refuse(reason: str, detail: str, key_id: str | None = None) -> DecisionRefused:
            return DecisionRefused(subject, reason, detail, kind="approve", key_id=key_id)

        until = self.accept_unsigned_grants_until
        unsigned_ok = until is not None and time.time() < until
        entries = doc.get("approvals")
        if not isinstance(entries, list) or not entries:
            raise refuse(
                "unsigned",
                f"it is {doc.get('state')} but holds no approval, signed or not (the state was "
                "written without one)",
            )
        identities: dict[str, list[str]] = {}
        deadline = math.inf
        for entry in entries:
            if not isinstance(entry, Mapping):
                raise refuse("malformed", f"an approval of it is not an object: {entry!r:.80}")
            who = entry.get("by")
            made, signature = entry.get("decision"), entry.get("signature")
            if made is None and signature is None:
                if not unsigned_ok:
                    raise refuse(
                        "unsigned",
                        f"the approval by {who!r:.200} carries no signature, and this process "
                        f"trusts only signed approvals (trusted keys: {_where(trusted)})",
                    )
                ends = entry.get("until")
                if (
                    not isinstance(who, str)
                    or isinstance(ends, bool)
                    or not isinstance(ends, int | float)
                ):
                    raise refuse(
                        "malformed", f"an unsigned approval of it is malformed: {entry!r:.80}"
                    )
                identities.setdefault(who, []).append("unsigned")
                deadline = min(deadline, float(ends))
                continue
            if made is None:
                raise refuse(
                    "malformed", f"the approval by {who!r:.200} has a signature and no decision"
                )
            try:
                decision = signing.Decision.from_json(made)
            except (ValueError, TypeError) as exc:
                raise refuse(
                    "malformed", f"the approval by {who!r:.200} cannot be read: {exc}"
                ) from None
            try:
                signer = signing.verify(decision, signature, trusted, role="approve")
            except DecisionRefused as exc:
                raise refuse(
                    exc.reason, f"the approval by {who!r:.200}: {exc.detail}", exc.key_id
                ) from None
            wrong = _not_about(decision, rid, doc["round"], key, fingerprint)
            if wrong is not None:
                raise refuse(
                    "subject",
                    f"the approval signed by {decision.by} is not about this call: {wrong}",
                    signer.key_id,
                )
            identities.setdefault(signer.identity, []).append(signer.key_id)
            assert decision.until is not None  # an approval's deadline is one of its fields
            deadline = min(deadline, decision.until)
        if len(identities) < needed:
            named = "; ".join(
                f"{who} ({len(keys)} signature{'s' if len(keys) != 1 else ''})"
                for who, keys in identities.items()
            )
            raise refuse(
                "approvers",
                f"it needs {needed} distinct approvers and its approvals are by "
                f"{len(identities)}: {named} (one person counts once, whatever the keys)",
            )
        return deadline


_UNSIGNED_DENIAL = (
    "this denial carries no signature a trusted key made; it is obeyed all the same, as a "
    "denial only stops a call"
)


def _signed_denial(doc: Mapping[str, Any], rid: str, trusted: signing.TrustedKeys) -> bool:
    """Whether a DENIED request's denial is signed by a trusted key and about it."""
    proof = doc.get("denial")
    if not isinstance(proof, Mapping):
        return False
    try:
        decision = signing.Decision.from_json(proof.get("decision"))  # type: ignore[arg-type]
        signing.verify(decision, proof.get("signature"), trusted, role="approve")
    except (DecisionRefused, ValueError, TypeError):
        return False
    return decision.kind == "deny" and decision.request == rid and decision.round == doc["round"]


def _not_about(
    decision: signing.Decision, rid: str, round: int, key: str, fingerprint: str
) -> str | None:
    """What in a verified decision is not this call's approval (None: all of it is)."""
    if decision.kind != "approve":
        return f"it is a {decision.kind} decision, not an approval"
    if decision.request != rid:
        return f"it approves request {decision.request}, not {rid}"
    if decision.key != key:
        return f"it approves idempotency key {decision.key!r:.200}, not {key!r:.200}"
    if decision.fingerprint != fingerprint:
        return "it approves other arguments (another fingerprint) under this key"
    if decision.round != round:
        return f"it approves round {decision.round}, and the request is in round {round}"
    return None


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
    proof: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`doc` with `by`'s approval counted: APPROVED once enough distinct identities have
    approved (the grant ends at the earliest of their deadlines), else still PENDING. A
    signed approval (`proof`) ends when its decision says."""
    needed = int(doc.get("approvers_needed", 1))
    live = [a for a in doc.get("approvals", ()) if not _lapsed(a, now, host)]
    if any(a["by"] == by for a in live):
        raise ApprovalNeedsAnother(
            f"{by} has already approved {doc['id']} (round {doc['round']}); it needs "
            f"{needed} distinct approvers, {len(live)} so far"
        )
    if proof is not None:
        ttl_s = proof["decision"]["until"] - now
    entry: dict[str, Any] = {"by": by, "at": now, "until": now + ttl_s, "reason": reason}
    entry.update(via=via, host=[host.boot, host.elapsed() + ttl_s] if host is not None else None)
    if proof is not None:
        entry.update(proof, until=proof["decision"]["until"])
    live.append(entry)
    doc = {**doc, "approvals": live}
    if len(live) < needed:
        note = f"{len(live)} of {needed} approvers; {reason}"
        _event(doc, now, "approved", by, note, via, proof)
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
    _event(doc, now, "approved", by, reason, via, proof)
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
