"""Turning signed decisions on: configure(trusted_keys=...), IdempotencyConfig, the
environment. Bad input is a `SigningConfigurationError` where it is given (configure(),
Crew(...), or the first guarded call for an environment nothing read before), never a
process that quietly runs unsigned; without trusted keys everything works as before.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from crewai import Crew
from crewai.tools import BaseTool, tool

from crewai_idempotent import (
    ApprovalRequired,
    Approvals,
    DecisionRefused,
    IdempotencyConfig,
    SigningConfigurationError,
    backend_from_url,
    configure,
)
from crewai_idempotent.integration import _ledgers
from crewai_idempotent.signing import TrustedKeys
from tests.signed_approvals.conftest import TRUSTED_ENV, Keys
from tests.support.crewai.provider import FakeProvider

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")

UNTIL_ENV = "CREWAI_IDEMPOTENCY_ACCEPT_UNSIGNED_GRANTS_UNTIL"
FAKE_KEY = "A" * 43 + "="  # 32 bytes of base64: an Ed25519 public key


def _file(path: Path, text: str, mode: int = 0o644) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def _bad_files(tmp_path: Path, keys: Keys) -> dict[str, tuple[Path, str]]:
    line = keys.alice.trusted_line()
    return {
        "malformed": (_file(tmp_path / "short", "approve ed25519\n"), "line 1: a trusted key line"),
        "loose": (_file(tmp_path / "loose", f"{line}\n", 0o666), "another user could change it"),
        "algorithm": (
            _file(tmp_path / "rsa", f"approve rsa {FAKE_KEY} alice\n"), "unknown algorithm 'rsa'"
        ),
        "not-text": (_binary(tmp_path / "binary"), "is not UTF-8 text"),
        "missing": (tmp_path / "nowhere", "does not exist"),
        "empty": (_file(tmp_path / "empty", "# nobody yet\n"), "holds no trusted key"),
    }  # fmt: skip


def _binary(path: Path) -> Path:
    path.write_bytes(b"\xff\xfe approve ed25519\n")
    path.chmod(0o644)
    return path


@pytest.mark.parametrize("case", ["malformed", "loose", "algorithm", "not-text", "missing",
                                  "empty"])  # fmt: skip
def test_trusted_keys_that_do_not_pass_are_refused_at_configure_time(
    tmp_path: Path, keys: Keys, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, message = _bad_files(tmp_path, keys)[case]
    with pytest.raises(SigningConfigurationError, match=message):
        configure(trusted_keys=str(path))
    with pytest.raises(SigningConfigurationError, match=message):
        IdempotencyConfig(trusted_keys=path)
    monkeypatch.setenv(TRUSTED_ENV, str(path))
    with pytest.raises(SigningConfigurationError, match=rf"\${TRUSTED_ENV}: .*{message}"):
        configure(backend=f"sqlite:///{tmp_path / 'ledger.db'}")


def test_other_settings_that_cannot_work_are_refused_where_given(
    tmp_path: Path, keys: Keys
) -> None:
    with pytest.raises(SigningConfigurationError, match="blank"):
        configure(trusted_keys="  ")
    with pytest.raises(TypeError, match="not int"):
        configure(trusted_keys=42)
    with pytest.raises(SigningConfigurationError, match="no trusted keys are"):
        configure(accept_unsigned_grants_until="2030-01-01T00:00:00+00:00")
    with pytest.raises(SigningConfigurationError, match="no UTC offset"):
        configure(trusted_keys=keys.trusted, accept_unsigned_grants_until=dt.datetime(2030, 1, 1))
    with pytest.raises(SigningConfigurationError, match="not an ISO 8601 time"):
        configure(trusted_keys=keys.trusted, accept_unsigned_grants_until="next tuesday")
    with pytest.raises(SigningConfigurationError, match="is the process's setting"):
        Crew(agents=[], tasks=[], idempotency={"trusted_keys": str(keys.trusted)})


def _pay_tool(charges: FakeProvider) -> BaseTool:
    @tool("pay_invoice", idempotent=True, approval=True, approvers=2)
    def pay_invoice(invoice: str, amount_cents: int) -> str:
        """Pay `amount_cents` (euro cents) for `invoice`."""
        return charges.charge(amount_cents, "supplier", invoice=invoice)

    return pay_invoice


def _asked(pay: BaseTool) -> str:
    with pytest.raises(ApprovalRequired) as asked:
        pay.run(invoice="INV-1", amount_cents=90_000)
    return asked.value.request_id


@pytest.mark.parametrize("given", ["path", "lines", "TrustedKeys", "environment"])
def test_every_way_of_giving_trusted_keys_turns_signing_on_for_the_guard_and_its_ledger(
    tmp_path: Path,
    keys: Keys,
    charges: FakeProvider,
    given: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    values: dict[str, Any] = {
        "path": str(keys.trusted),
        "lines": keys.trusted.read_text().splitlines(),
        "TrustedKeys": TrustedKeys.from_file(keys.trusted),
    }
    if given == "environment":
        monkeypatch.setenv(TRUSTED_ENV, str(keys.trusted))
        configure(backend=url)
    else:
        configure(backend=url, trusted_keys=values[given])
    pay = _pay_tool(charges)
    rid = _asked(pay)
    backend = backend_from_url(url)
    ledger = _ledgers.ledger_for(_ledgers.backend_from(url))  # the one the guard uses
    assert isinstance(ledger.trusted_keys, TrustedKeys)  # resolutions too need a signature
    Approvals(backend).approve(rid, by="alice")
    Approvals(backend).approve(rid, by="bob")
    with pytest.raises(DecisionRefused, match=f"approval request {rid}"):
        pay.run(invoice="INV-1", amount_cents=90_000)
    assert charges.count() == 0
    # Turned off again: the guard's ledger obeys resolutions as written once more.
    monkeypatch.delenv(TRUSTED_ENV, raising=False)
    configure(backend=url)
    Approvals(backend).approve(rid, by="alice")
    Approvals(backend).approve(rid, by="bob")
    pay.run(invoice="INV-1", amount_cents=90_000)
    assert ledger.trusted_keys is None and charges.count() == 1


def test_a_bad_environment_nothing_read_before_stops_the_first_guarded_call(
    tmp_path: Path, charges: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CREWAI_IDEMPOTENCY_URL", f"sqlite:///{tmp_path / 'ledger.db'}")
    monkeypatch.setenv(TRUSTED_ENV, str(tmp_path / "missing"))
    pay = _pay_tool(charges)
    with pytest.raises(SigningConfigurationError, match=rf"\${TRUSTED_ENV}.*does not exist"):
        pay.run(invoice="INV-1", amount_cents=90_000)
    with pytest.raises(SigningConfigurationError, match="does not exist"):
        Crew(agents=[], tasks=[])
    assert charges.count() == 0


def test_the_time_unsigned_grants_still_count_until_comes_from_configure_or_the_environment(
    tmp_path: Path, keys: Keys, charges: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv(UNTIL_ENV, "2000-01-01T00:00:00+00:00")  # long past
    configure(backend=url, trusted_keys=keys.trusted)
    pay = _pay_tool(charges)
    rid = _asked(pay)
    backend = backend_from_url(url)
    for name in ("alice", "bob"):
        Approvals(backend).approve(rid, by=name)
    with pytest.raises(DecisionRefused, match=r"\(unsigned\)"):
        pay.run(invoice="INV-1", amount_cents=90_000)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    configure(backend=url, trusted_keys=keys.trusted, accept_unsigned_grants_until=later)
    for name in ("alice", "bob"):
        Approvals(backend).approve(rid, by=name)
    pay.run(invoice="INV-1", amount_cents=90_000)
    assert charges.count() == 1


def test_without_trusted_keys_nothing_changes_and_nothing_is_signed(
    tmp_path: Path, charges: FakeProvider
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    configure(backend=url)
    pay = _pay_tool(charges)
    rid = _asked(pay)
    backend = backend_from_url(url)
    Approvals(backend).approve(rid, by="alice")
    granted = Approvals(backend).approve(rid, by="bob")
    assert all("signature" not in a for a in granted.approvals)
    pay.run(invoice="INV-1", amount_cents=90_000)
    assert charges.count() == 1
