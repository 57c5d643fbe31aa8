"""`crewai-idempotent approvals ls / show / approve / deny` and `crewai-idempotent spend`.

They use the same `--ledger` as the record commands; the gates' state lives in its backend.

`approve` and `deny` sign the decision with `--key FILE` (or the file
`$CREWAI_IDEMPOTENCY_SIGNING_KEY` names), as the key's identity. With
`$CREWAI_IDEMPOTENCY_TRUSTED_KEYS` set (what the workers trust), a decision without a key
is refused here, naming the flag, and one whose key those keys would refuse is refused
before anything is written.
"""

from __future__ import annotations

import json
from typing import Any

import click

from .. import ApprovalRequest, Approvals, SpendLedger, signing
from .._errors import (
    ApprovalAlreadyDecided,
    ApprovalNotFound,
    DecisionRefused,
    SigningConfigurationError,
)
from .._units import exponent, format_money
from ..gates._approvals import ApprovalState
from ..ledger._record import _whoami
from ._output import duration, ledger_errors, safe, stamp
from ._where import Where

_LS_SUMMARY = 200  # characters of the arguments `approvals ls` shows on a request's line
SIGNING_KEY_ENV = "CREWAI_IDEMPOTENCY_SIGNING_KEY"
TRUSTED_KEYS_ENV = "CREWAI_IDEMPOTENCY_TRUSTED_KEYS"  # signing.ENV, without loading signing


def _approvals(
    where: Where,
    signer: signing.Signer | None = None,
    trusted: signing.TrustedKeys | None = None,
) -> Approvals:
    return Approvals(where.ledger().backend, signer, trusted_keys=trusted)


def _stamp(at: float | None) -> str:
    return "-" if at is None else stamp(at)


def _fail(where: Where, exc: Exception) -> click.ClickException:
    return click.ClickException(safe(where.scrub(str(exc))))


@click.group("approvals")
def approvals() -> None:
    """Approval requests of gated tools: list, inspect, approve, deny. See docs/approvals.md."""


@approvals.command("ls")
@click.option(
    "--state",
    type=click.Choice(["pending", "approved", "denied", "used", "all"], case_sensitive=False),
    default="pending",
    show_default=True,
)
@click.option("--json", "as_json", is_flag=True, help="One JSON array instead of a table.")
@click.pass_obj
def list_approvals(where: Where, state: str, as_json: bool) -> None:
    """List approval requests (pending ones by default)."""
    with ledger_errors(where.scrub):
        found = _approvals(where).list(None if state.lower() == "all" else state)
    if as_json:
        click.echo(json.dumps([_doc(r) for r in found], indent=2, sort_keys=True))
        return
    if not found:
        click.echo(f"no {state.lower()} approval requests in {where.label}")
        return
    for r in found:
        summary = json.dumps(r.summary, sort_keys=True, default=str)
        if len(summary) > _LS_SUMMARY:  # one line per request; `show` prints the whole call
            summary = summary[: _LS_SUMMARY - 1] + "…"
        click.echo(
            safe(
                f"{r.id}  {r.state.value:<8}  {r.tool}  {summary}  key={r.key!r}  "
                f"asked {_stamp(r.created_at)}"
            )
        )


