"""A webhook signed per the Standard Webhooks specification (the `notify` extra).

    webhook+https://hooks.example.com/crewai#secret_env=HOOK_SECRET

Each try is a POST of the entry as JSON (`Message.body`: `type`, `timestamp`, `data` and
the rest, every argument whole) with `webhook-id` (the entry's id: the same on every try,
the receiver's key to deduplicate on), `webhook-timestamp` (when this try was sent) and
`webhook-signature`, made by the `standardwebhooks` library from the shared secret.
A 2xx is delivered; anything else is a failed try, tried again later (`Retry-After`
respected). Redirects are not followed. The secret is `secret_env=NAME` (read now),
`secret_file=PATH` or `secret=whsec_...`, as the library takes it (base64, `whsec_`
prefixed or not). Plain `http://` is refused except to this host (tests, a sidecar).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .._errors import LedgerConfigurationError
from ._channels import Channel, check_options, http_client, post
from ._message import Message


class WebhookChannel(Channel):
    scheme = "webhook"

    def __init__(self, target: str, options: Mapping[str, str]) -> None:
        check_options(self.scheme, options, ("secret", "secret_env", "secret_file"))
        super().__init__(target, options)
        parts = urlsplit(target)
        if parts.scheme not in ("https", "http") or not parts.hostname:
            raise LedgerConfigurationError(
                f"a webhook channel posts to an https:// URL, not {parts.scheme or target!r}"
            )
        if parts.scheme == "http" and not _loopback(parts.hostname):
            raise LedgerConfigurationError(
                "a webhook channel sends its deliveries over https:// (plain http:// only to "
                "this host)"
            )
        try:
            from standardwebhooks import Webhook
        except ImportError as exc:
            raise LedgerConfigurationError(
                f"the webhook channel signs with the standardwebhooks library ({exc}); "
                "install it with: pip install 'crewai-idempotent[notify]'"
            ) from None
        try:
            self._signer = Webhook(_secret(options))
        except LedgerConfigurationError:
            raise
        except Exception as exc:  # noqa: BLE001 - the library's own refusal of a secret
            raise LedgerConfigurationError(
                f"the webhook secret is not usable ({type(exc).__name__}: {exc}); give the "
                "base64 secret the receiver verifies with (whsec_...)"
            ) from None
        self._client: Any = None

    def send(self, message: Message) -> None:
        body = json.dumps(message.body(), ensure_ascii=False, separators=(",", ":"), default=str)
        sent = dt.datetime.now(dt.UTC)
        headers = {
            "content-type": "application/json",
            "webhook-id": message.id,
            "webhook-timestamp": str(int(sent.timestamp())),
            "webhook-signature": self._signer.sign(message.id, sent, body),
        }
        if self._client is None:
            self._client = http_client()
        post(self._client, self.target, body.encode("utf-8"), headers, self.timeout_s)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _secret(options: Mapping[str, str]) -> str:
    given = [name for name in ("secret", "secret_env", "secret_file") if name in options]
    if len(given) != 1:
        raise LedgerConfigurationError(
            "a webhook channel signs every delivery: give its secret as exactly one of "
            "#secret_env=NAME (an environment variable), #secret_file=PATH or #secret=whsec_..."
            + (f" (not {' and '.join(given)})" if given else "")
        )
    if "secret" in options:
        secret = options["secret"]
    elif "secret_env" in options:
        name = options["secret_env"]
        secret = os.environ.get(name, "")
        if not secret.strip():
            raise LedgerConfigurationError(f"secret_env={name}: that variable is not set")
    else:
        path = Path(options["secret_file"])
        try:
            secret = path.read_text("utf-8")
        except OSError as exc:
            raise LedgerConfigurationError(f"secret_file={path}: {exc}") from None
    if not secret.strip():
        raise LedgerConfigurationError("the webhook secret is empty")
    return secret.strip()


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
