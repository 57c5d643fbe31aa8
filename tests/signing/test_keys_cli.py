"""`crewai-idempotent keys new / show`: the key file made 0600, its trusted keys line
printed alone on standard output, pasted into a trusted keys file, and the hints run as
pasted."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from crewai_idempotent.cli import main
from crewai_idempotent.signing import Signer, TrustedKeys, verify
from tests.signing.conftest import approval, write_trusted


def _run(*argv: str) -> Result:
    return CliRunner().invoke(main, list(argv))


def test_keys_new_writes_the_key_and_prints_its_line_to_paste(tmp_path: Path) -> None:
    path = tmp_path / "alice.key"
    done = _run("keys", "new", str(path), "--identity", "alice@example.com")
    assert done.exit_code == 0, done.output
    line = done.stdout.strip()
    assert done.stdout == line + "\n"  # the line alone: `>> trusted_keys` appends just it
    assert re.fullmatch(r"approve,resolve ed25519 \S+ alice@example\.com", line)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    # Pasted into the workers' trusted keys file, it trusts the key in the file.
    trusted = TrustedKeys.from_file(write_trusted(tmp_path / "trusted_keys", "# ops", line))
    signer = Signer.from_file(path)
    decision = approval()
    assert verify(decision, signer.sign(decision), trusted).identity == "alice@example.com"
    # The hint prints the same line again, pasted as it is.
    (hint,) = re.findall(r"`(crewai-idempotent [^`]+)`", done.stderr)
    again = _run(*shlex.split(hint)[1:])
    assert again.exit_code == 0 and again.stdout == line + "\n"


def test_keys_new_with_roles_and_show_with_other_roles(tmp_path: Path) -> None:
    path = tmp_path / "sweeper key.pem"  # a space: the hint quotes it
    done = _run("keys", "new", str(path), "--identity", "sweeper-1", "--roles", "sweeper")
    assert done.exit_code == 0, done.output
    assert done.stdout.startswith("sweeper ed25519 ") and "sweeper-1" in done.stdout
    assert shlex.quote(str(path)) in done.stderr
    shown = _run("keys", "show", str(path), "--roles", "sweeper,resolve")
    assert shown.exit_code == 0 and shown.stdout.startswith("resolve,sweeper ed25519 ")


def test_keys_show_a_key_made_elsewhere(tmp_path: Path) -> None:
    path = tmp_path / "ops.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(path)], check=True)
    path.chmod(0o600)
    refused = _run("keys", "show", str(path))
    assert refused.exit_code == 1 and "names no identity" in refused.output
    done = _run("keys", "show", str(path), "--identity", "ops", "--roles", "approve")
    assert done.exit_code == 0 and done.stdout.startswith("approve ed25519 ")
    assert done.stdout.strip().endswith(" ops")


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["--roles", "approve,root"], 2, "unknown role 'root'"),
        (["--roles", ""], 2, "unknown role"),
        (["--identity", "alice smith"], 1, "identity must be 1-200 characters"),
    ],
)
def test_keys_new_refuses_bad_input(
    tmp_path: Path, argv: list[str], code: int, message: str
) -> None:
    args = ["keys", "new", str(tmp_path / "k.key"), "--identity", "alice", *argv]
    done = _run(*args)
    assert done.exit_code == code and message in done.output
    assert not (tmp_path / "k.key").exists()


def test_keys_new_never_overwrites_and_show_refuses_a_loose_file(tmp_path: Path) -> None:
    path = tmp_path / "alice.key"
    first = _run("keys", "new", str(path), "--identity", "alice")
    again = _run("keys", "new", str(path), "--identity", "mallory")
    assert again.exit_code == 1 and "a key is never overwritten" in again.output
    path.chmod(0o644)
    loose = _run("keys", "show", str(path))
    assert loose.exit_code == 1 and "group or others" in loose.output
    (fix,) = re.findall(r"`(chmod [^`]+)`", loose.output)
    subprocess.run(shlex.split(fix), check=True)  # the hint, run as pasted
    shown = _run("keys", "show", str(path))
    assert shown.exit_code == 0 and shown.stdout == first.stdout
    missing = _run("keys", "show", str(tmp_path / "nope.key"))
    assert missing.exit_code == 1 and "does not exist" in missing.output
