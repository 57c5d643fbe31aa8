"""Verifying a decision against the trusted keys: the one check every use of a grant or
a resolution goes through.

In order: a signature is there and can be read; it names a trusted key; of the algorithm
it claims; the decision is the kind the caller needs; the key has the role the decision
needs (approve, resolve, sweeper for a sweeper's settlements, cap); the decision names
the key's identity; and the signature verifies over the decision's exact bytes (a passkey
over their challenge: `_webauthn`). Any failure is a `DecisionRefused` naming the request,
key or cap and what failed. It runs only where a grant or a resolution is used, never on a
replay; the trusted keys' public key objects were made when their file was read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cryptography.exceptions import InvalidSignature

from .._errors import DecisionRefused
from ._decision import Decision
from ._envelope import SignatureEnvelope
from ._keys import TrustedKey
from ._trusted import TrustedKeys
from ._webauthn import verify_assertion

REASONS = (
    "unsigned", "malformed", "untrusted-key", "algorithm", "kind", "role", "identity",
    "signature", "credential", "client-data", "challenge", "origin", "rp-id",
    "user-presence", "user-verification",
    # Said by the guard, not by `verify`: a valid signature about another call, record or
    # receipt (`subject`), and a grant short of distinct trusted approvers (`approvers`).
    "subject", "approvers",
)  # fmt: skip


def verify(
    decision: Decision | Mapping[str, Any],
    envelope: SignatureEnvelope | Mapping[str, Any] | None,
    trusted: TrustedKeys,
    role: str | None = None,
) -> TrustedKey:
    """The trusted key that signed `decision` (a `Decision`, or its JSON as stored) in
    `envelope` (a `SignatureEnvelope`, its JSON, or None when there is none), checked
    against `trusted`. `role`: the role the caller is about to act on (approve,
    resolve, sweeper, cap); the decision must need that one (by default, whichever it
    needs). Returns the key, whose `identity` is who decided (the two-person rule counts
    distinct identities). Raises `DecisionRefused` naming the request, key or cap and
    what failed (its `reason` is one of `REASONS`), and `SigningConfigurationError` if a
    trusted keys file changed and no longer passes."""
    if not isinstance(decision, Decision):
        try:
            decision = Decision.from_json(decision)
        except (ValueError, TypeError) as exc:
            subject = _subject_of(decision)
            raise DecisionRefused(
                subject, "malformed", f"the decision cannot be read: {exc}"
            ) from None
    subject, kind = decision.subject, decision.kind

    def refuse(reason: str, detail: str, key: str | None = None) -> DecisionRefused:
        return DecisionRefused(subject, reason, detail, kind=kind, key_id=key)

    if envelope is None:
        raise refuse("unsigned", "it carries no signature, and trusted keys are configured")
    if not isinstance(envelope, SignatureEnvelope):
        try:
            envelope = SignatureEnvelope.from_json(envelope)
        except (ValueError, TypeError) as exc:
            raise refuse("malformed", f"its signature cannot be read: {exc}") from None
    key_id = envelope.key_id
    key = trusted.get(key_id)
    if key is None:
        raise refuse(
            "untrusted-key",
            f"it is signed by key {key_id}, which is not among the trusted keys "
            f"({trusted.path or 'the lines configured'})",
            key_id,
        )
    if key.algorithm != envelope.algorithm:
        raise refuse(
            "algorithm", f"the signature is {envelope.algorithm}, the key {key.algorithm}", key_id
        )
    needed = decision.role
    if role is not None and role != needed:
        raise refuse(
            "kind", f"a {kind} decision made via {decision.via} is not a {role} decision", key_id
        )
    if needed not in key.roles:
        raise refuse(
            "role",
            f"key {key_id} of {key.identity} ({key.source}) is trusted for "
            f"{', '.join(sorted(key.roles))}, not {needed}",
            key_id,
        )
    if decision.by != key.identity:
        raise refuse(
            "identity",
            f"the decision names {decision.by!r}, but key {key_id} belongs to {key.identity!r}",
            key_id,
        )
    if key.algorithm == "ed25519":
        try:
            key.verifier.verify(envelope.signature, decision.canonical())
        except InvalidSignature:
            raise refuse(
                "signature",
                f"the signature by key {key_id} of {key.identity} does not verify over this "
                "decision (it was made for other bytes, or altered)",
                key_id,
            ) from None
    else:
        verify_assertion(kind, subject, decision.challenge(), key, envelope)
    return key


def _subject_of(doc: Any) -> str:
    """What a decision that cannot be read was for, as far as it says."""
    if isinstance(doc, Mapping):
        for name, label in (("request", "approval request"), ("key", "idempotency key")):
            value = doc.get(name)
            if isinstance(value, str):
                return f"{label} {value!r:.200}" if name == "key" else f"{label} {value:.40}"
    return "an unreadable decision"