@approvals.command("show")
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True, help="The request as JSON.")
@click.pass_obj
def show_approval(where: Where, request_id: str, as_json: bool) -> None:
    """Everything stored about one request, its history included."""
    try:
        with ledger_errors(where.scrub):
            request = _approvals(where).get(request_id)
    except (ApprovalNotFound, ValueError) as exc:
        raise _fail(where, exc) from None
    doc = _doc(request)
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    for name in ("id", "state", "tool", "key", "fingerprint", "reason", "round", "kickoff",
                 "crew", "task", "decided_by", "decision_reason"):  # fmt: skip
        click.echo(safe(f"{name:>16}: {doc[name]}"))
    for name, value in doc["origin"].items():
        click.echo(safe(f"{'asked by ' + name:>16}: {value}"))
    given = ", ".join(a["by"] for a in doc["approvals"]) or "-"
    click.echo(safe(f"{'approvers':>16}: {len(doc['approvals'])} of {doc['approvers_needed']}"
                    f" ({given})"))  # fmt: skip
    for name in ("created_at", "decided_at", "grant_expires_at", "used_at"):
        click.echo(f"{name:>16}: {_stamp(doc[name])}")
    click.echo(safe(f"{'summary':>16}: {json.dumps(doc['summary'], sort_keys=True, default=str)}"))
    click.echo(f"{'history':>16}:")
    for event in doc["history"]:
        note = f" ({event['note']})" if event["note"] else ""
        via = f" via {event['via']}" if event.get("via") else ""
        click.echo(safe(f"  {_stamp(event['at'])}  {event['what']} by {event['by']}{via}{note}"))


def _duration(value: str) -> float:
    seconds = duration(value)
    if seconds is None or seconds <= 0:
        raise click.BadParameter(f"{value!r} is not a positive duration (e.g. 30m, 24h, 2d)")
    return seconds


