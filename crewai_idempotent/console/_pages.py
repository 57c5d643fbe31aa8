"""The console's pages and forms: logging in, approvals, records, spend, notifications,
the live updates and Slack's buttons.

Each is a handler `Console.handle` calls once it has checked who asks and that they may
(`_console`); a handler reads or writes through the ledger's own operators (`Approvals`,
`Ledger.resolve`, ...), so the console decides nothing the CLI would decide otherwise.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shlex
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse

from .._errors import (
    ApprovalAlreadyDecided,
    ApprovalNotFound,
    DecisionRefused,
    ResolutionRefused,
    command,
)
from .._units import parse_duration
from ..gates._approvals import ApprovalState, _check_id
from ..ledger._backend import ledger_option
from ..notifications._outbox import TYPES
from . import _slack, _views
from ._auth import Who
from ._console import (
    LOGIN_COOKIE,
    MAX_REASON,
    MAX_TTL_S,
    Console,
    Handler,
    console_of,
    html,
    local_path,
    log,
)
from ._security import (
    same_origin,
    tokens_match,
)

if TYPE_CHECKING:
    pass

# -- logging in and out -------------------------------------------------------------------


async def login(request: Request) -> Response:
    console = console_of(request)
    form = await request.form() if request.method == "POST" else None
    return await run_in_threadpool(_login, console, request, form)


def _login(console: Console, request: Request, form: FormData | None) -> Response:
    target = local_path(request.query_params.get("next"))
    if console.settings.auth == "proxy":
        return RedirectResponse(target, 303)  # the auth proxy logs people in
    who, _, _ = console.identify(request)
    if who is not None:
        return RedirectResponse(target, 303)
    ctx = console.context(request, None, None)
    if form is None:
        return _login_form(console, request, ctx, target)
    if not same_origin(request.headers, console.origins(request)) or not tokens_match(
        form.get("login_csrf"), request.cookies.get(LOGIN_COOKIE, "")
    ):
        expired = "The login form had expired or came from elsewhere: try again."
        return _login_form(console, request, ctx, target, 403, expired)
    name = str(form.get("name") or "").strip()
    password = str(form.get("password") or "")
    address = console.client(request)
    wait = console.throttle.wait_s(name, address)
    if wait > 0:
        log.warning("login for %r from %s throttled", name, address)
        minutes = max(1, round(wait / 60))
        throttled = f"Too many failed logins: try again in about {minutes} min."
        response = _login_form(console, request, ctx, target, 429, throttled)
        response.headers["retry-after"] = str(int(wait) + 1)
        return response
    account = console.accounts.verify(name, password) if name and password else None
    if account is None:
        console.throttle.failed(name, address)
        log.warning("failed login for %r from %s", name, address)
        return _login_form(console, request, ctx, target, 401, "Wrong name or password.", name)
    console.throttle.succeeded(name)
    token, _ = console.sessions.start(account.name, account.generation, "password")
    log.info("%s logged in from %s", account.name, address)
    response = RedirectResponse(target, 303)
    console.set_session_cookie(request, response, token)
    response.delete_cookie(LOGIN_COOKIE, path="/login", httponly=True, samesite="strict")
    return response


def _login_form(
    console: Console,
    request: Request,
    ctx: dict[str, Any],
    target: str,
    status: int = 200,
    error: str = "",
    name: str = "",
) -> Response:
    token = secrets.token_urlsafe(32)
    response = html("login.html", status, **ctx, login_csrf=token, target=target, error=error,
                    name=name)  # fmt: skip
    response.set_cookie(
        LOGIN_COOKIE, token, max_age=900, httponly=True, samesite="strict",
        secure=console.https(request), path="/login",
    )  # fmt: skip
    return response


def logout(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
    assert who.session is not None
    console.sessions.end(who.session)
    response = RedirectResponse("/login", 303)
    response.delete_cookie(
        console.cookie_name(request), path="/", httponly=True, samesite="strict",
        secure=console.https(request),
    )  # fmt: skip
    log.info("%s logged out", who.name)
    return response


# -- approvals ------------------------------------------------------------------------------


def _notice(console: Console, request: Request) -> str:
    done = request.query_params.get("done", "")
    rid = request.query_params.get("id", "")
    if done in ("approved", "denied") and rid:
        try:
            r = console.approvals.get(rid)
        except (ApprovalNotFound, ValueError):
            return ""
        if done == "denied":
            return f"Denied {r.id}: the call will not run."
        if r.state is ApprovalState.PENDING:
            left = r.approvers_needed - len(r.approvals)
            return f"Approved {r.id}: {left} more distinct approver(s) needed before it may run."
        return f"Approved {r.id}: the next run of this call goes ahead, once."
    if done == "resolved":
        return "Resolved: the record's next call follows what you said."
    if done == "purged":
        count = request.query_params.get("n", "0")
        return f"Purged {int(count) if count.isdigit() else 0} expired receipt(s)."
    return ""


def _unreadable(console: Console, request: Request, who: Who, exc: ValueError) -> Response:
    # A damaged page link or order: said plainly, never a 500.
    return console.refusal(request, 400, str(exc), who)


def _listing(request: Request) -> dict[str, Any]:
    """What a paged page's template needs to link to its other pages, the filters kept."""
    path, query = request.url.path, request.query_params

    def link(**changes: Any) -> str:
        return _views.link(path, query, **changes)

    return {"link": link, "query": query}


