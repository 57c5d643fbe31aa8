"""A fake Stripe API on loopback: the few endpoints the verifier and the tests' tools use,
with Stripe's idempotency semantics, for the real `stripe` client pointed at it.

Endpoints (form-encoded, as the client sends them): create, retrieve, list (newest first,
`created[gte]`, `limit`, `starting_after`) and, for PaymentIntents and Charges, search
(`metadata['k']:'v'`, with `page`), for `/v1/payment_intents`, `/v1/charges` and
`/v1/refunds`. A request needs `Authorization: Bearer sk_test_...`.

Idempotency, as Stripe documents it: a POST with an `Idempotency-Key` whose first request
is still running gets 409 (`idempotency_key_in_use`); one whose key was first used with
other parameters, or on another endpoint, gets 400 `idempotency_error`; one with the same
parameters gets the first response again, with `Idempotent-Replayed: true`, and nothing is
done twice. A request that fails validation is not saved under its key. `forget_keys()`
is the end of the retention window.

The server counts its own effects (`charges`: a confirmed PaymentIntent or a Charge that
moved money; `refunds`), in the test process, which outlives the workers it kills.
`hold(path)` makes the next POST to `path` wait inside its processing, key taken, until
`release()`; `payment_method="pm_card_chargeDeclined"` is declined (402, saved under its
key like any processed request).
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

API_KEY = "sk_test_fake"
_KINDS = {"payment_intents": "pi", "charges": "ch", "refunds": "re"}
_OBJECT = {"payment_intents": "payment_intent", "charges": "charge", "refunds": "refund"}


def _nested(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """`a[b][c]=v` form fields as nested dicts (lists as dicts of indices)."""
    found: dict[str, Any] = {}
    for name, value in pairs:
        parts = re.findall(r"[^\[\]]+", name)
        where = found
        for part in parts[:-1]:
            where = where.setdefault(part, {})
        where[parts[-1]] = value
    return found


class FakeStripe:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, dict[str, dict[str, Any]]] = {kind: {} for kind in _KINDS}
        self.keys: dict[str, dict[str, Any]] = {}
        self.charges: list[dict[str, Any]] = []
        self.refunds: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, key
        self._held: dict[str, threading.Event] = {}
        self._waiting: list[threading.Event] = []
        self.holding = threading.Event()  # a held request is inside its processing
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        server.daemon_threads = True
        self.server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()

    # -- what the tests steer and read -----------------------------------------------------

    def hold(self, path: str) -> None:
        self._held[path] = threading.Event()

    def release(self) -> None:
        for event in [*self._held.values(), *self._waiting]:
            event.set()
        self._held.clear()

    def forget_keys(self) -> None:
        """Stripe's retention window has passed: every saved key is gone."""
        with self.lock:
            self.keys.clear()

    def charged(self, key: str) -> list[dict[str, Any]]:
        """The charges whose object carries `key` in metadata['idempotency_key']."""
        return [c for c in self.charges if c["metadata"].get("idempotency_key") == key]

    # -- the API -------------------------------------------------------------------------

    def handle(self, method: str, path: str, query: str, body: str, headers: Any) -> Any:
        if headers.get("Authorization") != f"Bearer {API_KEY}":
            return 401, _error("invalid_request_error", "Invalid API Key provided"), {}
        parts = [p for p in path.split("/") if p]
        if len(parts) < 2 or parts[0] != "v1" or parts[1] not in _KINDS:
            return 404, _error("invalid_request_error", f"Unrecognized request URL ({path})"), {}
        kind = parts[1]
        if method == "GET":
            params = _nested(parse_qsl(query, keep_blank_values=True))
            if len(parts) == 3 and parts[2] == "search" and kind != "refunds":
                return 200, self._search(kind, params), {}
            if len(parts) == 3:
                found = self.objects[kind].get(parts[2])
                if found is None:
                    return 404, _error("invalid_request_error", f"No such {kind}: {parts[2]}"), {}
                return 200, found, {}
            return 200, self._list(kind, params), {}
        if method != "POST" or len(parts) != 2:
            return 404, _error("invalid_request_error", "Unrecognized request"), {}
        params = _nested(parse_qsl(body, keep_blank_values=True))
        key = headers.get("Idempotency-Key")
        self.requests.append((method, path, key))
        with self.lock:
            saved = self.keys.get(key) if key else None
            if saved is not None:
                if saved["running"]:
                    return 409, _error(
                        "invalid_request_error",
                        "There is currently another in-progress request using this "
                        f"Idempotent Key (that probably means you submitted twice): {key}",
                        code="idempotency_key_in_use",
                    ), {}  # fmt: skip
                if saved["path"] != path or saved["params"] != params:
                    return 400, _error(
                        "idempotency_error",
                        "Keys for idempotent requests can only be used with the same "
                        "parameters they were first used with. Try using a key other than "
                        f"'{key}' if you meant to execute a different request.",
                    ), {}  # fmt: skip
                return saved["status"], saved["body"], {"Idempotent-Replayed": "true"}
            invalid = self._invalid(kind, params)
            if invalid is not None:
                return 400, _error("invalid_request_error", invalid), {}  # not saved
            if key:
                self.keys[key] = {"path": path, "params": params, "running": True}
        held = self._held.pop(path, None)
        if held is not None:
            self._waiting.append(held)
            self.holding.set()
            held.wait(60)
        with self.lock:
            status, made = self._create(kind, params)
            if key:
                self.keys[key] = {
                    "path": path, "params": params, "running": False, "status": status,
                    "body": made,
                }  # fmt: skip
        return status, made, {}

    def _invalid(self, kind: str, params: dict[str, Any]) -> str | None:
        if kind == "refunds":
            if "charge" not in params and "payment_intent" not in params:
                return "One of the following params should be provided: charge, payment_intent"
            return None
        amount = params.get("amount", "")
        if not amount.isdigit() or int(amount) < 1:
            return f"Invalid positive integer: amount={amount!r}"
        if not params.get("currency"):
            return "Missing required param: currency."
        return None

    def _create(self, kind: str, params: dict[str, Any]) -> tuple[int, Any]:
        made = {
            "id": f"{_KINDS[kind]}_{secrets.token_hex(8)}",
            "object": _OBJECT[kind],
            "created": int(time.time()),
            "livemode": False,
            "metadata": dict(params.get("metadata") or {}),
        }
        if kind == "refunds":
            made |= {"status": "succeeded", "charge": params.get("charge"),
                     "payment_intent": params.get("payment_intent"),
                     "amount": int(params.get("amount") or 0)}  # fmt: skip
            self.objects[kind][made["id"]] = made
            self.refunds.append(made)
            return 200, made
        made |= {"amount": int(params["amount"]), "currency": params["currency"]}
        declined = params.get("payment_method") == "pm_card_chargeDeclined"
        confirmed = kind == "charges" or params.get("confirm") == "true"
        if kind == "payment_intents":
            made["status"] = "requires_payment_method" if declined or not confirmed else "succeeded"
        else:
            made["status"] = "failed" if declined else "succeeded"
        self.objects[kind][made["id"]] = made
        if declined:
            error = _error("card_error", "Your card was declined.", code="card_declined")
            error["error"][_OBJECT[kind]] = made
            return 402, error
        if confirmed:
            self.charges.append(made)
        return 200, made

    def _ordered(self, kind: str) -> list[dict[str, Any]]:
        return sorted(self.objects[kind].values(), key=lambda o: (o["created"], o["id"]))[::-1]

    def _list(self, kind: str, params: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            found = self._ordered(kind)
        created = params.get("created") or {}
        if "gte" in created:
            found = [o for o in found if o["created"] >= int(created["gte"])]
        for field in ("charge", "payment_intent"):
            if field in params:
                found = [o for o in found if o.get(field) == params[field]]
        after = params.get("starting_after")
        if after:
            ids = [o["id"] for o in found]
            found = found[ids.index(after) + 1 :] if after in ids else []
        limit = int(params.get("limit") or 10)
        return {
            "object": "list", "url": f"/v1/{kind}", "has_more": len(found) > limit,
            "data": found[:limit],
        }  # fmt: skip

    def _search(self, kind: str, params: dict[str, Any]) -> dict[str, Any]:
        match = re.fullmatch(
            r"metadata\['((?:[^'\\]|\\.)*)'\]:'((?:[^'\\]|\\.)*)'", params["query"]
        )
        if match is None:
            raise ValueError(f"the fake's search knows only metadata['k']:'v', not {params!r}")
        field, value = (re.sub(r"\\(.)", r"\1", g) for g in match.groups())
        with self.lock:
            found = [o for o in self._ordered(kind) if o["metadata"].get(field) == value]
        start = int(params.get("page") or 0)
        limit = int(params.get("limit") or 10)
        page = found[start : start + limit]
        more = start + limit < len(found)
        return {
            "object": "search_result", "url": f"/v1/{kind}/search", "has_more": more,
            "next_page": str(start + limit) if more else None, "data": page,
        }  # fmt: skip


def _error(kind: str, message: str, code: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"type": kind, "message": message}
    if code:
        error["code"] = code
    return {"error": error}


def _handler(stripe: FakeStripe) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length).decode() if length else ""
            parts = urlsplit(self.path)
            status, payload, extra = stripe.handle(
                method, parts.path, parts.query, body, self.headers
            )
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Request-Id", f"req_{secrets.token_hex(6)}")
            for name, value in extra.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

    return Handler
