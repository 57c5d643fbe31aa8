"""Signed decisions: approvals, denials, resolutions and caps that no ledger writer can
forge, checked against keys trusted outside the ledger.

    from crewai_idempotent.signing import Decision, Signer, TrustedKeys, verify

    trusted = TrustedKeys.from_file("/etc/crewai/trusted_keys")  # or TrustedKeys.from_env()
    signer = Signer.from_file("~/.config/crewai-idempotent/alice.key")
    decision = Decision.approval(request=rid, round=1, key=key, fingerprint=digest,
                                 until=deadline, by=signer.identity, via="cli")
    envelope = signer.sign(decision)             # stored beside the decision
    key = verify(decision, envelope, trusted)    # the trusted key, or DecisionRefused

`_decision` (what is decided, its canonical bytes and challenge), `_keys` (a trusted
keys line: roles, algorithm, key, identity, options), `_trusted` (the lines of a file or
of configure(), read again when the file changes), `_keyfile` (an Ed25519 key file and
the `Signer`), `_envelope` (a signature as stored), `_verify` (the checks), `_webauthn`
and `_cose` (passkeys, through the `passkeys` extra), `_files` (files no other user could
have changed), `_encoding` (base64url, key ids).

Every name loads on first use: importing this package loads neither `cryptography` nor
py_webauthn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from ._cose import EXTRA
    from ._decision import DOMAIN, KINDS, VIAS, Decision, receipt_digest, role_for
    from ._envelope import SignatureEnvelope
    from ._keyfile import Signer
    from ._keys import ALGORITHMS, ROLES, TrustedKey
    from ._trusted import ENV, TrustedKeys
    from ._verify import REASONS, verify
    from ._webauthn import passkey_key_id, passkey_line

_WHERE = {
    "EXTRA": "._cose",
    "DOMAIN": "._decision",
    "KINDS": "._decision",
    "VIAS": "._decision",
    "Decision": "._decision",
    "receipt_digest": "._decision",
    "role_for": "._decision",
    "SignatureEnvelope": "._envelope",
    "Signer": "._keyfile",
    "ALGORITHMS": "._keys",
    "ROLES": "._keys",
    "TrustedKey": "._keys",
    "ENV": "._trusted",
    "TrustedKeys": "._trusted",
    "REASONS": "._verify",
    "verify": "._verify",
    "passkey_key_id": "._webauthn",
    "passkey_line": "._webauthn",
}

__getattr__ = lazy_attributes(__name__, _WHERE)

__all__ = [
    "ALGORITHMS",
    "DOMAIN",
    "Decision",
    "ENV",
    "EXTRA",
    "KINDS",
    "REASONS",
    "ROLES",
    "SignatureEnvelope",
    "Signer",
    "TrustedKey",
    "TrustedKeys",
    "VIAS",
    "passkey_key_id",
    "passkey_line",
    "receipt_digest",
    "role_for",
    "verify",
]
