"""How keys and signatures are written: base64url (WebAuthn's), and a public key's id."""

from __future__ import annotations

import base64
import binascii
import hashlib
import re

_B64URL = re.compile(r"[A-Za-z0-9_-]*={0,2}")


def key_id(algorithm: str, public_key: bytes) -> str:
    """A public key's id, as envelopes and messages name it: `SHA256:` and the unpadded
    base64 of the SHA-256 of the algorithm's name and the key's bytes."""
    digest = hashlib.sha256(algorithm.encode() + b"\x00" + public_key).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def b64url(data: bytes) -> str:
    """`data` as unpadded base64url."""
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def from_b64url(text: str) -> bytes:
    """The bytes base64url `text` (padded or not) holds. Raises `ValueError` for anything
    else."""
    if not isinstance(text, str) or not _B64URL.fullmatch(text):
        raise ValueError(f"not base64url: {text!r:.60}")
    bare = text.rstrip("=")
    try:
        return base64.urlsafe_b64decode(bare + "=" * (-len(bare) % 4))
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64url: {text!r:.60} ({exc})") from None


def from_b64(text: str) -> bytes:
    """The bytes standard base64 `text` holds. Raises `ValueError` for anything else."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64 ({exc})") from None
