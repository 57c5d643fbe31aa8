"""A webhook signed per the Standard Webhooks specification (the `notify` extra).

    webhook+https://hooks.example.com/crewai#secret_env=HOOK_SECRET

Each try is a POST of the entry as JSON (`Message.body`: `type`, `timestamp`, `data` and
the rest, every argument whole) with `webhook-id` (the entry's id: the same on every try,
the receiver's key to deduplicate on), `webhook-timestamp` (when this try was sent) and
`webhook-signature`, made by the `standardwebhooks` library from the shared secret.
A 2xx is delivered; anything else is a failed try, tried again later (`Retry-After`
respected). Redirects are not followed. The secret is `secret_env=NAME` (read now),
`secret_file=PATH` or `secret=whsec_...`: a Standard Webhooks secret (base64 of 24 to 64
bytes, `whsec_` prefixed or not), taken as given, `+` included; anything else is refused
here, never signed with. Plain `http://` is refused except to this host (tests, a sidecar).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import ipaddress
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._errors import LedgerConfigurationError
from ._kinds import Channel, built_in, check_options, http_client, http_target, post
from ._message import Message


class WebhookChannel(Channel):
    scheme = "webhook"

    def __init__(self, target: str, options: Mapping[str, str]) -> None:
        check_options(self.scheme, options, ("secret", "secret_env", "secret_file"))
        super().__init__(target, options)
        http_target(target, "a webhook channel", "https://hooks.example.com/crewai", _loopback)
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
        secret, where = options["secret"], "secret="
    elif "secret_env" in options:
        name = options["secret_env"]
        if not name.strip():
            raise LedgerConfigurationError(
                "secret_env= names no variable: give the name of the environment variable "
                "that holds the secret (#secret_env=HOOK_SECRET)"
            )
        secret, where = os.environ.get(name, ""), f"secret_env={name}"
        if not secret.strip():
            raise LedgerConfigurationError(f"secret_env={name}: that variable is not set")
    else:
        path = Path(options["secret_file"])
        if not options["secret_file"].strip():
            raise LedgerConfigurationError(
                "secret_file= names no file: give the path of the file that holds the secret"
            )
        try:
            secret = path.read_text("utf-8")
        except OSError as exc:
            raise LedgerConfigurationError(f"secret_file={path}: {exc}") from None
        where = f"secret_file={path}"
    if not secret.strip():
        raise LedgerConfigurationError(f"{where}: the webhook secret is empty")
    return _standard(secret.strip(), where)


#: What Standard Webhooks asks of a secret: base64 of 24 to 64 random bytes.
SECRET_BYTES = (24, 64)


def _standard(secret: str, where: str) -> str:
    """`secret` as given, if it is one the Standard Webhooks format allows (`whsec_` and
    the base64 of 24 to 64 bytes; the prefix may be left out, as the library allows):
    else a `LedgerConfigurationError` that says what is wrong, never a key of our own
    making (the receiver would refuse every delivery)."""
    encoded = secret.removeprefix("whsec_")
    try:
        key = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise LedgerConfigurationError(
            f"{where}: not a Standard Webhooks secret (whsec_ and base64: letters, digits, "
            "+, / and = padding); use the one the receiver verifies with, or make one with: "
            'python -c "import base64, os; '
            "print('whsec_' + base64.b64encode(os.urandom(32)).decode())\""
        ) from None
    low, high = SECRET_BYTES
    if not low <= len(key) <= high:
        raise LedgerConfigurationError(
            f"{where}: a Standard Webhooks secret is {low} to {high} bytes, base64 encoded; "
            f"this one is {len(key)}"
        )
    return secret


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


built_in(WebhookChannel.scheme, WebhookChannel)