def _no_typed_name(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        raise click.BadParameter(
            f"it is recorded as yours ({_whoami()}, the user running this command), not a "
            "typed name; say on whose behalf in --reason",
            param_hint="--by",
        )


# Hidden and refused: a decision (and `resolve`) used to take any name here, which let one
# person count as two approvers or settle a record as someone else; scripts that still pass
# it are told why instead of "no such option".
TYPED_NAME_REFUSED = click.option("--by", hidden=True, expose_value=False, callback=_no_typed_name)


SIGNING_KEY = click.option(
    "--key",
    "key_file",
    metavar="FILE",
    envvar=SIGNING_KEY_ENV,
    help=f"Sign the decision with this key file (`keys new`). Default: ${SIGNING_KEY_ENV}.",
)


@approvals.command("approve")
@click.argument("request_id")
@click.option("--reason", default="", help="Why (kept with the decision).")
@click.option(
    "--ttl", default="24h", show_default=True, help="The grant must be used within (30m, 2d...)."
)
@SIGNING_KEY
@TYPED_NAME_REFUSED
@click.pass_obj
def approve(where: Where, request_id: str, reason: str, ttl: str, key_file: str | None) -> None:
    """Approve a pending request: the next run of that exact call goes ahead, once.

    The decision is recorded as yours (user@host), or, signed with --key FILE (or
    $CREWAI_IDEMPOTENCY_SIGNING_KEY), as the key's identity: workers with trusted keys
    use a grant only if each approval is signed by a key they trust. A request that needs
    several distinct approvers stays pending until enough of them have approved."""
    _decide(where, request_id, True, reason, _duration(ttl), key_file)


@approvals.command("deny")
@click.argument("request_id")
@click.option("--reason", required=True, help="Why (the agent is told).")
@SIGNING_KEY
@TYPED_NAME_REFUSED
@click.pass_obj
def deny(where: Where, request_id: str, reason: str, key_file: str | None) -> None:
    """Deny a request: the call fails with ApprovalDenied and never runs.

    Signed with --key FILE (or $CREWAI_IDEMPOTENCY_SIGNING_KEY) as for approve."""
    _decide(where, request_id, False, reason, None, key_file)


def _signing(
    key_file: str | None, grant: bool
) -> tuple[signing.Signer | None, signing.TrustedKeys | None]:
    """The signer --key names and the trusted keys of $CREWAI_IDEMPOTENCY_TRUSTED_KEYS
    (each None when not given); with trusted keys, a key is required."""
    try:
        trusted = signing.TrustedKeys.from_env()
        signer = signing.Signer.from_file(key_file) if key_file else None
    except SigningConfigurationError as exc:
        raise click.ClickException(safe(str(exc))) from None
    if trusted is not None and signer is None:
        why = (
            "the workers use no grant without a signature by one of them"
            if grant
            else "a denial made here names who made it by their signature"
        )
        raise click.ClickException(
            f"decisions are signed here: ${TRUSTED_KEYS_ENV} names the keys the workers "
            f"trust, and {why}. Give your key with --key FILE (or ${SIGNING_KEY_ENV}); "
            "`crewai-idempotent keys new FILE --identity NAME` makes one, whose line goes "
            "in that file. Nothing was written"
        )
    return signer, trusted


def _decide(
    where: Where, rid: str, grant: bool, reason: str, ttl: float | None, key_file: str | None
) -> None:
    signer, trusted = _signing(key_file, grant)
    who = _whoami() if signer is None else signer.identity
    by = None if signer is not None else who
    try:
        with ledger_errors(where.scrub):
            store = _approvals(where, signer, trusted)
            if grant:
                assert ttl is not None
                decided = store.approve(rid, by=by, reason=reason, ttl_s=ttl, via="cli")
            else:
                decided = store.deny(rid, by=by, reason=reason, via="cli")
    except (ApprovalNotFound, ApprovalAlreadyDecided, DecisionRefused, ValueError) as exc:
        raise _fail(where, exc) from None
    if grant and decided.state is ApprovalState.PENDING:
        said = (
            f"{decided.id} approved by {who}: {len(decided.approvals)} of "
            f"{decided.approvers_needed} distinct approvers; it stays PENDING until "
            f"another approves (key {decided.key!r})"
        )
    else:
        until = f" until {_stamp(decided.grant_expires_at)}" if grant else ""
        said = f"{decided.id} {decided.state.value} by {who}{until} (key {decided.key!r})"
    click.echo(safe(said))
    if signer is not None:
        click.echo(safe(f"signed by {signer.identity} (key {signer.key_id})"))


@click.command("spend")
@click.option("--json", "as_json", is_flag=True, help="One JSON array instead of a table.")
@click.pass_obj
def spend(where: Where, as_json: bool) -> None:
    """Budgets per spend cap window: limit, committed, reserved, available.

    Amounts are shown in the currency's major units (1,200.00 EUR); `--json` gives them in
    minor units, as the caps are set, with the currency's exponent beside them."""
    with ledger_errors(where.scrub):
        budgets = SpendLedger(where.ledger().backend).budgets()
    if as_json:
        rows = [
            {
                "cap": b.cap, "scope": b.scope, "per": b.per, "window": b.window,
                "currency": b.currency, "exponent": exponent(b.currency),
                "limit": b.limit, "committed": b.committed,
                "reserved": b.reserved, "available": b.available,
                "reservations": b.reservations,
            }
            for b in budgets
        ]  # fmt: skip
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    if not budgets:
        click.echo(f"no spend caps have been used in {where.label}")
        return
    for b in budgets:

        def money(minor: int, currency: str = b.currency) -> str:
            return format_money(minor, currency)

        click.echo(
            safe(
                f"{b.scope}/{b.cap}  window {b.window}  limit {money(b.limit)}  "
                f"committed {money(b.committed)}  reserved {money(b.reserved)}  "
                f"available {money(b.available)}"
            )
        )


def _doc(request: ApprovalRequest) -> dict[str, Any]:
    return {
        "id": request.id, "state": request.state.value, "tool": request.tool,
        "key": request.key, "fingerprint": request.fingerprint, "reason": request.reason,
        "round": request.round, "kickoff": request.kickoff, "crew": request.crew,
        "task": request.task, "decided_by": request.decided_by,
        "decision_reason": request.decision_reason, "created_at": request.created_at,
        "decided_at": request.decided_at, "grant_expires_at": request.grant_expires_at,
        "used_at": request.used_at, "summary": request.summary,
        "history": list(request.history), "approvers_needed": request.approvers_needed,
        "approvals": list(request.approvals), "origin": request.origin,
    }  # fmt: skip
