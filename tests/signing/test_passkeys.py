"""Passkeys: an approver's authenticator signs the challenge of one exact decision. An
assertion made here by a software authenticator (an ES256 key, authenticatorData and
clientDataJSON built as a browser builds them) verifies for its decision and is refused
for any other, from another origin, or for another relying party."""

from __future__ import annotations

import builtins
import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import DecisionRefused, SigningConfigurationError
from crewai_idempotent.signing import (
    SignatureEnvelope,
    Signer,
    TrustedKeys,
    passkey_key_id,
    passkey_line,
    verify,
)
from tests.signing.authenticator import UP, UV, Authenticator, b64url
from tests.signing.conftest import approval, write_trusted

ORIGIN = "https://console.example.com"


@pytest.fixture
def passkey() -> Authenticator:
    return Authenticator("example.com")


@pytest.fixture
def trusted(passkey: Authenticator) -> TrustedKeys:
    return TrustedKeys.from_lines([passkey.line("alice@example.com", origin=ORIGIN)])


def _envelope(assertion: dict[str, Any], passkey: Authenticator) -> SignatureEnvelope:
    return SignatureEnvelope.from_assertion(assertion, passkey_key_id(passkey.cose_key))


def _refused(decision: Any, envelope: Any, trusted: TrustedKeys) -> DecisionRefused:
    with pytest.raises(DecisionRefused) as caught:
        verify(decision, envelope, trusted)
    return caught.value


def test_an_assertion_over_the_decision_s_challenge_verifies(
    passkey: Authenticator, trusted: TrustedKeys
) -> None:
    decision = approval()
    assertion = passkey.get(decision.challenge(), ORIGIN)
    envelope = _envelope(assertion, passkey)
    # As stored in the ledger and read back on another worker.
    key = verify(decision.to_json(), envelope.to_json(), trusted)
    assert key.identity == "alice@example.com" and key.algorithm == "webauthn"
    assert trusted.by_credential(assertion["rawId"]) == key
    assert trusted.by_credential(passkey.credential_id) == key


def test_the_signature_counter_is_not_kept(passkey: Authenticator, trusted: TrustedKeys) -> None:
    # Stateless workers cannot keep the last count: a count of 0 (synced passkeys) and
    # one that went back both verify; the challenge binds the assertion to one decision.
    decision = approval()
    passkey.sign_count = 0
    zero = passkey.get(decision.challenge(), ORIGIN, count=False)
    assert verify(decision, _envelope(zero, passkey), trusted).identity == "alice@example.com"
    passkey.sign_count = 5
    five = passkey.get(decision.challenge(), ORIGIN, count=False)
    passkey.sign_count = 2
    two = passkey.get(decision.challenge(), ORIGIN, count=False)
    for assertion in (five, two):
        assert verify(decision, _envelope(assertion, passkey), trusted).key_id


def test_an_assertion_for_another_decision_is_refused(
    passkey: Authenticator, trusted: TrustedKeys
) -> None:
    # The console showed round 1; the passkey signed it; the decision presented is another
    # call, another round, a later deadline.
    signed = approval()
    envelope = _envelope(passkey.get(signed.challenge(), ORIGIN), passkey)
    for other in (
        approval(round=2),
        approval(key="pay:invoice-8"),
        approval(until=signed.until + 86_400),  # type: ignore[operator]
        approval(fingerprint="0" * 64),
    ):
        refused = _refused(other, envelope, trusted)
        assert refused.reason == "challenge", other
        assert "another decision's challenge" in str(refused) and "ap_1111" in str(refused)


def test_an_assertion_from_another_origin_is_refused(
    passkey: Authenticator, trusted: TrustedKeys
) -> None:
    decision = approval()
    assertion = passkey.get(decision.challenge(), "https://evil.example.com")
    refused = _refused(decision, _envelope(assertion, passkey), trusted)
    assert refused.reason == "origin" and "evil.example.com" in str(refused)


def test_an_assertion_for_another_relying_party_is_refused(
    passkey: Authenticator, trusted: TrustedKeys
) -> None:
    decision = approval()
    assertion = passkey.get(decision.challenge(), ORIGIN, rp_id="evil.example.net")
    refused = _refused(decision, _envelope(assertion, passkey), trusted)
    assert refused.reason == "rp-id" and "example.com" in str(refused)


def test_user_presence_and_when_asked_verification_are_required(passkey: Authenticator) -> None:
    trusted = TrustedKeys.from_lines([passkey.line("alice", origin=ORIGIN)])
    decision = approval(by="alice")
    absent = passkey.get(decision.challenge(), ORIGIN, flags=UV)
    assert _refused(decision, _envelope(absent, passkey), trusted).reason == "user-presence"
    present = passkey.get(decision.challenge(), ORIGIN, flags=UP)
    assert verify(decision, _envelope(present, passkey), trusted).identity == "alice"
    strict = TrustedKeys.from_lines([passkey.line("alice", origin=ORIGIN, uv="required")])
    refused = _refused(decision, _envelope(present, passkey), strict)
    assert refused.reason == "user-verification"


