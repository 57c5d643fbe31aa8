"""A passkey's public key (a COSE key), read when its trusted line is, with py_webauthn:
the `passkeys` extra. Only a process whose trusted keys hold a passkey line loads it; in
a process without it, such a line is a configuration error naming the extra."""

from __future__ import annotations

from typing import Any

from .._errors import SigningConfigurationError

EXTRA = "passkeys"
INSTALL = "pip install 'crewai-idempotent[passkeys]'"


def need_extra(where: str, exc: ImportError) -> SigningConfigurationError:
    """The error for a passkey met in a process without the extra (`exc` says what is
    missing)."""
    return SigningConfigurationError(
        f"{where}: a webauthn (passkey) key needs the `{EXTRA}` extra, which is not installed "
        f"here ({exc.name or 'webauthn'} is missing): {INSTALL}"
    )


def check_cose_key(public_key: bytes, where: str) -> Any:
    """The public key object of a passkey's COSE key. Raises `SigningConfigurationError`
    without the `passkeys` extra, or for bytes that are not a COSE public key py_webauthn
    can verify with."""
    try:
        from webauthn.helpers import decode_credential_public_key
        from webauthn.helpers import decoded_public_key_to_cryptography as to_cryptography
    except ImportError as exc:
        raise need_extra(where, exc) from None
    try:
        if not public_key or public_key[0] == 0x04:
            raise ValueError("not a COSE key map")  # py_webauthn would take a raw U2F point
        return to_cryptography(decode_credential_public_key(public_key))
    except Exception as exc:  # noqa: BLE001 - every way a key can be malformed
        raise SigningConfigurationError(
            f"{where}: the passkey's public key is not a COSE public key this version can "
            f"verify with ({type(exc).__name__}: {exc})"
        ) from None
