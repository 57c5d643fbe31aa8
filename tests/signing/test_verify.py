"""verify(): a decision is obeyed only when a trusted key with the role it needs signed
exactly it; every other case is refused, naming what it was for and what failed."""

from __future__ import annotations

import base64
import dataclasses
import pickle
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import crewai_idempotent
from crewai_idempotent import DecisionRefused, IdempotencyError, SigningConfigurationError
from crewai_idempotent.signing import (
    REASONS,
    Decision,
    SignatureEnvelope,
    Signer,
    TrustedKeys,
    receipt_digest,
    verify,
)
from tests.signing.conftest import AT, CALL, REQUEST, approval


@pytest.fixture
def sweeper(tmp_path: Path) -> Signer:
    return Signer.create(tmp_path / "sweeper.key", identity="sweeper-1", roles=["sweeper"])


@pytest.fixture
def trusted(alice: Signer, bob: Signer, sweeper: Signer) -> TrustedKeys:
    return TrustedKeys.from_lines(
        [alice.trusted_line(), bob.trusted_line(), sweeper.trusted_line()]
    )


def _refused(
    decision: object, envelope: object, trusted: TrustedKeys, **kw: object
) -> DecisionRefused:
    with pytest.raises(DecisionRefused) as caught:
        verify(decision, envelope, trusted, **kw)  # type: ignore[arg-type]
    assert caught.value.reason in REASONS
    return caught.value


def test_every_kind_round_trips_through_its_stored_form(
    alice: Signer, sweeper: Signer, trusted: TrustedKeys
) -> None:
    made = [
        (alice, approval()),
        (alice, Decision.denial(request=REQUEST, round=1, key=CALL, fingerprint="f" * 64,
                                by=alice.identity, via="console", at=AT)),
        (alice, Decision.found(key=CALL, token=4, receipt=receipt_digest({"id": "ch_1"}),
                               by=alice.identity, via="cli", at=AT)),
        (alice, Decision.absent(key=CALL, token=4, by=alice.identity, via="api", at=AT)),
        (sweeper, Decision.absent(key=CALL, token=4, by=sweeper.identity, via="sweeper", at=AT)),
    ]  # fmt: skip
    for signer, decision in made:
        envelope = signer.sign(decision)
        stored = (decision.to_json(), envelope.to_json())  # what the ledger keeps
        key = verify(*stored, trusted)
        assert key.identity == signer.identity and key.key_id == signer.key_id
        assert verify(decision, envelope, trusted, decision.role) == key
        assert SignatureEnvelope.from_json(envelope.to_json()) == envelope


def test_unsigned_is_refused_naming_the_request(trusted: TrustedKeys) -> None:
    refused = _refused(approval(), None, trusted)
    assert refused.reason == "unsigned" and refused.subject == f"approval request {REQUEST}"
    assert REQUEST in str(refused) and "carries no signature" in str(refused)
    absent = Decision.absent(key=CALL, token=4, by="alice@example.com", via="cli", at=AT)
    refused = _refused(absent, None, trusted)
    assert refused.subject == f"idempotency key {CALL!r}" and refused.kind == "resolve-absent"


@pytest.mark.parametrize(
    "change",
    [
        {"round": 2}, {"until": AT + 7200}, {"fingerprint": "e" * 64}, {"key": "pay:other"},
        {"request": "ap_" + "9" * 20}, {"via": "console"}, {"reason": "edited"},
    ],
)  # fmt: skip
def test_a_signature_over_other_bytes_does_not_verify(
    alice: Signer, trusted: TrustedKeys, change: dict[str, object]
) -> None:
    envelope = alice.sign(approval())
    edited = dataclasses.replace(approval(), **change)
    refused = _refused(edited, envelope, trusted)
    assert refused.reason == "signature" and refused.key_id == alice.key_id
    assert "does not verify" in str(refused)


def test_a_tampered_signature_does_not_verify(alice: Signer, trusted: TrustedKeys) -> None:
    envelope = alice.sign(approval())
    flipped = bytes([envelope.signature[0] ^ 1]) + envelope.signature[1:]
    refused = _refused(approval(), dataclasses.replace(envelope, signature=flipped), trusted)
    assert refused.reason == "signature"


def test_a_key_that_is_not_trusted_is_refused(tmp_path: Path, trusted: TrustedKeys) -> None:
    mallory = Signer.create(tmp_path / "m.key", identity="alice@example.com")
    refused = _refused(approval(), mallory.sign(approval()), trusted)
    assert refused.reason == "untrusted-key" and refused.key_id == mallory.key_id
    assert mallory.key_id in str(refused) and "not among the trusted keys" in str(refused)


def test_a_key_without_the_role_is_refused(
    bob: Signer, sweeper: Signer, alice: Signer, trusted: TrustedKeys
) -> None:
    # bob approves only: he cannot settle an uncertain charge.
    absent = Decision.absent(key=CALL, token=4, by=bob.identity, via="cli", at=AT)
    refused = _refused(absent, bob.sign(absent), trusted)
    assert refused.reason == "role" and "trusted for approve, not resolve" in str(refused)
    # The sweeper's key settles only as a sweeper, never as an operator...
    as_operator = Decision.absent(key=CALL, token=4, by=sweeper.identity, via="cli", at=AT)
    assert _refused(as_operator, sweeper.sign(as_operator), trusted).reason == "role"
    # ... and an operator's key does not sign a sweeper's settlements unless its line says so.
    as_sweeper = Decision.absent(key=CALL, token=4, by=alice.identity, via="sweeper", at=AT)
    refused = _refused(as_sweeper, alice.sign(as_sweeper), trusted)
    assert refused.reason == "role" and "not sweeper" in str(refused)
    cap = Decision.cap_change(cap="total-EUR", limit=1, currency="EUR", by=alice.identity,
                              via="cli", at=AT)  # fmt: skip
    assert _refused(cap, alice.sign(cap), trusted).reason == "role"