def approvals_page(
    console: Console, request: Request, who: Who, form: FormData | None, error: str = ""
) -> Response:
    try:
        pagings = _views.approvals_paging(request.query_params)
    except ValueError as exc:
        return _unreadable(console, request, who, exc)
    page = _views.approvals_page(console.approvals, *pagings, console.backend.now())
    return html(
        "approvals.html", 409 if error else 200, **console.context(request, who, "approvals"),
        **_listing(request), page=page, notice=_notice(console, request), error=error,
    )  # fmt: skip


def approval_page(
    console: Console, request: Request, who: Who, form: FormData | None, error: str = ""
) -> Response:
    rid = request.path_params["rid"]
    try:
        item = _views.one_request(console.approvals, rid, console.backend.now())
    except (ApprovalNotFound, ValueError):
        return console.refusal(request, 404, f"No approval request {rid}.", who)
    return html(
        "approval.html", 409 if error else 200, **console.context(request, who, "approvals"),
        item=item, notice=_notice(console, request), error=error,
    )  # fmt: skip


def decision(grant: bool) -> Handler:
    def decide(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
        assert form is not None
        rid = request.path_params["rid"]
        back = local_path(str(form.get("back") or ""), "/approvals")
        again = approval_page if back.startswith("/approvals/") else approvals_page
        try:
            _check_id(rid)
        except ValueError:
            return console.refusal(request, 404, f"No approval request {rid}.", who)
        round_text = str(form.get("round") or "")
        reason = str(form.get("reason") or "").strip()
        if not round_text.isdigit():
            return again(console, request, who, form, "The form did not say which round.")
        if len(reason) > MAX_REASON:
            return again(
                console, request, who, form, f"A reason is at most {MAX_REASON} characters."
            )
        try:
            if grant:
                ttl = parse_duration(str(form.get("ttl") or ""))
                if ttl is None or not 0 < ttl <= MAX_TTL_S:
                    return again(console, request, who, form,
                                 "The grant's time must be a duration such as 30m, 4h or 2d "
                                 "(at most 30d).")  # fmt: skip
                decided = console.approvals.approve(
                    rid, by=who.name, reason=reason, ttl_s=ttl, via=who.via, round=int(round_text)
                )
            else:
                if not reason:
                    return again(
                        console, request, who, form, "Say why it is denied: the agent is told."
                    )
                decided = console.approvals.deny(
                    rid, by=who.name, reason=reason, via=who.via, round=int(round_text)
                )
        except ApprovalNotFound:
            return console.refusal(request, 404, f"No approval request {rid}.", who)
        except ApprovalAlreadyDecided as exc:
            return again(console, request, who, form, str(exc))
        except DecisionRefused:
            return again(console, request, who, form, _signed_only(console, rid))
        log.info("%s %s %s (%s)", who.name, "approved" if grant else "denied", rid,
                 decided.state.value)  # fmt: skip
        console.wake_dispatchers()
        done = "approved" if grant else "denied"
        return RedirectResponse(f"{back}?{urlencode({'done': done, 'id': rid})}", 303)

    return decide


def _signed_only(console: Console, rid: str) -> str:
    """What an approver is told when an approval cannot be signed where it was made."""
    approve = command(ledger_option(console.backend), "approvals", "approve", rid, "--key", "FILE")
    return (
        f"Approvals of this ledger are signed (the workers trust only approvals signed by a "
        f"key of theirs), and this one could not be signed here. Approve {rid} in the "
        f"console with your passkey, or with your key: {approve}. Nothing changed."
    )


def _signed_resolution_only(console: Console, key: str, how: list[str], reason: str) -> str:
    """What an operator is told when a resolution cannot be signed in the console: the
    command that makes it signed, as they asked for it here (it signs with the key
    $CREWAI_IDEMPOTENCY_SIGNING_KEY names, as every decision command does)."""
    words = ["resolve", key, *how, "--reason", reason]
    resolve = command(ledger_option(console.backend), *map(shlex.quote, words))
    return (
        f"Resolutions of this ledger are signed (the workers obey only resolutions signed by "
        f"a key of theirs), and the console cannot sign one. Resolve {key!r} with your key "
        f"($CREWAI_IDEMPOTENCY_SIGNING_KEY naming its file, or --key FILE added): {resolve}. "
        f"Nothing changed."
    )


# -- records ----------------------------------------------------------------------------------


def uncertain_page(
    console: Console, request: Request, who: Who, form: FormData | None, error: str = ""
) -> Response:
    try:
        at = _views.paging(request.query_params, _views.UNCERTAIN_ORDER)
    except ValueError as exc:
        return _unreadable(console, request, who, exc)
    page = _views.uncertain(console.ledger, console.approvals, at, console.backend.now())
    return html(
        "uncertain.html", 409 if error else 200, **console.context(request, who, "uncertain"),
        **_listing(request), page=page, notice=_notice(console, request), error=error,
    )  # fmt: skip


def records_page(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
    filters, error = _views.filters(request.query_params)
    try:
        at = _views.paging(request.query_params, _views.RECORDS_ORDER)
    except ValueError as exc:
        return _unreadable(console, request, who, exc)
    page = _views.records_page(console.ledger, filters, at, console.backend.now())
    return html(
        "records.html", 400 if error else 200, **console.context(request, who, "records"),
        **_listing(request), page=page, filters=filters, notice=_notice(console, request),
        error=error,
    )  # fmt: skip


def record_page(
    console: Console, request: Request, who: Who, form: FormData | None, error: str = ""
) -> Response:
    key = request.query_params.get("key", "") if form is None else str(form.get("key") or "")
    view = _views.record_page(console.ledger, console.approvals, key, console.backend.now())
    if view is None:
        return console.refusal(request, 404, f"No record for idempotency key {key!r}.", who)
    return html(
        "record.html", 409 if error else 200, **console.context(request, who, "records"),
        view=view, notice=_notice(console, request), error=error,
    )  # fmt: skip


def resolve(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
    assert form is not None
    key = str(form.get("key") or "")
    back = local_path(str(form.get("back") or ""), "/uncertain")
    again = record_page if back.startswith("/record") else uncertain_page
    verdict = str(form.get("verdict") or "")
    reason = str(form.get("reason") or "").strip()
    token = str(form.get("token") or "")
    record = console.ledger.get(key) if key and not _views.is_console_doc(key) else None
    if record is None:
        return console.refusal(request, 404, f"No record for idempotency key {key!r}.", who)
    if not token.isdigit() or int(token) != record.token:
        return again(console, request, who, form, f"{key!r} changed since the page was shown "
                     f"(token {record.token} now): look at it again.")  # fmt: skip
    if verdict not in ("happened", "absent"):
        return again(console, request, who, form, "Say whether it happened or not.")
    if not reason or len(reason) > MAX_REASON:
        return again(console, request, who, form, "Say what you checked at the provider.")
    how = ["--absent"]
    try:
        if verdict == "absent":
            console.ledger.resolve(key, absent=True, by=who.name, reason=reason)
        else:
            kind = str(form.get("receipt_kind") or "text")
            receipt = str(form.get("receipt") or "")
            if kind == "keep":
                if record.result is None:
                    return again(console, request, who, form, "There is no stored result to "
                                 "keep: give the provider's receipt.")  # fmt: skip
                result = record.value()
                how = ["--happened"]
            elif kind == "json":
                try:
                    result = json.loads(receipt)
                except ValueError as exc:
                    return again(console, request, who, form, f"The receipt is not JSON: {exc}.")
                how = ["--happened", "--result", receipt]
            elif receipt.strip():
                result = receipt
                how = ["--happened", "--result-text", receipt]
            else:
                return again(console, request, who, form, "Give the provider's receipt.")
            console.ledger.resolve(key, result=result, by=who.name, reason=reason)
    except ResolutionRefused as exc:
        return again(console, request, who, form, str(exc))
    except DecisionRefused:
        refusal = _signed_resolution_only(console, key, how, reason)
        return again(console, request, who, form, refusal)
    log.info("%s resolved %r as %s", who.name, key, verdict)
    console.wake_dispatchers()
    if back.startswith("/record"):
        return RedirectResponse(f"/record?{urlencode({'key': key, 'done': 'resolved'})}", 303)
    return RedirectResponse("/uncertain?done=resolved", 303)


def purge(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
    removed = console.ledger.purge(expired_only=True)
    log.info("%s purged %d expired receipt(s)", who.name, removed)
    return RedirectResponse(f"/records?done=purged&n={removed}", 303)


def spend_page(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
    try:
        at = _views.paging(request.query_params, _views.SPEND_ORDER)
    except ValueError as exc:
        return _unreadable(console, request, who, exc)
    page = _views.spend_page(console.ledger, at)
    return html("spend.html", **console.context(request, who, "spend"), **_listing(request),
                page=page)  # fmt: skip


def notifications_page(
    console: Console, request: Request, who: Who, form: FormData | None
) -> Response:
    q = request.query_params
    state = (q.get("state") or "").lower()
    kind = (q.get("type") or "").strip()
    error = ""
    if state not in _views.NOTIFICATION_STATES:
        error = f"No state {state!r}: pending, failing, delivered or waiting."
        state = ""
    try:
        at = _views.paging(q, _views.NOTIFICATIONS_ORDER)
    except ValueError as exc:
        return _unreadable(console, request, who, exc)
    page = _views.notifications_page(console.ledger, state, kind, at)
    return html(
        "notifications.html", 400 if error else 200,
        **console.context(request, who, "notifications"), **_listing(request), page=page,
        state=state, kind=kind, types=sorted(TYPES), error=error, dispatchers=console.dispatchers,
    )  # fmt: skip


def home(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
    return RedirectResponse("/approvals", 303)


# -- live updates -----------------------------------------------------------------------------


async def events(request: Request) -> Response:
    console = console_of(request)
    who, token, refused = await run_in_threadpool(console.identify, request)
    if refused is not None:
        return refused
    if who is None:
        return console.refusal(request, 401, "Not logged in (or the session ended).")
    cookie = token or request.cookies.get(console.cookie_name(request))
    page = local_path(request.query_params.get("page"), "")
    response = StreamingResponse(
        console.watcher.stream(lambda: console.still(who, cookie), page),
        media_type="text/event-stream",
        headers={"x-accel-buffering": "no"},  # nginx: pass each event on at once
    )
    if token is not None:
        console.set_session_cookie(request, response, token)
    return response


# -- Slack --------------------------------------------------------------------------------------


async def slack_interactive(request: Request) -> Response:
    console = console_of(request)
    secret = console.settings.slack_signing_secret
    if secret is None:
        return Response("Slack is not set up on this console", 404)
    body = await request.body()
    try:
        _slack.verify(secret, request.headers, body, time.time())
        click = _slack.parse(body)
    except _slack.SlackRefused as exc:
        log.warning("refused a Slack post from %s: %s", console.client(request), exc)
        return Response(str(exc), exc.status, media_type="text/plain")
    text = await run_in_threadpool(_slack_click, console, click)
    await asyncio.to_thread(
        _slack.reply, click.response_url, text, console.settings.slack_response_prefix
    )
    return Response("", 200)


def _slack_click(console: Console, click: _slack.Click) -> str:
    team = console.settings.slack_team
    if team is not None and click.team != team:
        log.warning("refused a Slack click from workspace %s", click.team)
        return "This console takes decisions from another Slack workspace only."
    account = console.accounts.by_slack_user(click.user)
    if account is None or account.disabled:
        log.warning("refused a Slack click by %s: not linked to an account", click.user)
        return (
            f"Your Slack user {click.user} is not linked to a console account, so nothing was "
            f"decided. An operator links it: crewai-idempotent console users set NAME "
            f"--slack-user {click.user}"
        )
    who = Who(account.name, account.role, "slack")
    if not who.may("decide"):
        return f"{account.name} is a {account.role.value}: only approvers decide. Nothing changed."
    if click.approve and console.trusted_keys is not None:
        # A button cannot carry a signature; a denial needs none (it only stops a call).
        return _signed_only(console, click.request_id)
    try:
        if click.approve:
            decided = console.approvals.approve(
                click.request_id, by=who.name, reason="approved in Slack",
                ttl_s=console.settings.slack_grant_ttl_s, via="slack", round=click.round,
            )  # fmt: skip
        else:
            decided = console.approvals.deny(
                click.request_id, by=who.name, reason="denied in Slack", via="slack",
                round=click.round,
            )  # fmt: skip
    except ApprovalNotFound:
        return f"There is no approval request {click.request_id} any more."
    except ApprovalAlreadyDecided as exc:
        return f"Nothing changed: {exc}"
    log.info("%s (Slack %s) decided %s: %s", who.name, click.user, decided.id, decided.state.value)
    console.wake_dispatchers()
    if decided.state is ApprovalState.PENDING:
        return (
            f"Approved {decided.id} as {who.name}: {len(decided.approvals)} of "
            f"{decided.approvers_needed} approvers; another must approve before it runs."
        )
    if decided.state is ApprovalState.DENIED:
        return f"Denied {decided.id} as {who.name}: the call will not run."
    return f"Approved {decided.id} as {who.name}: the next run of this call goes ahead, once."
