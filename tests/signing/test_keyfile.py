"""An operator's key file: made 0600, refused when loose or another user's, and read
back as the key, identity and roles it was made with."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from crewai_idempotent import SigningConfigurationError
from crewai_idempotent.signing import Signer, TrustedKeys, verify
from tests.signing.conftest import approval

OTHER_USER = 12345
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand files to others")


def _pem(key: object, password: bytes | None = None) -> bytes:
    encryption = (
        serialization.BestAvailableEncryption(password)
        if password
        else serialization.NoEncryption()
    )
    return key.private_bytes(  # type: ignore[attr-defined, no-any-return]
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
    )


def _private(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def test_a_new_key_file_is_0600_and_reads_back_the_same(tmp_path: Path) -> None:
    old = os.umask(0)  # the file's mode does not depend on the umask
    try:
        signer = Signer.create(tmp_path / "alice.key", identity="alice@example.com")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(signer.path).st_mode) == 0o600  # type: ignore[arg-type]
    again = Signer.from_file(tmp_path / "alice.key")
    assert (again.identity, again.key_id, again.roles) == (
        signer.identity, signer.key_id, {"approve", "resolve"}
    )  # fmt: skip
    assert again.trusted_line() == signer.trusted_line()
    assert "PRIVATE" not in repr(again) and "alice@example.com" in repr(again)
    # The file is PKCS #8 PEM any tool reads.
    text = (tmp_path / "alice.key").read_text()
    block = text[text.index("-----BEGIN") :]
    loaded = serialization.load_pem_private_key(block.encode(), None)
    assert isinstance(loaded, ed25519.Ed25519PrivateKey)


def test_a_key_is_never_overwritten(tmp_path: Path) -> None:
    first = Signer.create(tmp_path / "alice.key", identity="alice")
    with pytest.raises(
        SigningConfigurationError, match="exists already: a key is never overwritten"
    ):
        Signer.create(tmp_path / "alice.key", identity="alice")
    assert Signer.from_file(tmp_path / "alice.key").key_id == first.key_id
    with pytest.raises(SigningConfigurationError, match="does not exist"):
        Signer.create(tmp_path / "no" / "such" / "folder.key", identity="alice")


def test_a_key_made_by_openssl_is_used_with_an_identity(tmp_path: Path) -> None:
    path = tmp_path / "ops.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(path)], check=True)
    path.chmod(0o600)
    with pytest.raises(SigningConfigurationError, match="names no identity"):
        Signer.from_file(path)
    signer = Signer.from_file(path, identity="ops@example.com")
    with pytest.raises(SigningConfigurationError, match="names no roles"):
        signer.trusted_line()
    trusted = TrustedKeys.from_lines([signer.trusted_line(["approve"])])
    decision = approval(by="ops@example.com")
    assert verify(decision, signer.sign(decision), trusted).identity == "ops@example.com"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o606, 0o610])
def test_a_key_file_group_or_others_may_touch_is_refused(tmp_path: Path, mode: int) -> None:
    signer = Signer.create(tmp_path / "alice.key", identity="alice")
    assert signer.path is not None
    signer.path.chmod(mode)
    with pytest.raises(SigningConfigurationError, match="group or others") as caught:
        Signer.from_file(signer.path)
    assert f"`chmod 600 {signer.path}`" in str(caught.value) or "writable" in str(caught.value)


@needs_root
def test_a_key_file_another_user_owns_is_refused(tmp_path: Path) -> None:
    signer = Signer.create(tmp_path / "alice.key", identity="alice")
    assert signer.path is not None
    os.chown(signer.path, OTHER_USER, OTHER_USER)
    with pytest.raises(SigningConfigurationError, match=f"owned by uid {OTHER_USER}"):
        Signer.from_file(signer.path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "holds no -----BEGIN PRIVATE KEY----- block"),
        (b"hello\n", "line 1: expected comments and then -----BEGIN PRIVATE KEY-----"),
        (b"\xff\xfe\x00", "is not a PEM file"),
        (b"-----BEGIN PRIVATE KEY-----\nAAAA\n", "has no -----END PRIVATE KEY----- line"),
        (
            b"# identity: alice\n-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
            "holds no private key PEM can read",
        ),
        (b"# identity: alice smith\n", "no -----BEGIN"),
        (b"-----BEGIN OPENSSH PRIVATE KEY-----\n", "holds a block of OPENSSH PRIVATE KEY, not an"),
    ],
)
def test_a_malformed_key_file_is_a_clear_error(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = _private(tmp_path / "bad.key", content)
    with pytest.raises(SigningConfigurationError, match=message) as caught:
        Signer.from_file(path)
    assert str(path) in str(caught.value)


def test_a_key_that_is_not_ed25519_or_is_encrypted_is_refused(tmp_path: Path) -> None:
    ecdsa = _private(
        tmp_path / "ec.key", b"# identity: alice\n" + _pem(ec.generate_private_key(ec.SECP256R1()))
    )
    with pytest.raises(SigningConfigurationError, match="not an Ed25519 key"):
        Signer.from_file(ecdsa)
    key = ed25519.Ed25519PrivateKey.generate()
    locked = _private(tmp_path / "locked.key", b"# identity: alice\n" + _pem(key, b"secret"))
    with pytest.raises(SigningConfigurationError, match="holds an encrypted key"):
        Signer.from_file(locked)


def test_identity_and_roles_in_the_file_are_checked(tmp_path: Path) -> None:
    pem = _pem(ed25519.Ed25519PrivateKey.generate())
    path = _private(tmp_path / "k.key", b"# identity: alice\n# roles: approve,root\n" + pem)
    with pytest.raises(SigningConfigurationError, match="unknown role 'root'"):
        Signer.from_file(path)
    path = _private(tmp_path / "k2.key", b"# identity: alice\n" + pem)
    with pytest.raises(SigningConfigurationError, match="belongs to 'alice', not 'bob'"):
        Signer.from_file(path, identity="bob")
    with pytest.raises(SigningConfigurationError, match="identity must be 1-200 characters"):
        Signer.create(tmp_path / "k3.key", identity="alice smith")
    assert not (tmp_path / "k3.key").exists()


def test_a_signer_signs_only_its_own_identity(alice: Signer) -> None:
    with pytest.raises(ValueError, match=r"signs as 'alice@example\.com'"):
        alice.sign(approval(by="bob@example.com"))