def test_the_caller_s_role_must_be_the_decision_s(alice: Signer, trusted: TrustedKeys) -> None:
    absent = Decision.absent(key=CALL, token=4, by=alice.identity, via="cli", at=AT)
    refused = _refused(absent, alice.sign(absent), trusted, role="approve")
    assert refused.reason == "kind" and "is not a approve decision" in str(refused)


def test_a_decision_naming_another_identity_is_refused(tmp_path: Path) -> None:
    # Whoever holds bob's key file cannot pass a decision off as alice's (the two-person
    # rule would otherwise count one person twice). Signer refuses to make the signature:
    # the key's holder makes it with the key itself.
    bob = Signer.create(tmp_path / "bob.key", identity="bob@example.com")
    trusted = TrustedKeys.from_lines([bob.trusted_line()])
    text = (tmp_path / "bob.key").read_text()
    key = serialization.load_pem_private_key(text[text.index("-----BEGIN") :].encode(), None)
    assert isinstance(key, Ed25519PrivateKey)
    forged = approval(by="alice@example.com")
    envelope = SignatureEnvelope("ed25519", bob.key_id, key.sign(forged.canonical()))
    refused = _refused(forged, envelope, trusted)
    assert refused.reason == "identity" and "belongs to 'bob@example.com'" in str(refused)


def test_a_malformed_decision_or_envelope_is_refused(alice: Signer, trusted: TrustedKeys) -> None:
    envelope = alice.sign(approval()).to_json()
    doc = approval().to_json()
    doc["round"] = "1"
    refused = _refused(doc, envelope, trusted)
    assert refused.reason == "malformed" and REQUEST in refused.subject
    for bad in (
        {**envelope, "sig": "not base64!"}, {**envelope, "v": 2}, {**envelope, "alg": "rsa"},
        {k: v for k, v in envelope.items() if k != "key"}, {**envelope, "extra": 1}, [1],
        {**envelope, "credential_id": "AAAA"},
    ):  # fmt: skip
        assert _refused(approval(), bad, trusted).reason == "malformed", bad


def test_an_envelope_claiming_another_algorithm_is_refused(
    alice: Signer, trusted: TrustedKeys
) -> None:
    envelope = alice.sign(approval())
    claimed = SignatureEnvelope("webauthn", alice.key_id, envelope.signature, b"a", b"{}", b"c")
    assert _refused(approval(), claimed, trusted).reason == "algorithm"


def test_both_errors_are_exported_and_pickle() -> None:
    refused = DecisionRefused(
        f"approval request {REQUEST}", "untrusted-key", "who?", kind="approve", key_id="SHA256:x"
    )
    copy = pickle.loads(pickle.dumps(refused))
    assert (copy.subject, copy.reason, copy.kind, copy.key_id) == (
        refused.subject, "untrusted-key", "approve", "SHA256:x"
    )  # fmt: skip
    assert str(copy) == str(refused) and isinstance(copy, IdempotencyError)
    config = SigningConfigurationError("trusted keys file /etc/k line 3: unknown role 'x'")
    assert str(pickle.loads(pickle.dumps(config))) == str(config)
    for name in ("DecisionRefused", "SigningConfigurationError"):
        assert name in crewai_idempotent.__all__


def test_the_public_names_say_what_their_parameters_are_and_what_they_raise() -> None:
    # tests/project/test_public_docs.py's rule, for the signing package's face.
    from crewai_idempotent import signing
    from tests.project.test_public_docs import _doc, _parameters

    checked = 0
    for name in signing.__all__:
        value = getattr(signing, name)
        if not callable(value):
            continue
        members = [(name, value)]
        if isinstance(value, type):
            members += [
                (f"{name}.{m}", getattr(value, m))
                for m, fn in vars(value).items()
                if not m.startswith("_") and (callable(fn) or isinstance(fn, classmethod))
            ]
        for where, fn in members:
            doc = _doc(fn)
            assert doc, f"{where} has no docstring"
            unnamed = [p for p in _parameters(where, fn) if f"`{p}" not in doc]
            assert not unnamed, f"{where}'s docstring does not name {unnamed}"
            assert "raise" in doc.lower(), f"{where}'s docstring does not say what it raises"
            checked += 1
    assert checked > 20


def test_keys_given_as_lines_are_never_a_file(alice: Signer) -> None:
    line = alice.trusted_line()
    trusted = TrustedKeys.from_lines(line)
    assert trusted.path is None and len(trusted) == 1
    with pytest.raises(SigningConfigurationError, match="line 1"):
        TrustedKeys.from_lines([line.replace("ed25519", "ed448")])
    assert base64.b64decode(line.split()[2]) == alice.public_key


def test_importing_signing_loads_no_crypto_and_ed25519_keys_load_no_webauthn(
    tmp_path: Path, alice: Signer
) -> None:
    import subprocess
    import sys

    path = tmp_path / "trusted_keys"
    path.write_text(alice.trusted_line() + "\n")
    probe = (
        "import sys\n"
        "import crewai_idempotent.signing as s\n"
        "before = sorted(m for m in ('cryptography', 'webauthn') if m in sys.modules)\n"
        f"s.TrustedKeys.from_file({str(path)!r})\n"
        "after = sorted(m for m in ('cryptography', 'webauthn') if m in sys.modules)\n"
        "print(before, after)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[] ['cryptography']", done.stdout + done.stderr
