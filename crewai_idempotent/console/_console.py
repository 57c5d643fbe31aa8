"""What every page and form of the console goes through: `Console.handle`.

It runs on a worker thread (the ledger's stores block): it establishes who is asking
(`identify`), checks the role may do it, and for a POST that it comes from the console's
own origin and carries the session's CSRF token, before the handler sees anything.
Handlers (`_pages`) return responses; the decision they make is recorded under
`Who.name`, the authenticated identity. The request's facts, the identity and the checks
are one class because every request needs all of them, in that order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from .. import signing
from .._errors import (
    IdempotencyError,
)
from ..gates._approvals import Approvals
from ..ledger._backend import CacheBackend, url_of
from ..ledger._ledger import Ledger
from . import _views
from ._accounts import Accounts
from ._auth import LoginThrottle, Trust, Who, networks
from ._live import Watcher
from ._render import render
from ._security import (
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
    tests give their own). `trusted_keys`: what the workers trust (by default those
    `$CREWAI_IDEMPOTENCY_TRUSTED_KEYS` names; None when it is unset): with them,
    approvals are signed, and an approval this console cannot sign is refused before
    anything is written. Raises `TypeError` for a `backend` that is not a
    `CacheBackend`, and `SigningConfigurationError` for trusted keys that do not pass."""

    def __init__(
        self,
        backend: CacheBackend,
        settings: ConsoleSettings,
        sections: Sequence[Section] = SECTIONS,
        clock: Callable[[], float] = time.monotonic,
        trusted_keys: signing.TrustedKeys | None = None,
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.sections = tuple(sections)
        # What the workers trust, as this host is told: with them, approvals and
        # resolutions are signed, and the console's own ledger refuses to write unsigned
        # ones the workers would refuse later.
        self.trusted_keys = (
            trusted_keys if trusted_keys is not None else signing.TrustedKeys.from_env()
        )
        self.ledger = Ledger(backend, trusted_keys=self.trusted_keys)
        self.approvals = Approvals(backend, trusted_keys=self.trusted_keys)
        self.accounts = Accounts(backend)
        self.sessions = Sessions(backend, ttl_s=settings.session_ttl_s, idle_s=settings.idle_s)
        self.trust = Trust(networks(settings.trusted_proxies))
        self.throttle = LoginThrottle(
            per_name=settings.login_failures_per_name,
            per_address=settings.login_failures_per_address,
            window_s=settings.login_window_s,
            clock=clock,
        )
        self.watcher = Watcher(backend, settings.refresh_s, self.shown)
        self.label = url_of(backend)
        # The outbox dispatchers running beside the console (`_beside`): the notifications
        # page says whether anything here delivers what it lists.
        self.dispatchers: list[Dispatcher] = []

    def shown(self, url: str) -> Any:
        """What the page at `url` (its path and query) shows now, read as the page reads
        it; None for a URL that is no page. What live updates compare when the store has
        no change mark. Raises `LedgerUnavailable` if the store cannot be read."""
        return _views.shown(self.ledger, self.approvals, url)

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
        return Who(account.name, account.role, "console", session, account.passkeys), None, None

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
                request, 403, f"{name} has no console account here. Whoever runs this console "
                "adds one on its host, without a password (docs/console.md, “Behind an auth "
                "proxy”).",
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
        return Who(account.name, account.role, "auth proxy", session, account.passkeys), token, None

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
        here = _here(request)
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
        CSRF token, the navigation with `section` marked, the ledger (only to someone
        logged in: its URL names a host, a file, a user), the store's clock, `request`'s
        path (and, as `here`, with its query). Raises `LedgerUnavailable` if the store's
        clock cannot be read."""
        ledger = self.label if who is not None else None
        return {
            "who": who, "sections": self.sections, "section": section, "ledger": ledger,
            "csrf": who.session.csrf if who is not None and who.session is not None else "",
            "now": self.backend.now(), "proxy_mode": self.settings.auth == "proxy",
            "path": request.url.path, "here": _here(request),
            "signing": self.trusted_keys is not None,
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


def _here(request: Request) -> str:
    """The path and query `request` asked for: the page a live-update stream watches."""
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


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


def console_of(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


def route(path: str, action: str, handler: Handler, methods: Sequence[str] = ("GET",)) -> Route:
    async def endpoint(request: Request) -> Response:
        return await console_of(request).endpoint(request, action, handler)

    return Route(path, endpoint, methods=list(methods))
