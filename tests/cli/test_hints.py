"""Every command a message suggests names the ledger, and works when pasted.

A ledger that is not the CLI's default (the embedded SQLite file for the current project)
is named with `--ledger URL` in the `approvals approve` hint of `ApprovalRequired` and the
`resolve` hint of `OutcomeUncertain`; a password in the URL is shown as `***`. Messages
name ledgers by URL, not by a Python repr.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from crewai_idempotent import (
    ApprovalRequired,
    Approvals,
    Ledger,
    LedgerUnavailable,
    OutcomeUncertain,
    OutcomeUnknown,
    SQLiteCacheBackend,
    Status,
)
from crewai_idempotent.cli import main as cli
from crewai_idempotent.ledger._backend import ledger_option, mark_default, url_of
from crewai_idempotent.ledger._ledger import current_claim

pytest_plugins = ["tests.support.crewai.fixtures"]


def _paste(hint: str, replace: dict[str, str] | None = None) -> Any:
    """Run the command between backticks in `hint`, as an operator pasting it would."""
    (command,) = re.findall(r"`(crewai-idempotent [^`]+)`", hint)[:1]
    for old, new in (replace or {}).items():
        command = command.replace(old, new)
    words = shlex.split(command)
    assert words[0] == "crewai-idempotent"
    return CliRunner().invoke(cli, words[1:], catch_exceptions=False)


def _uncertain(ledger: Ledger, key: str) -> OutcomeUncertain:
    def unknown() -> None:
        raise OutcomeUnknown("the provider timed out")

    with pytest.raises(OutcomeUnknown):
        ledger.run(key, unknown)
    with pytest.raises(OutcomeUncertain) as refused:
        ledger.run(key, lambda: "never")
    return refused.value


def test_the_resolve_hint_names_a_ledger_that_is_not_the_default(tmp_path: Path) -> None:
    backend = SQLiteCacheBackend(tmp_path / "ledger2.db")
    ledger = Ledger(backend)
    try:
        refused = _uncertain(ledger, "pay:inv-1")
        url = f"sqlite:///{tmp_path / 'ledger2.db'}"
        assert f"crewai-idempotent --ledger {url} resolve 'pay:inv-1'" in str(refused)
        assert refused.ledger == url
        pasted = _paste(
            str(refused), {"--happened/--absent": "--absent --reason 'no charge at the bank'"}
        )
        assert pasted.exit_code == 0, pasted.output
        record = ledger.get("pay:inv-1")
        assert record is not None and record.status is Status.FAILED
    finally:
        ledger.close()


def test_the_async_path_names_the_ledger_too(tmp_path: Path) -> None:
    import asyncio

    backend = SQLiteCacheBackend(tmp_path / "ledger.db")
    ledger = Ledger(backend)

    async def unknown() -> None:
        raise OutcomeUnknown("the provider timed out")

    async def never() -> str:
        return "never"

    async def twice() -> OutcomeUncertain:
        with pytest.raises(OutcomeUnknown):
            await ledger.arun("pay:inv-1", unknown)
        with pytest.raises(OutcomeUncertain) as refused:
            await ledger.arun("pay:inv-1", never)
        return refused.value

    try:
        refused = asyncio.run(twice())
        assert f"--ledger {backend.url} resolve" in str(refused)
    finally:
        ledger.close()


def test_the_default_ledger_needs_no_ledger_option(tmp_path: Path) -> None:
    backend = SQLiteCacheBackend(tmp_path / "default.db")
    mark_default(backend)
    ledger = Ledger(backend)
    try:
        refused = _uncertain(ledger, "pay:inv-1")
        assert "`crewai-idempotent resolve 'pay:inv-1' --happened/--absent`" in str(refused)
        assert ledger_option(backend) is None
    finally:
        ledger.close()


def test_the_approve_hint_names_the_ledger_and_approves_when_pasted(tmp_path: Path) -> None:
    backend = SQLiteCacheBackend(tmp_path / "ledger2.db")
    ledger = Ledger(backend)
    approvals = Approvals(backend)

    def gated() -> None:  # what the gates do under the call's claim
        claim = current_claim()
        assert claim is not None
        approvals.authorize(claim, "f" * 64, tool="pay", reason="over 500.00 EUR", summary={})

    try:
        with pytest.raises(ApprovalRequired) as refused:
            ledger.run("pay:inv-9", gated)
        message = str(refused.value)
        rid = refused.value.request_id
        assert f"`crewai-idempotent --ledger {backend.url} approvals approve {rid}`" in message
        assert f"`crewai-idempotent --ledger {backend.url} approvals deny {rid}" in message
        pasted = _paste(message)
        assert pasted.exit_code == 0, pasted.output
        assert approvals.get(rid).state.value == "APPROVED"
        assert approvals.get(rid).approve_command == (
            f"crewai-idempotent --ledger {backend.url} approvals approve {rid}"
        )
    finally:
        ledger.close()


def test_a_password_in_the_hint_is_redacted() -> None:
    error = OutcomeUncertain(
        "pay:1", None, "unknown", ledger="postgresql://app:***@db.internal/ledger?table=t"
    )
    assert "--ledger 'postgresql://app:***@db.internal/ledger?table=t' resolve" in str(error)


def test_server_urls_redact_their_password_and_keep_the_ledger_options() -> None:
    pytest.importorskip("psycopg")
    from crewai_idempotent import PostgresCacheBackend

    backend = PostgresCacheBackend.from_url(
        "postgresql://app:s3cret@db.internal:5433/ledger?table=receipts&sslmode=require"
    )
    try:
        assert (
            backend.url
            == "postgresql://app:***@db.internal:5433/ledger?sslmode=require&table=receipts"
        )
        assert "s3cret" not in url_of(backend)
    finally:
        backend.close()


def test_errors_name_ledgers_by_url_not_by_repr(tmp_path: Path) -> None:
    backend = SQLiteCacheBackend(tmp_path / "ledger.db")
    ledger = Ledger(backend)
    ledger.run("k", lambda: 1)
    result = CliRunner().invoke(
        cli,
        ["--ledger", backend.url, "approvals", "approve", "ap_" + "0" * 20],
        catch_exceptions=False,
    )
    assert result.exit_code == 1
    assert f"no approval request 'ap_{'0' * 20}' in {backend.url}" in result.output
    assert "SQLiteCacheBackend(" not in result.output
    backend.close()
    with pytest.raises(LedgerUnavailable, match=re.escape(f"the ledger {backend.url} is closed")):
        ledger.run("k2", lambda: 1)


def test_a_crew_tool_names_the_configured_ledger(isolated_crewai: Path, tmp_path: Path) -> None:
    from crewai_idempotent import configure
    from tests.support.crewai.crews import charge_tool
    from tests.support.crewai.provider import FakeProvider

    url = f"sqlite:///{tmp_path / 'ledger2.db'}"
    configure(backend=url)
    charges = FakeProvider(tmp_path / "charges.jsonl")
    tool = charge_tool(charges, idempotent=True, approval=True)
    with pytest.raises(ApprovalRequired) as refused:
        tool.run(amount=1, recipient="bob")
    assert f"crewai-idempotent --ledger {url} approvals approve" in str(refused.value)
    assert _paste(str(refused.value)).exit_code == 0
    assert tool.run(amount=1, recipient="bob")  # approved: it runs, once
    assert len(charges.effects()) == 1
    configure(None)

    # The embedded default (crewai's storage folder) is what the CLI finds by itself.
    tool = charge_tool(charges, idempotent=True, approval=True)
    with pytest.raises(ApprovalRequired) as refused:
        tool.run(amount=2, recipient="bob")
    assert "`crewai-idempotent approvals approve ap_" in str(refused.value)


def test_a_key_with_a_quote_and_a_dollar_sign_is_pasted_as_one_word(tmp_path: Path) -> None:
    """repr quoted such a key in double quotes, in which the shell expanded `$USER`: the
    pasted command named another key and changed nothing."""
    backend = SQLiteCacheBackend(tmp_path / "ledger2.db")
    ledger = Ledger(backend)
    key = "pay:o'brien-$USER"
    try:
        refused = _uncertain(ledger, key)
        (hint,) = re.findall(r"`crewai-idempotent ([^`]+)`", str(refused))
        hint = hint.replace("--happened/--absent", "--absent --reason none")
        line = f"{shlex.quote(sys.executable)} -m crewai_idempotent.cli {hint}"
        env = {**os.environ, "USER": "alice"}
        pasted = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True)
        assert pasted.returncode == 0, pasted.stderr
        record = ledger.get(key)
        assert record is not None and record.status is Status.FAILED
    finally:
        ledger.close()
