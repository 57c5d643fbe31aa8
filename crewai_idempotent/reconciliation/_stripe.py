"""A verifier for Stripe: what Stripe made for an idempotency key (the `stripe` extra).

A tool that charges through Stripe passes the guard's key twice: as the request's
`Idempotency-Key`, and in the object's metadata (`metadata={"idempotency_key": key}`).
The verifier then asks Stripe, with the official `stripe` library:

* **by metadata** (the default): the PaymentIntent, Charge or Refund whose metadata
  carries the key, among those created since the claim (listing by creation time, which
  Stripe answers consistently; or its Search API with `search=True`, which lags behind by
  up to a minute, so an empty search is Absent only once the claim is older than
  `search_lag_s`). One found: Found, its receipt `receipt(obj)` (the object's id by
  default, what a tool usually returns). None: Absent, and the next call charges.
* **by replay** (`replay=(key, args) -> params`): the create request re-sent with the same
  `Idempotency-Key` and parameters. Within Stripe's key retention (24 hours) Stripe
  answers with the first request's response and never charges twice; if the first
  request never reached Stripe, this one charges now, once, and its answer is the
  receipt (the record is COMMITTED, not FAILED). A key reused with other parameters is
  refused by Stripe (`IdempotencyError`) and is Unknown; so is a request still in flight
  (409). A declined card (`CardError`) moved no money: Absent.

What it cannot tell: past the retention window a replay is a new request, so a claim
older than `retention_s` is never replayed (only the metadata says anything then); an
object made without the key in its metadata is invisible to the lookup; and an Absent
from the lookup is only as sure as the claim's owner is gone (the sweeper asks only once
its lease lapsed). Errors talking to Stripe (connection, 5xx, 429, credentials) are
Unknown: the sweeper asks again later.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import stripe

from ..ledger._reconcile import Absent, Found, Unknown, Verdict, reconciling
from ._lookup import claimed_at

Kind = Literal["payment_intent", "charge", "refund"]
_SERVICES = {"payment_intent": "payment_intents", "charge": "charges", "refund": "refunds"}
_SEARCHABLE = ("payment_intent", "charge")


class StripeVerifier:
    """Finds the PaymentIntent, Charge or Refund Stripe made for an idempotency key.

    `kind`: what the tool creates. `api_key` (else `STRIPE_API_KEY`, else `stripe.api_key`)
    or a ready `client` (a `stripe.StripeClient`); `api_base` points the client elsewhere
    (a test server). `metadata_key`: the metadata field the tool stores the key in (None:
    it stores none, so only `replay` can tell). `receipt(obj)`: what the tool returned for
    that object (default: its id). `window_s`: how long before the claim an object may
    have been created and still count (the hosts' clocks differ). `timeout_s`: each
    request to Stripe. `search`: look up by Stripe's Search API rather than by listing
    (PaymentIntents and Charges only); an empty search is Absent only once the claim is
    older than `search_lag_s`. `replay(key, args)`: the create request's parameters, re-sent
    with the key (see the module docstring); `retention_s`: Stripe's key retention, past
    which (less `window_s`) a claim is never replayed.

    Raises `ValueError` for an unknown `kind`, `search=True` for a kind Stripe's Search
    API does not have, or `metadata_key=None` without `replay`. A missing API key is found
    when Stripe is first asked (`client`), and every answer is then Unknown.
    """

    def __init__(
        self,
        kind: Kind = "payment_intent",
        *,
        api_key: str | None = None,
        client: stripe.StripeClient | None = None,
        api_base: str | None = None,
        metadata_key: str | None = "idempotency_key",
        search: bool = False,
        replay: Callable[[str, Any], Mapping[str, Any]] | None = None,
        receipt: Callable[[Any], Any] | None = None,
        retention_s: float = 24 * 3600.0,
        search_lag_s: float = 120.0,
        window_s: float = 600.0,
        timeout_s: float = 20.0,
    ) -> None:
        if kind not in _SERVICES:
            raise ValueError(f"kind must be one of {', '.join(_SERVICES)}, not {kind!r}")
        if search and kind not in _SEARCHABLE:
            raise ValueError(f"Stripe's Search API has no {kind}s; leave search=False")
        if metadata_key is None and replay is None:
            raise ValueError(
                "with metadata_key=None the verifier can only replay: give replay=(key, args) "
                "-> the create request's parameters"
            )
        self.kind, self.metadata_key, self.search = kind, metadata_key, search
        self.replay, self.receipt = replay, receipt or _id
        self.retention_s, self.search_lag_s = retention_s, search_lag_s
        self.window_s, self.timeout_s = window_s, timeout_s
        self._api_key, self._api_base = api_key, api_base
        self._client = client
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"StripeVerifier({self.kind!r})"

    def client(self) -> stripe.StripeClient:
        """The `stripe.StripeClient` the verifier asks: the one given, else one made at the
        first request from `api_key` (else `STRIPE_API_KEY`, else `stripe.api_key`), with
        `api_base`, `timeout_s` and no retries of its own (the sweeper asks again later).
        Raises `stripe.AuthenticationError` when there is no API key."""
        with self._lock:
            if self._client is None:
                key = self._api_key or os.environ.get("STRIPE_API_KEY") or stripe.api_key
                if not key:
                    raise stripe.AuthenticationError(
                        "no Stripe API key: give api_key=, or set STRIPE_API_KEY"
                    )
                self._client = stripe.StripeClient(
                    key,
                    base_addresses={"api": self._api_base} if self._api_base else None,
                    max_network_retries=0,  # the sweeper asks again, after its back-off
                    http_client=stripe.new_default_http_client(timeout=self.timeout_s),
                )
            return self._client

    def __call__(self, key: str, args: Any) -> Verdict:
        record = reconciling()
        claimed = claimed_at(record)
        age = None if claimed is None else time.time() - claimed
        try:
            found: Verdict | None = None
            if self.metadata_key is not None:
                found = self._look_up(key, claimed, age)
                if isinstance(found, Found):
                    return found
            if self.replay is not None:
                if age is None or age < self.retention_s - self.window_s:
                    return self._replay(key, args)
                if found is None:
                    return Unknown(
                        f"the claim is {age:.0f} s old, past Stripe's idempotency key retention "
                        f"({self.retention_s:g} s): a replay could charge again, and without "
                        "metadata_key nothing else can tell"
                    )
            assert found is not None
            return found
        except stripe.StripeError as exc:
            return Unknown(f"Stripe: {_error(exc)}")

    # -- by metadata -------------------------------------------------------------------

    def _look_up(self, key: str, claimed: float | None, age: float | None) -> Verdict:
        since = None if claimed is None else int(claimed - self.window_s)
        matches = [obj for obj in self._candidates(key, since) if self._carries(obj, key)]
        if since is not None:
            matches = [obj for obj in matches if getattr(obj, "created", since) >= since]
        if len(matches) > 1:
            ids = ", ".join(str(getattr(obj, "id", "?")) for obj in matches[:5])
            return Unknown(
                f"{len(matches)} {self.kind}s carry metadata {self.metadata_key}={key!r} "
                f"({ids}): more than one execution, or keys reused; look at them"
            )
        if matches:
            return Found(self.receipt(matches[0]))
        if self.search and (age is None or age < self.search_lag_s):
            return Unknown(
                f"no {self.kind} found by Stripe's search yet, but the claim is "
                f"{'of unknown age' if age is None else f'{age:.0f} s old'}: the search lags "
                f"(an empty one counts as absent after {self.search_lag_s:g} s)"
            )
        return Absent()

    def _candidates(self, key: str, since: int | None) -> Iterable[Any]:
        service = getattr(self.client().v1, _SERVICES[self.kind])
        if self.search:
            query = f"metadata['{_quoted(self.metadata_key or '')}']:'{_quoted(key)}'"
            return service.search({"query": query, "limit": 100}).auto_paging_iter()
        params: dict[str, Any] = {"limit": 100}
        if since is not None:
            params["created"] = {"gte": since}
        return service.list(params).auto_paging_iter()

    def _carries(self, obj: Any, key: str) -> bool:
        metadata = getattr(obj, "metadata", None)
        if metadata is None:
            return False
        # A StripeObject is not a dict in newer releases of the library; to_dict() is in all.
        as_dict = metadata.to_dict() if hasattr(metadata, "to_dict") else dict(metadata)
        return bool(as_dict.get(self.metadata_key) == key)

    # -- by replay ---------------------------------------------------------------------

    def _replay(self, key: str, args: Any) -> Verdict:
        assert self.replay is not None
        try:
            params = dict(self.replay(key, args))
        except Exception as exc:  # noqa: BLE001 - a request that cannot be built is not sent
            return Unknown(f"cannot build the replayed request: {type(exc).__name__}: {exc}")
        service = getattr(self.client().v1, _SERVICES[self.kind])
        try:
            made = service.create(params, {"idempotency_key": key})
        except stripe.IdempotencyError as exc:
            return Unknown(
                "Stripe refuses the replay: the key was used with other parameters (the "
                f"replayed request differs from the tool's): {_error(exc)}"
            )
        except stripe.CardError:
            return Absent()  # declined: no money moved (Stripe keeps the decline for the key)
        except stripe.APIError as exc:
            if exc.http_status == 409:
                return Unknown(f"the first request with this key is still in flight: {_error(exc)}")
            raise
        return Found(self.receipt(made))


def _id(obj: Any) -> Any:
    return obj.id


def _quoted(text: str) -> str:
    """A string for Stripe's search query language, inside single quotes."""
    return text.replace("\\", "\\\\").replace("'", "\\'")


def _error(exc: stripe.StripeError) -> str:
    status = f"{exc.http_status} " if exc.http_status else ""
    return f"{status}{type(exc).__name__}: {exc.user_message or exc}"
