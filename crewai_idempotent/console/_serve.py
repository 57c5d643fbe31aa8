"""Running the console under uvicorn: where it listens, and what it says before it does.

It binds its socket itself (so `--port 0` names the port it got before serving, and a busy
port is one clear error), listens on loopback unless told otherwise, and says loudly when
it is told to listen elsewhere without TLS in front: passwords and session cookies would
cross the network in clear text. uvicorn's own X-Forwarded-* handling is off: the console
believes those headers only from its configured proxies (`_auth.Trust`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import ListenError
from ..ledger._backend import CacheBackend
from ..signing._trusted import TrustedKeys
from ._app import create_app
from ._console import Background
from ._settings import ConsoleSettings

DEFAULT_PORT = 8765


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket, tls: bool) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}"


def warning(host: str, settings: ConsoleSettings) -> str | None:
    """What to say before listening on `host`, if anything."""
    if is_loopback(host):
        return None
    if settings.secure:
        return None
    if settings.trusted_proxies:
        return (
            f"listening on {host}, not loopback, without TLS of its own: only the proxies "
            f"{', '.join(settings.trusted_proxies)} should reach it, and they must serve "
            "TLS to browsers (--public-url https://...), or passwords and session cookies "
            "cross the network in clear text"
        )
    return (
        f"WARNING: listening on {host}, not loopback, without TLS: passwords and session "
        "cookies cross the network in clear text. Put the console behind a TLS reverse "
        "proxy (--trusted-proxy ADDRESS --public-url https://...) or give it --tls-cert "
        "and --tls-key (docs/console.md)"
    )


def serve(
    backend: CacheBackend,
    settings: ConsoleSettings,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    log_level: str = "info",
    say: Callable[[str], Any] = print,
    background: Sequence[Background] = (),
    trusted_keys: TrustedKeys | None = None,
) -> None:
    """Serve the console until interrupted; `background` jobs (`_beside`: the dispatcher,
    the sweeper) run as long as it does.

    `backend`, `settings` and `trusted_keys` as for `create_app`. It listens on `host`
    and `port` (port 0: a free one, said before serving), with TLS of its own from the
    PEM files `tls_cert` and `tls_key`; `log_level` is uvicorn's. `say` is told what an
    operator should read: where it listens, and what to know first (no TLS beyond
    loopback, the Host names it answers to). Raises `ListenError` when it cannot listen
    there, and what `create_app` and uvicorn raise (TLS files it cannot load, among
    them)."""
    import uvicorn

    sock = bind(host, port)
    if not is_loopback(host) and host not in ("0.0.0.0", "::", "[::]"):
        # Told to listen on this name or address: browsers will use it as the Host.
        settings = dataclasses.replace(
            settings, allowed_hosts=(*settings.allowed_hosts, host.strip("[]"))
        )
    app = create_app(backend, settings, background=background, trusted_keys=trusted_keys)
    config = uvicorn.Config(
        app,
        proxy_headers=False,
        server_header=False,
        log_level=log_level,
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
        timeout_graceful_shutdown=3,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    note = warning(host, settings)
    if note:
        say(note)
    if host in ("0.0.0.0", "::", "[::]") and not settings.allowed_hosts and not settings.public_url:
        say(
            "note: it answers only to the Host names localhost, 127.0.0.1 and ::1; give the "
            "name browsers use with --allowed-host NAME or --public-url URL"
        )
    where = url_of(sock, tls_cert is not None)
    say(f"crewai-idempotent console on {where} (ledger {app.state.console.label})")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
