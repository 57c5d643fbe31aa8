"""Trusted keys: parsed strictly where they are configured, and read again when their
file changes, so that a removed key stops at the next use."""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import pytest

from crewai_idempotent import (
    DecisionRefused,
    LedgerConfigurationError,
    SigningConfigurationError,
)
from crewai_idempotent.signing import ENV, Signer, TrustedKeys, verify
from tests.signing.conftest import approval, write_trusted
from tests.support.unprivileged import NOBODY, in_child, reachable

OTHER_USER = 12345
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand files to others")
KEY = base64.b64encode(bytes(range(32))).decode()  # any 32 bytes are an Ed25519 public key


def test_lines_parse_with_comments_roles_and_identities(alice: Signer, bob: Signer) -> None:
    trusted = TrustedKeys.from_lines(
        f"""
        # operators
        {alice.trusted_line()}   # alice's laptop
        {bob.trusted_line()}
        sweeper,resolve ed25519 {KEY} payments-sweeper
        """
    )
    assert len(trusted) == 3
    key = trusted.get(alice.key_id)
    assert key is not None and key.identity == "alice@example.com"
    assert key.roles == {"approve", "resolve"} and key.algorithm == "ed25519"
    assert key.line() == alice.trusted_line()
    assert trusted.identities() == {"alice@example.com", "bob@example.com", "payments-sweeper"}
    assert trusted.identities("approve") == {"alice@example.com", "bob@example.com"}
    assert trusted.get("SHA256:nobody") is None


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (f"approve rsa {KEY} alice", "unknown algorithm 'rsa'; trusted keys are ed25519 or"),
        (f"approve,admin ed25519 {KEY} alice", "unknown role 'admin'"),
        (f"approve, ed25519 {KEY} alice", "unknown role ''"),
        (f"approve ed25519 {KEY}", "this one has 3 fields"),
        ("approve ed25519 not-base64! alice", "not an Ed25519 key in base64"),
        (f"approve ed25519 {base64.b64encode(bytes(31)).decode()} alice", "31 bytes, not the 32"),
        (f"approve ed25519 {KEY} alice expiry=2027", "unknown option 'expiry=2027'"),
        (f"approve ed25519 {KEY} #alice", "this one has 3 fields"),
    ],
)  # fmt: skip
def test_a_line_that_does_not_parse_is_an_error_naming_file_and_line(
    tmp_path: Path, line: str, message: str
) -> None:
    path = write_trusted(tmp_path / "trusted_keys", "# ok", f"approve ed25519 {KEY} carol", line)
    with pytest.raises(SigningConfigurationError, match=message) as caught:
        TrustedKeys.from_file(path)
    assert f"trusted keys file {path} line 3" in str(caught.value)
    # A configuration error like any other: the guard halts the kickoff on it.
    assert isinstance(caught.value, LedgerConfigurationError)
    with pytest.raises(SigningConfigurationError, match="trusted keys given to configure"):
        TrustedKeys.load([line])


def test_a_key_listed_twice_or_no_key_at_all_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        SigningConfigurationError, match=r"line 2: the same ed25519 key as .* line 1"
    ):
        TrustedKeys.from_lines([f"approve ed25519 {KEY} alice", f"resolve ed25519 {KEY} bob"])
    path = write_trusted(tmp_path / "empty", "# nobody yet", "")
    with pytest.raises(SigningConfigurationError, match="holds no trusted key"):
        TrustedKeys.from_file(path)
    with pytest.raises(SigningConfigurationError, match="does not exist"):
        TrustedKeys.from_file(tmp_path / "missing")
    (tmp_path / "binary").write_bytes(b"\xff\xfe approve")
    with pytest.raises(SigningConfigurationError, match="is not UTF-8"):
        TrustedKeys.from_file(tmp_path / "binary")


