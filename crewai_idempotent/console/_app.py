"""The console as a Starlette application: its pages, its forms, and what runs beside it.

Every page and form goes through `Console.handle`, which runs on a worker thread (the
ledger's stores block): it establishes who is asking (`identify`), checks the role may
do it, and for a POST that it comes from the console's own origin and carries the
session's CSRF token, before the handler sees anything. Handlers return responses; the
decision they make is recorded under `Who.name`, the authenticated identity.

Extending it: a page is a `Section` in the navigation plus its routes and template (the
`sections` and `routes` arguments of `create_app`); work that runs as long as the console
does (the live-update reader, the session sweeper) is a `background` coroutine started
and cancelled by the lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from .._errors import (
    ApprovalAlreadyDecided,
    ApprovalNotFound,
    IdempotencyError,
    ResolutionRefused,
)
from .._units import parse_duration as duration
from ..gates._approvals import Approvals, ApprovalState, _check_id
from ..ledger._backend import CacheBackend, url_of
from ..ledger._ledger import Ledger
from ..notifications._outbox import TYPES, Outbox
from . import _slack, _views
from ._accounts import Accounts, Role
from ._auth import LoginThrottle, Trust, Who, networks
from ._live import Watcher
from ._render import render
from ._security import (
    BodyLimit,
    KnownHosts,
    SecurityHeaders,
    same_origin,
    tokens_match,
)
from ._sessions import Session, Sessions
from ._settings import ConsoleSettings

if TYPE_CHECKING:
    from ..notifications._dispatch import Dispatcher

log = logging.getLogger("crewai_idempotent.console")

LOGIN_COOKIE = "crewai_console_login"
MAX_REASON = 4000
MAX_TTL_S = 30 * 86400.0
SWEEP_S = 3600.0


@dataclass(frozen=True, slots=True)
class Section:
    """One entry of the navigation: its name (templates mark the current one), path, label."""

    name: str  # what a page's context calls it (`section`), to mark it current
    path: str  # where it is served, e.g. "/approvals"
    label: str  # what the navigation shows


SECTIONS: tuple[Section, ...] = (
    Section("approvals", "/approvals", "Approvals"),
    Section("uncertain", "/uncertain", "Uncertain"),
    Section("records", "/records", "Records"),
    Section("spend", "/spend", "Spend"),
    Section("notifications", "/notifications", "Notifications"),
)

Background = Callable[["Console"], Coroutine[Any, Any, None]]
Handler = Callable[["Console", Request, Who, "FormData | None"], Response]


def html(template: str, status: int = 200, **context: Any) -> Response:
    # Text from the ledger may hold lone surrogates, which UTF-8 cannot carry.
    body = render(template, **context).encode("utf-8", "backslashreplace")
    return Response(body, status_code=status, media_type="text/html; charset=utf-8")


def local_path(target: str | None, default: str = "/approvals") -> str:
    """`target` if it is a path on this console (never another host: no open redirect)."""
    if (
        not target
        or len(target) > 2000
        or not target.startswith("/")
        or target.startswith(("//", "/\\"))
        or any(ord(c) < 0x21 or c == "\\" for c in target)
    ):
        return default
    return target


class Console:
    """What every request needs: the ledger, the accounts and sessions, the settings.

    `backend` is the ledger's store, `settings` how the console runs, `sections` its
    navigation, `clock` what the login throttle counts its window by (`time.monotonic`;
    tests give their own). Raises `TypeError` for a `backend` that is not a
    `CacheBackend`."""

    def __init__(
        self,
        backend: CacheBackend,
        settings: ConsoleSettings,
        sections: Sequence[Section] = SECTIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.sections = tuple(sections)
        self.ledger = Ledger(backend)
        self.approvals = Approvals(backend)
        self.accounts = Accounts(backend)
        self.sessions = Sessions(backend, ttl_s=settings.session_ttl_s, idle_s=settings.idle_s)
        self.trust = Trust(networks(settings.trusted_proxies))
        self.throttle = LoginThrottle(
            per_name=settings.login_failures_per_name,
            per_address=settings.login_failures_per_address,
            window_s=settings.login_window_s,
            clock=clock,
        )
        self.watcher = Watcher(backend, settings.refresh_s)
        self.label = url_of(backend)
        # The outbox dispatchers running beside the console (`_beside`): the notifications
        # page says whether anything here delivers what it lists.
        self.dispatchers: list[Dispatcher] = []

    def wake_dispatchers(self) -> None:
        """A decision made here wrote outbox entries with it: deliver them now rather than
        at the next poll. Raises nothing."""
        for dispatcher in self.dispatchers:
            dispatcher.wake()

    # -- the request's facts --------------------------------------------------------------

    def peer(self, request: Request) -> str | None:
        """The address of `request`'s TCP peer (never X-Forwarded-For), or None when the
        server gives none. Raises nothing."""
        return request.client.host if request.client is not None else None

    def https(self, request: Request) -> bool:
        """Whether the browser sent `request` over TLS: always when the settings say so
        (`tls`, an https `public_url`), else by its scheme or a trusted proxy's
        X-Forwarded-Proto. Raises nothing."""
        return self.settings.secure or self.trust.https(
            self.peer(request), request.url.scheme, request.headers.get("x-forwarded-proto")
        )

    def client(self, request: Request) -> str:
        """The address `request` came from, for throttling and logs: the peer, or behind
        trusted proxies the nearest X-Forwarded-For address that is not one of them
        ("unknown" when there is none). Raises nothing."""
        return self.trust.client(self.peer(request), request.headers.get("x-forwarded-for"))

    def cookie_name(self, request: Request) -> str:
        """The session cookie's name for `request`: `__Host-crewai_console` over TLS (the
        browser keeps it only if Secure, for this host, path /), else `crewai_console`.
        Raises nothing."""
        return "__Host-crewai_console" if self.https(request) else "crewai_console"

    def origins(self, request: Request) -> set[str]:
        """The origins a form may be sent from: `public_url`'s, else the one `request` was
        sent to (its scheme and Host). Raises nothing."""
        public = self.settings.public_origin
        if public is not None:
            return {public}
        scheme = "https" if self.https(request) else "http"
        host = request.headers.get("host", "")
        return {f"{scheme}://{host}".lower()}

    def set_session_cookie(self, request: Request, response: Response, token: str) -> None:
        """Set the session cookie holding `token` on `response`: HttpOnly, SameSite=Strict,
        path /, Secure when `request` came over TLS. Raises nothing."""
        response.set_cookie(
            self.cookie_name(request), token, httponly=True, samesite="strict",
            secure=self.https(request), path="/",
        )  # fmt: skip

    # -- who is asking ------------------------------------------------------------------

    def identify(self, request: Request) -> tuple[Who | None, str | None, Response | None]:
        """(who, a new session token to set, or a refusal) for `request`. No identity and
        no refusal: the caller sends the browser to log in. Raises `LedgerUnavailable` if
        the store cannot be read or written (a session is touched, started or ended)."""
        if self.settings.auth == "proxy":
            return self._from_proxy(request)
        session = self._session(request)
        if session is None:
            return None, None, None
        account = self.accounts.get(session.account)
        if account is None or account.disabled or account.generation != session.generation:
            self.sessions.end(session)
            return None, None, None
        return Who(account.name, account.role, "console", session), None, None

    def _from_proxy(self, request: Request) -> tuple[Who | None, str | None, Response | None]:
        peer = self.peer(request)
        if not self.trust.trusted(peer):
            log.warning("refused a request from %s: not a trusted auth proxy", peer)
            return None, None, self.refusal(
                request, 403, "This console takes identities only from its auth proxy, and "
                f"this request came from {peer or 'an unknown address'} directly.",
            )  # fmt: skip
        name = (request.headers.get(self.settings.proxy_header) or "").strip()
        if not name:
            return (
                None,
                None,
                self.refusal(
                    request, 401, f"The auth proxy sent no {self.settings.proxy_header} header."
                ),
            )
        account = self.accounts.get(name) if len(name) <= 128 else None
        if account is None or account.disabled:
            return None, None, self.refusal(
                request, 403, f"{name} has no console account here. An operator adds one with "
                f"`crewai-idempotent console users add {name} --role viewer --no-password`.",
            )  # fmt: skip
        session = self._session(request)
        if session is not None and (
            session.account != account.name or session.generation != account.generation
        ):
            self.sessions.end(session)
            session = None
        token = None
        if session is None:
            token, session = self.sessions.start(account.name, account.generation, "auth proxy")
        return Who(account.name, account.role, "auth proxy", session), token, None

    def _session(self, request: Request) -> Session | None:
        # A page's own live updates are not a person's activity: they do not keep an
        # unattended tab's session alive.
        live = request.url.path == "/events" or request.headers.get("x-console-live") == "1"
        return self.sessions.find(request.cookies.get(self.cookie_name(request)), touch=not live)

    def still(self, who: Who, token: str | None) -> bool:
        """Whether `who`'s session (the cookie `token`) may go on: the account still there,
        enabled, its sessions not ended since. Raises `LedgerUnavailable` if the store
        cannot be read (or an ended session deleted)."""
        account = self.accounts.get(who.name)
        if account is None or account.disabled:
            return False
        session = self.sessions.find(token, touch=False)
        return (
            session is not None
            and session.account == account.name
            and session.generation == account.generation
        )

    # -- every page and form --------------------------------------------------------------

    async def endpoint(self, request: Request, action: str, handler: Handler) -> Response:
        """Answer `request` with `handler` if who sends it may do `action`: a POST's form
        is read here, the rest is `handle`'s, on a worker thread. Raises what reading the
        form and `handle` raise."""
        form = await request.form() if request.method == "POST" else None
        return await run_in_threadpool(self.handle, request, form, action, handler)

    def handle(
        self, request: Request, form: FormData | None, action: str, handler: Handler
    ) -> Response:
        """Identify who sends `request`, refuse what they may not do (`action`: "view",
        "decide", "resolve" or "purge"), check that a POST comes from the console's own
        origin with its session's CSRF token in `form`, then answer with `handler(console,
        request, who, form)`, setting a new session's cookie. An `IdempotencyError` from
        `handler` (the ledger did not answer) is a 503 page. Raises what `identify` raises,
        `KeyError` for an unknown `action`, and whatever else `handler` raises."""
        who, token, refused = self.identify(request)
        if refused is not None:
            return refused
        if who is None:
            return self._to_login(request)
        if request.method == "POST":
            if not same_origin(request.headers, self.origins(request)):
                log.warning("refused a %s from another origin for %s", request.url.path, who.name)
                return self.refusal(request, 403, _NOT_OURS, who)
            assert who.session is not None and form is not None
            if not tokens_match(form.get("csrf"), who.session.csrf):
                log.warning(
                    "refused a %s without its CSRF token for %s", request.url.path, who.name
                )
                return self.refusal(request, 403, _NO_TOKEN, who)
        if not who.may(action):
            log.warning("refused %s to %s (%s)", action, who.name, who.role.value)
            return self.refusal(
                request, 403, f"Refused: {who.name} is a {who.role.value}, who may not "
                f"{_ACTIONS[action]}.", who,
            )  # fmt: skip
        try:
            response = handler(self, request, who, form)
        except IdempotencyError as exc:
            response = self.refusal(request, 503, f"The ledger answered: {exc}", who)
        if token is not None:
            self.set_session_cookie(request, response, token)
        return response

    def _to_login(self, request: Request) -> Response:
        if request.method != "GET" or request.url.path == "/events":
            return self.refusal(request, 401, "Not logged in (or the session ended).")
        here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        if (
            request.headers.get("sec-fetch-site") == "cross-site"
            and request.headers.get("sec-fetch-mode") == "navigate"
        ):
            # From a link in Slack or a mail: SameSite=Strict kept the cookie back. The
            # same navigation started from here again carries it.
            return html("reload.html", target=local_path(here))
        return RedirectResponse("/login?" + urlencode({"next": local_path(here)}), 303)

    def refusal(
        self, request: Request, status: int, message: str, who: Who | None = None
    ) -> Response:
        """The page saying `message`, with the HTTP `status`, for `request` from `who`
        (None: no one logged in). Raises what `context` raises."""
        return html("message.html", status, **self.context(request, who, None), message=message)

    def context(self, request: Request, who: Who | None, section: str | None) -> dict[str, Any]:
        """What every page's template is given: `who` (None: no one logged in) and their
        CSRF token, the navigation with `section` marked, the ledger, the store's clock,
        `request`'s path. Raises `LedgerUnavailable` if the store's clock cannot be read."""
        return {
            "who": who, "sections": self.sections, "section": section, "ledger": self.label,
            "csrf": who.session.csrf if who is not None and who.session is not None else "",
            "now": self.backend.now(), "proxy_mode": self.settings.auth == "proxy",
            "path": request.url.path,
        }  # fmt: skip

    # -- what runs beside it --------------------------------------------------------------

    async def sweep_sessions(self) -> None:
        """Delete the ended sessions every hour for as long as the console runs (started
        by its lifespan). Raises nothing: a sweep that fails is logged, and only
        cancelling the task ends it."""
        while True:
            try:
                removed = await asyncio.to_thread(self.sessions.sweep)
                if removed:
                    log.info("deleted %d ended console session(s)", removed)
            except Exception:
                log.warning("could not sweep ended console sessions", exc_info=True)
            await asyncio.sleep(SWEEP_S)


_NOT_OURS = "Refused: this form was not sent from the console's own pages."
_NO_TOKEN = (
    "Refused: the form's security token is missing or out of date. Reload the page and try again."
)
_ACTIONS = {
    "view": "look at the console",
    "decide": "approve or deny requests",
    "resolve": "resolve uncertain records",
    "purge": "purge receipts",
}


def _console(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


def _route(path: str, action: str, handler: Handler, methods: Sequence[str] = ("GET",)) -> Route:
    async def endpoint(request: Request) -> Response:
        return await _console(request).endpoint(request, action, handler)

    return Route(path, endpoint, methods=list(methods))


# -- logging in and out -------------------------------------------------------------------


async def login(request: Request) -> Response:
    console = _console(request)
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


def _logout(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
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


def _approvals_page(
    console: Console, request: Request, who: Who, form: FormData | None, error: str = ""
) -> Response:
    now = console.backend.now()
    page = _views.approvals_page(console.approvals, now)
    return html(
        "approvals.html", 409 if error else 200, **console.context(request, who, "approvals"),
        page=page, notice=_notice(console, request), error=error,
    )  # fmt: skip


def _approval_page(
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


def _decision(grant: bool) -> Handler:
    def decide(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
        assert form is not None
        rid = request.path_params["rid"]
        back = local_path(str(form.get("back") or ""), "/approvals")
        again = _approval_page if back.startswith("/approvals/") else _approvals_page
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
                ttl = duration(str(form.get("ttl") or ""))
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
        log.info("%s %s %s (%s)", who.name, "approved" if grant else "denied", rid,
                 decided.state.value)  # fmt: skip
        console.wake_dispatchers()
        done = "approved" if grant else "denied"
        return RedirectResponse(f"{back}?{urlencode({'done': done, 'id': rid})}", 303)

    return decide


# -- records ----------------------------------------------------------------------------------


def _uncertain_page(
    console: Console, request: Request, who: Who, form: FormData | None, error: str = ""
) -> Response:
    now = console.backend.now()
    views = _views.uncertain(console.ledger, now, console.approvals.list("all"))
    return html(
        "uncertain.html", 409 if error else 200, **console.context(request, who, "uncertain"),
        views=views, notice=_notice(console, request), error=error,
    )  # fmt: skip


def _filters(request: Request) -> tuple[_views.Filters, str]:
    q = request.query_params
    status = (q.get("status") or "").lower()
    if status not in ("", "pending", "committed", "failed", "uncertain"):
        return _views.Filters(), f"No status {status!r}: pending, committed, failed or uncertain."
    older = duration(q["older"]) if q.get("older") else None
    newer = duration(q["newer"]) if q.get("newer") else None
    if (q.get("older") and older is None) or (q.get("newer") and newer is None):
        return _views.Filters(), "An age is a duration such as 90s, 15m, 2h or 7d."
    return _views.Filters(
        status=status, tool=(q.get("tool") or "").strip(), prefix=q.get("prefix") or "",
        older_than=older, newer_than=newer, documents=q.get("documents") == "1",
    ), ""  # fmt: skip


def _records_page(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
    filters, error = _filters(request)
    now = console.backend.now()
    page = _views.records_page(console.ledger, filters, now)
    return html(
        "records.html", 400 if error else 200, **console.context(request, who, "records"),
        page=page, filters=filters, query=request.query_params, notice=_notice(console, request),
        error=error,
    )  # fmt: skip


def _record_page(
    console: Console, request: Request, who: Who, form: FormData | None, error: str = ""
) -> Response:
    key = request.query_params.get("key", "") if form is None else str(form.get("key") or "")
    record = console.ledger.get(key) if key and not _views.is_console_doc(key) else None
    if record is None:
        return console.refusal(request, 404, f"No record for idempotency key {key!r}.", who)
    view = _views.record_view(console.ledger, record, console.backend.now(),
                              console.approvals.list("all"))  # fmt: skip
    return html(
        "record.html", 409 if error else 200, **console.context(request, who, "records"),
        view=view, notice=_notice(console, request), error=error,
    )  # fmt: skip


def _resolve(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
    assert form is not None
    key = str(form.get("key") or "")
    back = local_path(str(form.get("back") or ""), "/uncertain")
    again = _record_page if back.startswith("/record") else _uncertain_page
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
            elif kind == "json":
                try:
                    result = json.loads(receipt)
                except ValueError as exc:
                    return again(console, request, who, form, f"The receipt is not JSON: {exc}.")
            elif receipt.strip():
                result = receipt
            else:
                return again(console, request, who, form, "Give the provider's receipt.")
            console.ledger.resolve(key, result=result, by=who.name, reason=reason)
    except ResolutionRefused as exc:
        return again(console, request, who, form, str(exc))
    log.info("%s resolved %r as %s", who.name, key, verdict)
    console.wake_dispatchers()
    if back.startswith("/record"):
        return RedirectResponse(f"/record?{urlencode({'key': key, 'done': 'resolved'})}", 303)
    return RedirectResponse("/uncertain?done=resolved", 303)


def _purge(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
    removed = console.ledger.purge(expired_only=True)
    log.info("%s purged %d expired receipt(s)", who.name, removed)
    return RedirectResponse(f"/records?done=purged&n={removed}", 303)


def _spend_page(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
    return html("spend.html", **console.context(request, who, "spend"),
                budgets=_views.budgets(console.ledger))  # fmt: skip


def _notifications_page(
    console: Console, request: Request, who: Who, form: FormData | None
) -> Response:
    q = request.query_params
    state = (q.get("state") or "").lower()
    kind = (q.get("type") or "").strip()
    error = ""
    if state not in _views.NOTIFICATION_STATES:
        error = f"No state {state!r}: pending, failing, delivered or waiting."
        state = ""
    page = _views.notifications_page(Outbox(console.backend), state, kind)
    return html(
        "notifications.html", 400 if error else 200,
        **console.context(request, who, "notifications"), page=page, state=state, kind=kind,
        types=sorted(TYPES), error=error, dispatchers=console.dispatchers,
    )  # fmt: skip


def _home(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
    return RedirectResponse("/approvals", 303)


# -- live updates -----------------------------------------------------------------------------


async def events(request: Request) -> Response:
    console = _console(request)
    who, token, refused = await run_in_threadpool(console.identify, request)
    if refused is not None:
        return refused
    if who is None:
        return console.refusal(request, 401, "Not logged in (or the session ended).")
    cookie = token or request.cookies.get(console.cookie_name(request))
    response = StreamingResponse(
        console.watcher.stream(lambda: console.still(who, cookie)),
        media_type="text/event-stream",
        headers={"x-accel-buffering": "no"},  # nginx: pass each event on at once
    )
    if token is not None:
        console.set_session_cookie(request, response, token)
    return response


# -- Slack --------------------------------------------------------------------------------------


async def slack_interactive(request: Request) -> Response:
    console = _console(request)
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


# -- the application ------------------------------------------------------------------------------


def _report_ended(task: asyncio.Task[None]) -> None:
    # A job ends only when cancelled at shutdown: one that raised would otherwise stop
    # (the dispatcher, the sweeper) with no word while the pages go on being served.
    if not task.cancelled() and task.exception() is not None:
        log.error("a job beside the console stopped", exc_info=task.exception())


def create_app(
    backend: CacheBackend,
    settings: ConsoleSettings | None = None,
    *,
    sections: Sequence[Section] = (),
    routes: Sequence[BaseRoute] = (),
    background: Sequence[Background] = (),
    clock: Callable[[], float] = time.monotonic,
) -> Starlette:
    """The console over `backend` as an ASGI application. `sections` and `routes` add
    pages; each `background` coroutine runs (given the `Console`) while the app does.
    `settings`: `ConsoleSettings()` when None; `clock` as for `Console`. Raises
    `TypeError` for a `backend` that is not a `CacheBackend`."""
    settings = settings or ConsoleSettings()
    console = Console(backend, settings, (*SECTIONS, *sections), clock)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        jobs: list[Coroutine[Any, Any, None]] = [console.watcher.run(), console.sweep_sessions()]
        jobs += [start(console) for start in background]
        tasks = [asyncio.create_task(job) for job in jobs]
        for task in tasks:
            task.add_done_callback(_report_ended)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    static = StaticFiles(packages=[("crewai_idempotent.console", "static")])
    hosts = ["localhost", "127.0.0.1", "::1", *settings.allowed_hosts]
    if settings.public_url is not None:
        public = urlsplit(settings.public_url).hostname
        if public:
            hosts.append(public)
    app = Starlette(
        routes=[
            _route("/", "view", _home),
            Route("/login", login, methods=["GET", "POST"]),
            _route("/logout", "view", _logout, ["POST"]),
            _route("/approvals", "view", _approvals_page),
            _route("/approvals/{rid}", "view", _approval_page),
            _route("/approvals/{rid}/approve", "decide", _decision(True), ["POST"]),
            _route("/approvals/{rid}/deny", "decide", _decision(False), ["POST"]),
            _route("/uncertain", "view", _uncertain_page),
            _route("/records", "view", _records_page),
            _route("/records/purge", "purge", _purge, ["POST"]),
            _route("/record", "view", _record_page),
            _route("/record/resolve", "resolve", _resolve, ["POST"]),
            _route("/spend", "view", _spend_page),
            _route("/notifications", "view", _notifications_page),
            Route("/events", events),
            Route("/slack/interactive", slack_interactive, methods=["POST"]),
            *routes,
            Mount("/static", static, name="static"),
        ],
        middleware=[
            Middleware(SecurityHeaders, https=lambda scope: _scope_https(console, scope)),
            Middleware(KnownHosts, hosts=hosts),
            Middleware(BodyLimit),
        ],
        lifespan=lifespan,
    )
    app.state.console = console
    return app


def _scope_https(console: Console, scope: Any) -> bool:
    return console.https(Request(scope))


__all__ = ["SECTIONS", "Console", "Role", "Section", "create_app"]
