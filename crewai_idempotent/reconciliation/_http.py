"""A verifier for HTTP APIs that honour an `Idempotency-Key` header (the `http` extra).

The IETF httpapi draft ("The Idempotency-Key HTTP Header Field") says what a server does
with a request that carries a key it has seen: the same key with the same request gets
the first request's answer, and is never performed again; a key whose first request is
still being processed gets 409 Conflict; a key reused with a different request gets 422
Unprocessable Content. So re-sending the call's request with its key is a safe question:
the answer is the receipt.

What it proves: a 2xx answer is the operation's outcome, performed once. If the first
request never reached the server, the re-sent one performs it now (once: the key keeps it
so), and its answer is the receipt: the record is COMMITTED rather than FAILED, and the
effect happens at sweep time rather than at call time.

What it cannot prove: anything outside the server's key retention (a server forgets keys
after a while, often 24 hours: past that a re-sent request is a new one; give
`max_age_s`), and anything when the request the verifier builds is not the one the tool
sent (422: Unknown, never a new effect). 409, 422, 429, 5xx and failed connections are
Unknown: the sweeper asks again later. Other 4xx answers are Unknown unless you say they
prove absence (`absent_on=`), since a server may refuse the verifier for its own reasons
(its credentials, a changed route).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import httpx

from ..ledger._reconcile import Absent, Found, Unknown, Verdict, reconciling
from ._lookup import claimed_at

Built = Callable[[str, Any], Any]


class IdempotencyKeyVerifier:
    """Re-sends the call's request with the same `Idempotency-Key`; the answer is the
    receipt.

    `method` and `url` are the tool's request: `url` a string (formatted with the call's
    arguments and `key`, as in `"https://pay.example/orders/{order_id}/charge"`) or a
    function `(key, args) -> url`. The body: `json(key, args)` (a JSON body) or
    `content(key, args)` (bytes or text). `headers` are sent as they are (credentials);
    `header` is the key's header, its value `key_value(key, args)` (the guard's key by
    default, which is what a tool given `idempotency_key` sends), as a structured-field
    string (`"..."`, as the draft writes it) when `structured`. `receipt(response)` is
    what the tool would have returned (by default the JSON body, else the text).
    `absent_on`: statuses that prove the operation was never done (none by default).
    `max_age_s`: the server's key retention; an older claim is Unknown, never re-sent.
    `timeout_s`: each request's timeout, on the client the verifier makes; or give a ready
    `client` (an `httpx.Client`, whose own settings apply).

    Raises `TypeError` for both `json` and `content`, or a `url` that is neither a string
    nor a function, and `ValueError` for a blank `method`.
    """

    def __init__(
        self,
        method: str,
        url: str | Built,
        *,
        json: Built | None = None,
        content: Built | None = None,
        headers: Mapping[str, str] | None = None,
        header: str = "Idempotency-Key",
        key_value: Callable[[str, Any], str] | None = None,
        structured: bool = False,
        receipt: Callable[[httpx.Response], Any] | None = None,
        absent_on: Collection[int] = (),
        max_age_s: float | None = 24 * 3600.0,
        timeout_s: float = 20.0,
        client: httpx.Client | None = None,
    ) -> None:
        if json is not None and content is not None:
            raise TypeError("give the request's body as json= or content=, not both")
        if not isinstance(method, str) or not method.strip():
            raise ValueError(f"method must be an HTTP method, not {method!r}")
        if not (isinstance(url, str) or callable(url)):
            raise TypeError(f"url must be a string or a function (key, args) -> url, not {url!r}")
        self.method = method.strip().upper()
        self.url, self.json, self.content = url, json, content
        self.headers = dict(headers or {})
        self.header, self.key_value, self.structured = header, key_value, structured
        self.receipt = receipt or _body
        self.absent_on = frozenset(absent_on)
        self.max_age_s, self.timeout_s = max_age_s, timeout_s
        self._client = client
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        shown = self.url if isinstance(self.url, str) else getattr(self.url, "__qualname__", "?")
        return f"IdempotencyKeyVerifier({self.method} {shown})"

    def client(self) -> httpx.Client:
        """The `httpx.Client` requests go through: the one given, else one made at the
        first request with `timeout_s` and shared by every thread. Raises nothing."""
        with self._lock:
            if self._client is None:
                self._client = httpx.Client(timeout=self.timeout_s)
            return self._client

    def request(self, key: str, args: Any) -> httpx.Request:
        """The request the verifier sends for the call under `key` whose recorded
        arguments are `args` (a mapping of them fills the `url` template, with `key`).

        Raises `KeyError` or `IndexError` for a field of the `url` template the arguments
        lack, and what the `url`, `json`, `content` and `key_value` functions or httpx
        raise for a request that cannot be built; asked as a reconciler, any of them is
        Unknown."""
        fields = {**(args if isinstance(args, Mapping) else {}), "key": key}
        url = self.url.format(**fields) if isinstance(self.url, str) else self.url(key, args)
        value = self.key_value(key, args) if self.key_value is not None else key
        if self.structured:
            value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        headers = {**self.headers, self.header: value}
        if self.json is not None:
            return self.client().build_request(
                self.method, url, json=self.json(key, args), headers=headers
            )
        content = self.content(key, args) if self.content is not None else None
        return self.client().build_request(self.method, url, content=content, headers=headers)

    def __call__(self, key: str, args: Any) -> Verdict:
        if self.max_age_s is not None:
            claimed = claimed_at(reconciling())
            if claimed is not None and time.time() - claimed > self.max_age_s:
                return Unknown(
                    f"the claim is older than the server's key retention (max_age_s="
                    f"{self.max_age_s:g}): a re-sent request could be performed again, so it "
                    "is not sent; look the operation up another way"
                )
        try:
            request = self.request(key, args)
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            return Unknown(f"cannot build the request from the recorded call: {exc!r}")
        try:
            response = self.client().send(request)
        except httpx.HTTPError as exc:
            return Unknown(f"{self.method} {request.url} failed: {type(exc).__name__}: {exc}")
        status = response.status_code
        if 200 <= status < 300:
            return Found(self.receipt(response))
        said = _said(response)
        if status == 409:
            return Unknown(
                f"409 Conflict: the first request with this key is still being processed{said}"
            )
        if status == 422:
            return Unknown(
                "422: the server holds this key for a different request (the one built from "
                f"the recorded call differs from what the tool sent); nothing was done{said}"
            )
        if status in self.absent_on:
            return Absent()
        return Unknown(f"{status} {response.reason_phrase}{said}")


def _body(response: httpx.Response) -> Any:
    if "json" in response.headers.get("content-type", ""):
        return response.json()
    return response.text


def _said(response: httpx.Response) -> str:
    text = response.text.strip()
    return f": {text[:200]}" if text else ""
