"""A local receiver for notification tests: an HTTP server on loopback that records every
POST, verifies Standard Webhooks signatures with the library's own verifier, and can be
told to fail, to hold requests (to catch two senders of one entry at once), or to go
away and come back on the same port."""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SECRET = "whsec_" + base64.b64encode(b"a test secret of thirty-two bytes").decode()


class Receiver:
    def __init__(self, secret: str | None = SECRET, port: int = 0) -> None:
        self.secret = secret
        self.port = port
        self.lock = threading.Lock()
        self.received: list[dict[str, Any]] = []
        self.status = 204
        self.headers: dict[str, str] = {}
        self.hold: threading.Event | None = None  # requests wait on it before answering
        self.holding = threading.Semaphore(0)  # released once per request being held
        self.in_flight: dict[str, int] = {}
        self.most_at_once: dict[str, int] = {}
        self.on_request: Callable[[dict[str, Any]], None] | None = None
        self._server: ThreadingHTTPServer | None = None

    # -- the server --------------------------------------------------------------------

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                receiver._handle(self)

            def log_message(self, *args: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Gone: the port refuses connections until `start()` again."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def webhook(self, **options: str) -> str:
        """A channel URL for this receiver (the secret by environment variable)."""
        name = f"TEST_HOOK_SECRET_{self.port}"
        os.environ[name] = self.secret or ""
        extra = "".join(f"&{k}={v}" for k, v in options.items())
        return f"webhook+{self.url}#secret_env={name}{extra}"

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        body = request.rfile.read(int(request.headers.get("content-length") or 0))
        headers = {k.lower(): v for k, v in request.headers.items()}
        got: dict[str, Any] = {
            "path": request.path, "headers": headers, "body": body, "at": time.time(),
            "id": headers.get("webhook-id"), "verified": None, "error": None,
        }  # fmt: skip
        if self.secret and "webhook-signature" in headers:
            from standardwebhooks import Webhook

            try:
                got["json"] = Webhook(self.secret).verify(body, headers)
                got["verified"] = True
            except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
                got["verified"], got["error"] = False, repr(exc)
        else:
            try:
                got["json"] = json.loads(body or b"null")
            except ValueError:
                got["json"] = None
        key = got["id"] or ""
        with self.lock:
            self.in_flight[key] = self.in_flight.get(key, 0) + 1
            self.most_at_once[key] = max(self.most_at_once.get(key, 0), self.in_flight[key])
            self.received.append(got)
        try:
            if self.on_request is not None:
                self.on_request(got)
            hold = self.hold
            if hold is not None:
                self.holding.release()
                hold.wait(60)
            status = self.status
            request.send_response(status)
            for name, value in self.headers.items():
                request.send_header(name, value)
            request.send_header("content-length", "2")
            request.end_headers()
            request.wfile.write(b"ok")
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            with self.lock:
                self.in_flight[key] -= 1

    # -- what it got -------------------------------------------------------------------

    def ids(self) -> list[str]:
        with self.lock:
            return [r["id"] for r in self.received]

    def wait_for(self, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        """A hang guard, not a measurement."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if len(self.received) >= count:
                    return list(self.received)
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(self.received)} of {count} requests came")
            time.sleep(0.01)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
