"""A signature envelope: what is stored beside a decision so that anyone holding the
trusted keys can check it. The algorithm, the id of the key that signed, the signature;
for a passkey also what the authenticator signed around the challenge (authenticatorData
and clientDataJSON) and the credential id. Its JSON form writes bytes as base64url.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._encoding import b64url, from_b64url
from ._keys import ALGORITHMS

VERSION = 1
_WEBAUTHN = ("authenticator_data", "client_data_json", "credential_id")


@dataclass(frozen=True, slots=True)
class SignatureEnvelope:
    """One signature over a decision: `algorithm` (ed25519 or webauthn), `key_id` (the
    signing key's id, `SHA256:...`), `signature`; for webauthn also
    `authenticator_data`, `client_data_json` and `credential_id` (bytes, as the
    authenticator returned them). Raises `ValueError` for an unknown algorithm or a
    passkey envelope that lacks one of its three parts."""

    algorithm: str
    key_id: str
    signature: bytes
    authenticator_data: bytes | None = None
    client_data_json: bytes | None = None
    credential_id: bytes | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be {' or '.join(ALGORITHMS)}, not {self.algorithm!r}")
        if not isinstance(self.key_id, str) or not self.key_id.startswith("SHA256:"):
            raise ValueError(f"key_id must be a key id (SHA256:...), not {self.key_id!r:.60}")
        parts = [self.signature, *(getattr(self, name) for name in _WEBAUTHN)]
        if any(part is not None and not isinstance(part, bytes) for part in parts):
            raise ValueError("a signature envelope's signature and parts are bytes")
        passkey = self.algorithm == "webauthn"
        for name in _WEBAUTHN:
            if (getattr(self, name) is None) == passkey:
                raise ValueError(
                    f"a {self.algorithm} signature {'needs' if passkey else 'has no'} {name}"
                )

    def to_json(self) -> dict[str, Any]:
        """The envelope as plain JSON (bytes as base64url), the form stored in the ledger.
        Raises nothing."""
        doc: dict[str, Any] = {
            "v": VERSION, "alg": self.algorithm, "key": self.key_id, "sig": b64url(self.signature)
        }  # fmt: skip
        for name in _WEBAUTHN:
            value = getattr(self, name)
            if value is not None:
                doc[name] = b64url(value)
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> SignatureEnvelope:
        """The envelope `doc` (a `to_json()`) holds. Raises `ValueError` for another
        version, an unknown or missing field, or a value that is not what it should be."""
        if not isinstance(doc, Mapping):
            raise ValueError(f"a signature envelope is a JSON object, not {type(doc).__name__}")
        if doc.get("v") != VERSION:
            raise ValueError(f"not a version {VERSION} signature envelope (v={doc.get('v')!r})")
        unknown = sorted(set(doc) - {"v", "alg", "key", "sig", *_WEBAUTHN})
        if unknown:
            raise ValueError(f"a signature envelope has no field {', '.join(map(repr, unknown))}")
        missing = [name for name in ("alg", "key", "sig") if name not in doc]
        if missing:
            raise ValueError(f"a signature envelope needs {', '.join(missing)}")
        parts = {name: from_b64url(doc[name]) for name in _WEBAUTHN if name in doc}
        return cls(doc["alg"], doc["key"], from_b64url(doc["sig"]), **parts)

    @classmethod
    def from_assertion(cls, assertion: Mapping[str, Any], key_id: str) -> SignatureEnvelope:
        """The envelope of a passkey's assertion: `assertion` is the browser's
        `navigator.credentials.get()` response as JSON (`rawId`, and `response` with
        `authenticatorData`, `clientDataJSON` and `signature`, base64url), `key_id` the
        trusted key it claims to be (`TrustedKeys.by_credential`). Raises `ValueError`
        for a part that is missing or not base64url."""
        try:
            response = assertion["response"]
            return cls(
                "webauthn", key_id, from_b64url(response["signature"]),
                authenticator_data=from_b64url(response["authenticatorData"]),
                client_data_json=from_b64url(response["clientDataJSON"]),
                credential_id=from_b64url(assertion["rawId"]),
            )  # fmt: skip
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a WebAuthn assertion: {exc!r} is missing") from None
