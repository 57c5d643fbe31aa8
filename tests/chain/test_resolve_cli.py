"""`crewai-idempotent resolve --key FILE` (or $CREWAI_IDEMPOTENCY_SIGNING_KEY) signs the
resolution; with $CREWAI_IDEMPOTENCY_TRUSTED_KEYS set, one those keys would refuse is
refused before anything is written; and the command a refused resolution's error names,
pasted with its placeholders filled in, settles the record so that the next call runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from crewai_idempotent import DecisionRefused, Ledger, OutcomeUnknown, SQLiteCacheBackend, Status
from crewai_idempotent.cli import main as cli
from crewai_idempotent.signing import Signer, TrustedKeys


def unknown() -> None:
    raise OutcomeUnknown("the provider timed out")


@pytest.fixture
def alice(tmp_path: Path) -> Signer:
    return Signer.create(tmp_path / "alice.key", identity="alice@example.com", roles=["resolve"])


@pytest.fixture
def trusted(tmp_path: Path, alice: Signer) -> Path:
    path = tmp_path / "trusted_keys"
    path.write_text(alice.trusted_line() + "\n")
    path.chmod(0o644)
    return path


def test_resolve_signs_with_key_or_the_environment_and_refuses_what_workers_would(
    tmp_path: Path, alice: Signer, trusted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = Ledger(SQLiteCacheBackend(tmp_path / "ledger.db"))
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    for key in ("pay:1", "pay:2", "pay:3"):
        with pytest.raises(OutcomeUnknown):
            ledger.run(key, unknown)
    runner = CliRunner()
    base = ["--ledger", url, "resolve"]
    monkeypatch.setenv("CREWAI_IDEMPOTENCY_TRUSTED_KEYS", str(trusted))
    refused = runner.invoke(cli, [*base, "pay:1", "--absent", "--reason", "none"])
    assert refused.exit_code == 1
    assert "trusts only signed resolutions" in refused.output
    assert ledger.get("pay:1").status is Status.UNCERTAIN  # type: ignore[union-attr]
    bob = Signer.create(tmp_path / "bob.key", identity="bob@example.com")
    refused = runner.invoke(
        cli, [*base, "pay:1", "--absent", "--reason", "x", "--key", str(bob.path)]
    )
    assert refused.exit_code == 1 and "(untrusted-key)" in refused.output

    signed = runner.invoke(
        cli, [*base, "pay:1", "--absent", "--reason", "none", "--key", str(alice.path)]
    )
    assert signed.exit_code == 0, signed.output
    assert "signed by alice@example.com" in signed.output
    monkeypatch.setenv("CREWAI_IDEMPOTENCY_SIGNING_KEY", str(alice.path))
    signed = runner.invoke(
        cli, [*base, "pay:2", "--happened", "--result-text", "ch_2", "--reason", "seen"]
    )
    assert signed.exit_code == 0, signed.output
    ledger.trusted_keys = TrustedKeys.from_file(trusted)
    assert ledger.run("pay:1", lambda: "ran") == "ran"
    assert ledger.run("pay:2", lambda: "never") == "ch_2"
    missing = str(tmp_path / "missing.key")
    bad = runner.invoke(cli, [*base, "pay:3", "--absent", "--reason", "x", "--key", missing])
    assert bad.exit_code == 1 and "signing key file" in bad.output, bad.output
    bad = runner.invoke(cli, [*base, "pay:3", "--absent", "--reason", "x", "--key", str(tmp_path)])
    assert bad.exit_code == 1 and "Is a directory" in bad.output, bad.output
    ledger.close()


def test_the_command_a_refusal_names_settles_the_record_when_pasted(
    tmp_path: Path, alice: Signer, trusted: Path
) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger(SQLiteCacheBackend(path))
    with pytest.raises(OutcomeUnknown):
        ledger.run("pay:1", unknown)
    ledger.resolve("pay:1", absent=True, reason="unsigned, before signing was on")
    ledger.trusted_keys = TrustedKeys.from_file(trusted)
    with pytest.raises(DecisionRefused) as refused:
        ledger.run("pay:1", lambda: "ran")
    (hint,) = re.findall(r"`(crewai-idempotent [^`]+)`", str(refused.value))
    assert f"--ledger sqlite:///{path}" in hint
    pasted = hint.replace("--happened/--absent", "--absent").replace("TEXT", "'no charge'")
    pasted = pasted.replace("FILE", shlex.quote(str(alice.path)))
    result = CliRunner().invoke(cli, shlex.split(pasted)[1:], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert ledger.run("pay:1", lambda: "ran") == "ran"
    ledger.close()


def test_reconcile_signs_its_settlements_with_signing_key_and_without_one_leaves_absent_open(
    tmp_path: Path, trusted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.support.reconcile import uncertain

    sweeper = Signer.create(tmp_path / "sweeper.key", identity="payments-sweeper",
                            roles=["sweeper"])  # fmt: skip
    trusted.write_text(trusted.read_text() + sweeper.trusted_line() + "\n")
    ledger = Ledger(SQLiteCacheBackend(tmp_path / "ledger.db"))
    uncertain(ledger, "pay:1", {"answer": "absent"})
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("CREWAI_IDEMPOTENCY_TRUSTED_KEYS", str(trusted))
    monkeypatch.delenv("CREWAI_IDEMPOTENCY_SIGNING_KEY", raising=False)
    sweep = ["--ledger", url, "reconcile", "--import", "tests.support.reconcile",
             "--no-entry-points", "--backoff", "0s"]  # fmt: skip
    unsigned = CliRunner().invoke(cli, sweep)
    assert unsigned.exit_code == 0, unsigned.output
    assert "this sweeper has no signing key" in unsigned.output
    assert ledger.get("pay:1").status is Status.UNCERTAIN  # type: ignore[union-attr]

    signed = CliRunner().invoke(cli, [*sweep, "--signing-key", str(tmp_path / "sweeper.key")])
    assert signed.exit_code == 0, signed.output
    record = ledger.get("pay:1")
    assert record is not None and record.status is Status.FAILED
    assert record.resolution is not None and record.resolution[1]["by"] == "payments-sweeper"
    ledger.trusted_keys = TrustedKeys.load(trusted)
    assert ledger.run("pay:1", lambda: "ran", fingerprint="fp") == "ran"
    ledger.close()
