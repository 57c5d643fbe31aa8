"""What every response carries and every state change must show, whoever wrote the page.

Every argument the console shows was written by a model, so the pages assume hostile
text: templates escape everything (`_render`), and the browser is told to run nothing but
the console's own script file:

- `Content-Security-Policy`: scripts, styles, images and connections from the console
  itself only, no inline script or style, no plugin, no frame around it, forms post only
  to it, no <base>;
- `nosniff`, no framing, no referrer leaving the console, pages not cached;
- a POST must come from the console's own origin (`Origin`, else `Sec-Fetch-Site`, else
  `Referer`) and carry the session's CSRF token (`_app`); the login form carries a
  pre-session token bound to a cookie;
- request bodies are capped (`MAX_BODY`): no form needs more.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY = 256 * 1024

CSP = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    ]
)

_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"permissions-policy", b"camera=(), microphone=(), geolocation=(), payment=()"),
]


class SecurityHeaders:
    """Adds the headers above to every response; `Cache-Control: no-store` to all but the
    static files, and HSTS when the request came over TLS (`https(scope)` says)."""

    def __init__(self, app: ASGIApp, https: Callable[[Scope], bool]) -> None:
        self.app = app
        self.https = https

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = str(scope.get("path", "")).startswith("/static/")
        secure = self.https(scope)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {name.lower() for name, _ in headers}
                headers += [(n, v) for n, v in _HEADERS if n not in names]
                if not static and b"cache-control" not in names:
                    headers.append((b"cache-control", b"no-store"))
                if secure:
                    headers.append((b"strict-transport-security", b"max-age=31536000"))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)


def host_name(host_header: str) -> str:
    """The host of a Host header, without its port (`[::1]:8765` is `::1`)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class KnownHosts:
    """Answers only requests whose Host is one of `hosts`: a page on another site whose
    name was pointed at this address (DNS rebinding) gets nothing but a 400."""

    def __init__(self, app: ASGIApp, hosts: list[str]) -> None:
        self.app = app
        self.hosts = {h.strip().lower().strip("[]") for h in hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for n, v in scope.get("headers", []) if n == b"host"), "")
        if host_name(given) in self.hosts:
            await self.app(scope, receive, send)
            return
        body = (
            f"Host {given!r} is not one this console answers to. Start it with "
            "--allowed-host NAME, or --public-url URL for the address browsers use."
        ).encode("utf-8", "backslashreplace")
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Refuses a request body over `limit` bytes with 413, declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = self.limit + 1
                if declared > self.limit:
                    await _too_large(send)
                    return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await _too_large(send)


class _TooLarge(Exception):
    pass


async def _too_large(send: Send) -> None:
    body = b"request body too large"
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"text/plain; charset=utf-8")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def origin_of(url: str) -> str | None:
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    return f"{parts.scheme}://{parts.netloc}".lower()


def same_origin(headers: Any, allowed: set[str]) -> bool:
    """Whether a state-changing request came from one of the console's own pages.

    `Origin` decides when the browser sent one ("null", from a sandboxed or opaque page,
    is refused); else the Fetch Metadata header; else `Referer`. A client that sends none
    of them is no browser on another site: the CSRF token alone decides for it."""
    origin = headers.get("origin")
    if origin is not None:
        return origin.strip().lower() in allowed
    site = headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    referer = headers.get("referer")
    if referer is not None:
        return origin_of(referer) in allowed
    return True


def tokens_match(given: Any, expected: str) -> bool:
    return isinstance(given, str) and bool(given) and hmac.compare_digest(given, expected)
