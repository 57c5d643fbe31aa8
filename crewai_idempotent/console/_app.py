"""The console as a Starlette application: the routes, the middleware and what runs
beside it.

Extending it: a page is a `Section` in the navigation plus its routes and template (the
`sections` and `routes` arguments of `create_app`); work that runs as long as the console
does (the live-update reader, the session sweeper) is a `background` coroutine started
and cancelled by the lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from ..ledger._backend import CacheBackend
from ..signing._trusted import TrustedKeys
from ._console import SECTIONS, Background, Console, Section, log, route
from ._pages import (
    approval_page,
    approvals_page,
    decision,
    events,
    home,
    login,
    logout,
    notifications_page,
    purge,
    record_page,
    records_page,
    resolve,
    slack_interactive,
    spend_page,
    uncertain_page,
)
from ._passkeys import ROUTES as PASSKEY_ROUTES
from ._security import (
    BodyLimit,
    KnownHosts,
    SecurityHeaders,
)
from ._settings import ConsoleSettings

if TYPE_CHECKING:
    pass

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
    trusted_keys: TrustedKeys | None = None,
) -> Starlette:
    """The console over `backend` as an ASGI application. `sections` and `routes` add
    pages; each `background` coroutine runs (given the `Console`) while the app does.
    `settings`: `ConsoleSettings()` when None; `clock` as for `Console`; `trusted_keys`:
    what a signed decision is checked against before it is recorded (by default the
    file `$CREWAI_IDEMPOTENCY_TRUSTED_KEYS` names, as the workers read it; none: not
    checked here, and unsigned decisions are offered). Raises `TypeError` for a `backend`
    that is not a `CacheBackend`, and `SigningConfigurationError` for a trusted keys file
    that cannot be used."""
    settings = settings or ConsoleSettings()
    console = Console(backend, settings, (*SECTIONS, *sections), clock, trusted_keys)

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
            route("/", "view", home),
            Route("/login", login, methods=["GET", "POST"]),
            route("/logout", "view", logout, ["POST"]),
            route("/approvals", "view", approvals_page),
            route("/approvals/{rid}", "view", approval_page),
            route("/approvals/{rid}/approve", "decide", decision(True), ["POST"]),
            route("/approvals/{rid}/deny", "decide", decision(False), ["POST"]),
            route("/uncertain", "view", uncertain_page),
            route("/records", "view", records_page),
            route("/records/purge", "purge", purge, ["POST"]),
            route("/record", "view", record_page),
            route("/record/resolve", "resolve", resolve, ["POST"]),
            route("/spend", "view", spend_page),
            route("/notifications", "view", notifications_page),
            Route("/events", events),
            Route("/slack/interactive", slack_interactive, methods=["POST"]),
            *PASSKEY_ROUTES,
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


__all__ = ["create_app"]
