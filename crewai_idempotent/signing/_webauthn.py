"""Passkeys (WebAuthn): a trusted passkey's COSE key, checked when its line is read, and
an assertion over a decision's challenge, verified with py_webauthn (the `passkeys`
extra; only a process whose trusted keys hold a passkey line loads it).

What is checked, in order, each refusal naming what failed: the credential is the one
the trusted line names; clientDataJSON is a `webauthn.get` whose challenge is this
decision's (`Decision.challenge()`, so an assertion made for another call, another
round or another deadline does not verify) from one of the line's origins; the
authenticator data's relying party is the line's `rp`; the user was present (and
verified, with `uv=required`); then py_webauthn's `verify_authentication_response`
checks all of it again and the signature.

The signature counter: authenticators count assertions so that a relying party can
notice a cloned credential, which needs the last count kept per credential. Workers are
stateless and read nothing trusted but their configuration, so they cannot keep it (a
count kept in the ledger could be rewritten by whoever the signatures guard against).
The count is not checked (py_webauthn is told the last count was 0, which accepts any).
A replayed assertion gains nothing: it signs one decision's exact bytes, bound to one
request, round and deadline (or one record's fencing token), which the ledger's state
machine obeys once; many passkeys (synced ones) report 0 anyway.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import DecisionRefused, SigningConfigurationError
from ._cose import need_extra
from ._encoding import b64url, from_b64url, key_id
from ._keys import render_line

if TYPE_CHECKING:
    from ._envelope import SignatureEnvelope
    from ._keys import TrustedKey

_UP, _UV = 0x01, 0x04


def verify_assertion(
    decision_kind: str,
    subject: str,
    challenge: bytes,
    trusted: TrustedKey,
    envelope: SignatureEnvelope,
) -> None:
    """Verify a passkey's assertion over `challenge` by the `trusted` key. Raises
    `DecisionRefused` naming what failed (credential, client-data, challenge, origin,
    rp-id, user-presence, user-verification, signature) for `subject`."""

    def refuse(reason: str, detail: str) -> DecisionRefused:
        return DecisionRefused(subject, reason, detail, kind=decision_kind, key_id=trusted.key_id)

    credential = trusted.credential_id
    if envelope.credential_id != credential:
        raise refuse(
            "credential",
            f"the assertion is by credential {b64url(envelope.credential_id or b'')!r:.40}, "
            f"not the trusted key's {trusted.options.get('credential')!r:.40}",
        )
    client_json = envelope.client_data_json or b""
    auth_data = envelope.authenticator_data or b""
    try:
        client = json.loads(client_json)
        if not isinstance(client, dict):
            raise ValueError("not an object")
        kind, claimed = client.get("type"), from_b64url(client.get("challenge", ""))
    except (ValueError, UnicodeDecodeError) as exc:
        raise refuse("client-data", f"clientDataJSON cannot be read: {exc}") from None
    if kind != "webauthn.get":
        raise refuse("client-data", f"clientDataJSON is a {kind!r}, not a webauthn.get")
    if claimed != challenge:
        raise refuse(
            "challenge",
            "the passkey signed another decision's challenge, not this one's (another call, "
            "round, deadline or identity)",
        )
    origin = client.get("origin")
    if origin not in trusted.origins:
        raise refuse(
            "origin",
            f"the assertion was made on {origin!r}, not on {', '.join(trusted.origins)}",
        )
    if len(auth_data) < 37:
        raise refuse("client-data", f"authenticatorData is {len(auth_data)} bytes, not 37 or more")
    rp_id = trusted.rp_id or ""
    if auth_data[:32] != hashlib.sha256(rp_id.encode()).digest():
        raise refuse("rp-id", f"the assertion is for another relying party, not {rp_id!r}")
    if not auth_data[32] & _UP:
        raise refuse("user-presence", "the authenticator did not see the user present")
    if trusted.user_verification and not auth_data[32] & _UV:
        raise refuse("user-verification", "the authenticator did not verify the user (uv=required)")
    from webauthn import verify_authentication_response
    from webauthn.helpers.exceptions import InvalidAuthenticationResponse

    raw_id = b64url(credential or b"")
    try:
        verify_authentication_response(
            credential={
                "id": raw_id, "rawId": raw_id, "type": "public-key",
                "response": {
                    "authenticatorData": b64url(auth_data),
                    "clientDataJSON": b64url(client_json),
                    "signature": b64url(envelope.signature),
                },
            },
            expected_challenge=challenge,
            expected_rp_id=rp_id,
            expected_origin=list(trusted.origins),
            credential_public_key=trusted.public_key,
            credential_current_sign_count=0,  # stateless workers: see the module's note
            require_user_verification=trusted.user_verification,
        )  # fmt: skip
    except InvalidAuthenticationResponse as exc:
        raise refuse("signature", f"the passkey's assertion does not verify: {exc}") from None


def passkey_line(
    registration: Mapping[str, Any] | str,
    *,
    challenge: bytes,
    rp_id: str,
    origin: str,
    identity: str,
    roles: str | Sequence[str] = ("approve",),
    require_user_verification: bool = False,
) -> str:
    """The trusted keys line for a passkey just registered: `registration` is the
    browser's `navigator.credentials.create()` response (its JSON), `challenge` the one
    the console gave it, `rp_id` and `origin` where it was made; `identity` and `roles`
    go on the line (`require_user_verification` adds uv=required). Raises
    `SigningConfigurationError` without the `passkeys` extra or for a registration that
    does not verify."""
    where = f"the passkey registered for {identity!r}"
    try:
        from webauthn import verify_registration_response
        from webauthn.helpers.exceptions import InvalidRegistrationResponse
    except ImportError as exc:
        raise need_extra(where, exc) from None
    try:
        made = verify_registration_response(
            credential=dict(registration) if isinstance(registration, Mapping) else registration,
            expected_challenge=challenge,
            expected_rp_id=rp_id,
            expected_origin=origin,
            require_user_verification=require_user_verification,
        )
    except (InvalidRegistrationResponse, ValueError) as exc:
        raise SigningConfigurationError(f"{where} does not verify: {exc}") from None
    options = {"credential": b64url(made.credential_id), "rp": rp_id, "origin": origin}
    if require_user_verification:
        options["uv"] = "required"
    return render_line(roles, "webauthn", made.credential_public_key, identity, **options)


def passkey_key_id(cose_public_key: bytes) -> str:
    """The key id of the passkey whose COSE public key is `cose_public_key` (as its
    trusted line's key has): what its envelopes name. Raises nothing."""
    return key_id("webauthn", cose_public_key)