def test_a_forged_or_mismatched_assertion_is_refused(
    passkey: Authenticator, trusted: TrustedKeys
) -> None:
    decision = approval()
    good = _envelope(passkey.get(decision.challenge(), ORIGIN), passkey)
    flipped = bytes([good.signature[-1] ^ 1])
    broken = dataclasses.replace(good, signature=good.signature[:-1] + flipped)
    assert _refused(decision, broken, trusted).reason == "signature"
    # Another authenticator's signature, presented under the trusted key's id.
    other = Authenticator("example.com")
    other.credential_id = passkey.credential_id
    stolen = _envelope(other.get(decision.challenge(), ORIGIN), passkey)
    assert _refused(decision, stolen, trusted).reason == "signature"
    # The credential the envelope names is not the trusted line's.
    renamed = dataclasses.replace(good, credential_id=b"another credential")
    assert _refused(decision, renamed, trusted).reason == "credential"
    # A registration's client data is not an assertion's.
    created = passkey.get(decision.challenge(), ORIGIN, kind="webauthn.create")
    assert _refused(decision, _envelope(created, passkey), trusted).reason == "client-data"
    short = dataclasses.replace(good, authenticator_data=b"\x00" * 10)
    assert _refused(decision, short, trusted).reason == "client-data"


def test_the_same_passkey_counts_once_and_two_people_twice(tmp_path: Path) -> None:
    # Two passkeys of alice and one Ed25519 key of bob: three keys, two identities.
    laptop, phone = Authenticator("example.com"), Authenticator("example.com")
    bob = Signer.create(tmp_path / "bob.key", identity="bob", roles=["approve"])
    path = write_trusted(
        tmp_path / "trusted_keys",
        laptop.line("alice", origin=ORIGIN),
        phone.line("alice", origin=f"{ORIGIN},https://approvals.example.com"),
        bob.trusted_line(),
    )
    trusted = TrustedKeys.from_file(path)
    decision = approval(by="alice")
    signers = {
        verify(decision, _envelope(laptop.get(decision.challenge(), ORIGIN), laptop), trusted),
        verify(
            decision,
            _envelope(phone.get(decision.challenge(), "https://approvals.example.com"), phone),
            trusted,
        ),
    }
    assert len(signers) == 2 and {key.identity for key in signers} == {"alice"}
    by_bob = approval(by="bob")
    signers.add(verify(by_bob, bob.sign(by_bob), trusted))
    assert {key.identity for key in signers} == {"alice", "bob"}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"origin": "https://console.example.com/"}, "no path or trailing slash"),
        ({"origin": "http://console.example.com"}, "http only for localhost"),
        ({"origin": "https://console.example.com:443"}, "origin= is the console's origin"),
        ({"origin": "https://evil.example.net"}, "is not on the relying party example.com"),
        ({"rp": "https://example.com"}, "rp= is a relying party id"),
        ({"credential": "***"}, "credential= is the passkey's credential id"),
        ({"uv": "preferred"}, "uv= takes only `required`"),
    ],
)
def test_a_passkey_line_is_checked_where_it_is_read(
    passkey: Authenticator, options: dict[str, str], message: str
) -> None:
    line = passkey.line("alice", origin=ORIGIN)
    for name, value in options.items():
        words = [w for w in line.split() if not w.startswith(f"{name}=")]
        line = " ".join([*words, f"{name}={value}"])
    with pytest.raises(SigningConfigurationError, match=message):
        TrustedKeys.from_lines([line])


def test_a_passkey_line_needs_its_options_and_a_cose_key(passkey: Authenticator) -> None:
    bare = f"approve webauthn {b64url(passkey.cose_key)} alice"
    with pytest.raises(SigningConfigurationError, match="needs credential=, rp=, origin="):
        TrustedKeys.from_lines([bare])
    line = passkey.line("alice", origin=ORIGIN).replace(b64url(passkey.cose_key), "AAAA")
    with pytest.raises(SigningConfigurationError, match="not a COSE public key"):
        TrustedKeys.from_lines([line])
    # http on this machine is a secure context: a console tried locally.
    local = Authenticator("localhost")
    assert len(TrustedKeys.from_lines([local.line("a", origin="http://localhost:8765")])) == 1


def test_a_passkey_line_without_the_extra_is_a_configuration_error(
    passkey: Authenticator, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in [m for m in sys.modules if m == "webauthn" or m.startswith("webauthn.")]:
        monkeypatch.delitem(sys.modules, name)
    real_import = builtins.__import__

    def no_webauthn(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "webauthn" or name.startswith("webauthn."):
            raise ModuleNotFoundError(f"No module named {name!r}", name="webauthn")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_webauthn)
    path = write_trusted(tmp_path / "trusted_keys", passkey.line("alice", origin=ORIGIN))
    with pytest.raises(SigningConfigurationError) as caught:
        TrustedKeys.from_file(path)
    message = str(caught.value)
    assert f"{path} line 1" in message and "`passkeys` extra" in message
    assert "pip install 'crewai-idempotent[passkeys]'" in message
    # Ed25519 keys need no extra.
    key = Signer.create(tmp_path / "ops.key", identity="ops")
    assert len(TrustedKeys.from_lines([key.trusted_line()])) == 1


def test_a_registration_gives_the_line_that_verifies_its_assertions(
    passkey: Authenticator,
) -> None:
    challenge = b"registration challenge, 32 bytes"
    registration = passkey.create(challenge, ORIGIN)
    line = passkey_line(
        registration, challenge=challenge, rp_id="example.com", origin=ORIGIN,
        identity="alice@example.com", roles=["approve"],
    )  # fmt: skip
    assert line.startswith(f"approve webauthn {b64url(passkey.cose_key)} alice@example.com ")
    trusted = TrustedKeys.from_lines([line])
    decision = approval()
    envelope = _envelope(passkey.get(decision.challenge(), ORIGIN), passkey)
    assert verify(decision, envelope, trusted).identity == "alice@example.com"
    with pytest.raises(SigningConfigurationError, match="does not verify"):
        passkey_line(
            registration, challenge=b"another challenge", rp_id="example.com", origin=ORIGIN,
            identity="alice@example.com",
        )  # fmt: skip
