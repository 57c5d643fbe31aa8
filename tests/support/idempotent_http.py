"""A local HTTP API that honours `Idempotency-Key` as the IETF httpapi draft says.

`POST /transfers` with a JSON body makes a transfer (counted in `transfers`) and answers
201 with it. The key is required (400 without). A key whose first request is still being
processed gets 409 Conflict; a key first used with another body (or another path) gets
422 Unprocessable Content; a key with the same request gets the first answer again, and
nothing is done twice. `hold()` keeps the next request inside its processing until
`release()`; `fail_next(status)` answers the next new request with an error, saved under
its key like any completed one.
"""

from __future__ import annotations

import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class IdempotentAPI:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.transfers: list[dict[str, Any]] = []
        self.keys: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str | None]] = []
        self.holding = threading.Event()
        self._hold: threading.Event | None = None
        self._held: threading.Event | None = None  # the one a request waits on
        self._fail: int | None = None
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        server.daemon_threads = True
        self.server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()

    def hold(self) -> None:
        self._hold = threading.Event()

    def release(self) -> None:
        for event in (self._hold, self._held):
            if event is not None:
                event.set()

    def fail_next(self, status: int) -> None:
        self._fail = status

    def handle(self, path: str, key: str | None, body: bytes) -> tuple[int, dict[str, Any]]:
        self.requests.append((path, key))
        if path != "/transfers":
            return 404, {"error": "no such route"}
        if not key:
            return 400, {"error": "this endpoint requires an Idempotency-Key"}
        with self.lock:
            seen = self.keys.get(key)
            if seen is not None:
                if seen["answer"] is None:
                    return 409, {"error": "a request with this key is being processed"}
                if (seen["path"], seen["body"]) != (path, body):
                    return 422, {"error": "this key was used with a different request"}
                return seen["answer"]
            self.keys[key] = {"path": path, "body": body, "answer": None}
            hold, self._hold = self._hold, None
            fail, self._fail = self._fail, None
        if hold is not None:
            self._held = hold
            self.holding.set()
            hold.wait(60)
        if fail is not None:
            answer: tuple[int, dict[str, Any]] = (fail, {"error": "the server failed"})
        else:
            made = {"id": f"tr_{secrets.token_hex(6)}", **json.loads(body)}
            with self.lock:
                self.transfers.append(made)
            answer = (201, made)
        with self.lock:
            self.keys[key]["answer"] = answer
        return answer


def _handler(api: IdempotentAPI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            status, payload = api.handle(self.path, self.headers.get("Idempotency-Key"), body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
