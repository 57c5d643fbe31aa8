"""A passkey authenticator in software, for the tests: an ES256 key that answers
navigator.credentials.create() and .get() as a browser hands them to a relying party.

Built from `cryptography` and the WebAuthn spec alone (its own few lines of CBOR), not
from the library the package verifies with, so that the two can disagree.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

UP, UV, AT = 0x01, 0x04, 0x40


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def cbor(value: Any) -> bytes:
    """CBOR (RFC 8949) for what COSE keys and attestation objects hold."""

    def head(major: int, n: int) -> bytes:
        if n < 24:
            return bytes([major << 5 | n])
        for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
            if n < 1 << (8 * struct.calcsize(fmt)):
                return bytes([major << 5 | extra]) + struct.pack(fmt, n)
        raise ValueError(n)

    if isinstance(value, bool):
        raise TypeError("not needed")
    if isinstance(value, int):
        return head(0, value) if value >= 0 else head(1, -1 - value)
    if isinstance(value, bytes):
        return head(2, len(value)) + value
    if isinstance(value, str):
        encoded = value.encode()
        return head(3, len(encoded)) + encoded
    if isinstance(value, dict):
        return head(5, len(value)) + b"".join(cbor(k) + cbor(v) for k, v in value.items())
    raise TypeError(type(value))


class Authenticator:
    """One passkey (an ES256 credential) for `rp_id`."""

    def __init__(self, rp_id: str = "example.com") -> None:
        self.rp_id = rp_id
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.credential_id = os.urandom(16)
        self.sign_count = 0

    @property
    def cose_key(self) -> bytes:
        numbers = self.key.public_key().public_numbers()
        x, y = numbers.x.to_bytes(32, "big"), numbers.y.to_bytes(32, "big")
        return cbor({1: 2, 3: -7, -1: 1, -2: x, -3: y})  # EC2, ES256, P-256

    def line(self, identity: str, *, roles: str = "approve", origin: str, **more: str) -> str:
        options = {"credential": b64url(self.credential_id), "rp": self.rp_id, "origin": origin}
        options.update(more)
        words = [roles, "webauthn", b64url(self.cose_key), identity]
        return " ".join(words + [f"{k}={v}" for k, v in options.items()])

    def _auth_data(self, rp_id: str | None, flags: int, attested: bytes = b"") -> bytes:
        rp_hash = hashlib.sha256((rp_id or self.rp_id).encode()).digest()
        return rp_hash + bytes([flags]) + struct.pack(">I", self.sign_count) + attested

    @staticmethod
    def _client_data(kind: str, challenge: bytes, origin: str) -> bytes:
        # As Chromium serializes it: type, challenge, origin, crossOrigin, in that order.
        return json.dumps(
            {"type": kind, "challenge": b64url(challenge), "origin": origin, "crossOrigin": False},
            separators=(",", ":"),
        ).encode()

    def get(
        self,
        challenge: bytes,
        origin: str,
        *,
        rp_id: str | None = None,
        flags: int = UP | UV,
        kind: str = "webauthn.get",
        count: bool = True,
    ) -> dict[str, Any]:
        """navigator.credentials.get()'s answer as its JSON (toJSON()): an assertion."""
        if count:
            self.sign_count += 1
        auth_data = self._auth_data(rp_id, flags)
        client_data = self._client_data(kind, challenge, origin)
        signed = auth_data + hashlib.sha256(client_data).digest()
        signature = self.key.sign(signed, ec.ECDSA(hashes.SHA256()))
        raw = b64url(self.credential_id)
        return {
            "id": raw,
            "rawId": raw,
            "type": "public-key",
            "response": {
                "authenticatorData": b64url(auth_data),
                "clientDataJSON": b64url(client_data),
                "signature": b64url(signature),
                "userHandle": None,
            },
        }

    def create(self, challenge: bytes, origin: str) -> dict[str, Any]:
        """navigator.credentials.create()'s answer as its JSON, attestation "none"."""
        attested = bytes(16) + struct.pack(">H", len(self.credential_id)) + self.credential_id
        auth_data = self._auth_data(None, UP | UV | AT, attested + self.cose_key)
        attestation = cbor({"fmt": "none", "attStmt": {}, "authData": auth_data})
        raw = b64url(self.credential_id)
        return {
            "id": raw,
            "rawId": raw,
            "type": "public-key",
            "response": {
                "clientDataJSON": b64url(self._client_data("webauthn.create", challenge, origin)),
                "attestationObject": b64url(attestation),
            },
        }