def test_load_takes_a_path_lines_or_trusted_keys(tmp_path: Path, alice: Signer) -> None:
    path = write_trusted(tmp_path / "trusted_keys", alice.trusted_line())
    assert TrustedKeys.load(path).path == path
    assert TrustedKeys.load(str(path)).get(alice.key_id) is not None
    assert TrustedKeys.load([alice.trusted_line()]).path is None
    assert len(TrustedKeys.load(f"# alice\n{alice.trusted_line()}\n")) == 1
    same = TrustedKeys.load(path)
    assert TrustedKeys.load(same) is same
    with pytest.raises(TypeError, match="not int"):
        TrustedKeys.load(3)  # type: ignore[arg-type]


def test_the_environment_names_the_file(tmp_path: Path, alice: Signer) -> None:
    path = write_trusted(tmp_path / "trusted_keys", alice.trusted_line())
    assert TrustedKeys.from_env({}) is None and TrustedKeys.from_env({ENV: " "}) is None
    trusted = TrustedKeys.from_env({ENV: str(path)})
    assert trusted is not None and trusted.get(alice.key_id) is not None
    with pytest.raises(SigningConfigurationError, match=f"\\${ENV}: trusted keys file .* does"):
        TrustedKeys.from_env({ENV: str(tmp_path / "typo")})


# -- a file another user could change ----------------------------------------------------


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
def test_a_trusted_file_others_may_write_is_refused(
    tmp_path: Path, alice: Signer, mode: int
) -> None:
    path = write_trusted(tmp_path / "trusted_keys", alice.trusted_line())
    path.chmod(mode)
    with pytest.raises(SigningConfigurationError, match="writable by group or others") as caught:
        TrustedKeys.from_file(path)
    assert f"`chmod go-w {path}`" in str(caught.value)


def test_a_trusted_file_in_a_folder_others_may_write_is_refused(
    tmp_path: Path, alice: Signer
) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    path = write_trusted(folder / "trusted_keys", alice.trusted_line())
    folder.chmod(0o777)
    with pytest.raises(SigningConfigurationError, match="in a folder another user could change"):
        TrustedKeys.from_file(path)
    folder.chmod(0o1777)  # sticky, as /tmp: no one else can replace this user's file
    assert len(TrustedKeys.from_file(path)) == 1


def test_a_symlink_is_followed_and_its_target_checked(tmp_path: Path, alice: Signer) -> None:
    # A Kubernetes config map: the file is a symlink into a folder that is swapped.
    data = tmp_path / "..data"
    data.mkdir()
    real = write_trusted(data / "trusted_keys", alice.trusted_line())
    link = tmp_path / "trusted_keys"
    link.symlink_to(real)
    trusted = TrustedKeys.from_file(link)
    assert trusted.get(alice.key_id) is not None
    real.chmod(0o666)
    with pytest.raises(SigningConfigurationError, match="writable by group or others"):
        trusted.get(alice.key_id)


@needs_root
def test_a_trusted_file_another_user_owns_is_refused(tmp_path: Path, alice: Signer) -> None:
    path = write_trusted(tmp_path / "trusted_keys", alice.trusted_line())
    os.chown(path, OTHER_USER, OTHER_USER)
    with pytest.raises(SigningConfigurationError, match=f"owned by uid {OTHER_USER}"):
        TrustedKeys.from_file(path)


def test_as_an_unprivileged_user_a_file_another_user_can_write_is_refused(
    tmp_path: Path, alice: Signer
) -> None:
    # Root ignores modes; the worker that reads the file is an ordinary user.
    folder = reachable(tmp_path, "etc") if os.geteuid() == 0 else tmp_path
    path = write_trusted(folder / "trusted_keys", alice.trusted_line())
    line = alice.trusted_line()

    def load() -> int:
        return len(TrustedKeys.from_file(path))

    assert in_child(load, unprivileged=True) == {"value": 1}  # root's 0644 file: trusted
    path.chmod(0o646)  # anyone may write it
    refused = in_child(load, unprivileged=True)
    assert refused["error"] == "SigningConfigurationError"
    assert "writable by group or others" in refused["message"]
    if os.geteuid() == 0:
        path.chmod(0o644)
        os.chown(path, OTHER_USER, OTHER_USER)  # neither root nor the worker: another user
        refused = in_child(load, unprivileged=True)
        assert f"owned by uid {OTHER_USER}" in refused["message"]
        os.chown(path, NOBODY, NOBODY)  # the worker's own
        assert in_child(load, unprivileged=True) == {"value": 1}
    assert line in path.read_text()


# -- rotation and removal ----------------------------------------------------------------


def test_rotation_two_keys_for_one_identity_then_one_removed(tmp_path: Path) -> None:
    old = Signer.create(tmp_path / "old.key", identity="alice@example.com")
    new = Signer.create(tmp_path / "new.key", identity="alice@example.com")
    path = write_trusted(tmp_path / "trusted_keys", old.trusted_line(), new.trusted_line())
    trusted = TrustedKeys.from_file(path)
    decision = approval()
    by_old, by_new = old.sign(decision), new.sign(decision)
    assert verify(decision, by_old, trusted).identity == "alice@example.com"
    assert verify(decision, by_new, trusted).identity == "alice@example.com"
    # One person with two keys is one identity: the two-person rule counts one.
    assert trusted.identities("approve") == {"alice@example.com"}

    write_trusted(path, "# alice's old key removed", new.trusted_line())
    with pytest.raises(DecisionRefused, match="not among the trusted keys") as caught:
        verify(decision, by_old, trusted)
    assert caught.value.reason == "untrusted-key" and caught.value.key_id == old.key_id
    assert verify(decision, by_new, trusted).identity == "alice@example.com"


def test_a_change_within_the_times_resolution_is_seen_by_its_bytes(
    tmp_path: Path, alice: Signer, bob: Signer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A file rewritten within one tick of a coarse clock (or on a file system that keeps
    # whole seconds) keeps its size and times: the seam keeps only what such a file
    # system would change, inode and size.
    from crewai_idempotent.signing import _trusted

    monkeypatch.setattr(_trusted, "_signature", lambda st: (st.st_dev, st.st_ino, st.st_size))

    def line(signer: Signer) -> str:
        return f"approve ed25519 {base64.b64encode(signer.public_key).decode()} same-person"

    path = write_trusted(tmp_path / "trusted_keys", line(alice))
    trusted = TrustedKeys.from_file(path)
    assert [key.key_id for key in trusted] == [alice.key_id]
    with path.open("r+") as file:  # the same inode, the same size
        file.write(line(bob) + "\n")
    assert [key.key_id for key in trusted] == [bob.key_id]


def test_a_file_that_breaks_or_disappears_refuses_at_the_next_use(
    tmp_path: Path, alice: Signer
) -> None:
    path = write_trusted(tmp_path / "trusted_keys", alice.trusted_line())
    trusted = TrustedKeys.from_file(path)
    decision = approval()
    envelope = alice.sign(decision)
    write_trusted(path, alice.trusted_line(), "approve ed25519 garbage")
    with pytest.raises(SigningConfigurationError, match="line 2"):
        verify(decision, envelope, trusted)
    write_trusted(path, alice.trusted_line())  # fixed: trusted again
    assert verify(decision, envelope, trusted).key_id == alice.key_id
    path.unlink()
    with pytest.raises(SigningConfigurationError, match="cannot be read any more"):
        verify(decision, envelope, trusted)


def test_an_unchanged_file_is_not_read_again(
    tmp_path: Path, alice: Signer, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_trusted(tmp_path / "trusted_keys", alice.trusted_line())
    old = time.time() - 60
    os.utime(path, (old, old))  # older than the moment a change could hide in
    trusted = TrustedKeys.from_file(path)
    from crewai_idempotent.signing import _trusted

    reads: list[object] = []
    real = _trusted.read_checked
    monkeypatch.setattr(_trusted, "read_checked", lambda *a, **k: reads.append(a) or real(*a, **k))
    decision = approval()
    envelope = alice.sign(decision)
    for _ in range(50):
        verify(decision, envelope, trusted)
    assert reads == []
    os.utime(path, (old + 1, old + 1))
    verify(decision, envelope, trusted)
    assert len(reads) == 1
