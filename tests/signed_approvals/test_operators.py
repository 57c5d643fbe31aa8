"""Where people decide, with signing on: `approvals approve/deny --key FILE` (or
$CREWAI_IDEMPOTENCY_SIGNING_KEY), the console's form and Slack's buttons, which cannot
sign, and what `doctor` says. Decisions are read back from the ledger, never from output
alone.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest
from click.testing import CliRunner, Result

from crewai_idempotent import (
    ApprovalRequired,
    Approvals,
    ApprovalState,
    CacheBackend,
    Ledger,
    backend_from_url,
)
from crewai_idempotent.cli import main as cli
from crewai_idempotent.gates._plan import Plan
from crewai_idempotent.signing import Signer
from tests.signed_approvals.conftest import TRUSTED_ENV, Keys

SIGNING_KEY_ENV = "CREWAI_IDEMPOTENCY_SIGNING_KEY"


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture
def store(url: str) -> Iterator[CacheBackend]:
    backend = backend_from_url(url)
    yield backend
    backend.close()


def _ask(store: CacheBackend, invoice: str, approvers: int = 1) -> str:
    """A request for one call, as a gated call stores it (its fingerprint a real one)."""
    fingerprint = hashlib.sha256(invoice.encode()).hexdigest()
    plan = Plan(tool="pay_invoice", fingerprint=fingerprint, approval=True,
                summary={"invoice": invoice}, approvers=approvers)  # fmt: skip
    with pytest.raises(ApprovalRequired) as asked:
        Ledger(store).run(f"pay:{invoice}", lambda: "paid", fingerprint=fingerprint, stage=plan)
    return asked.value.request_id


def _cli(url: str, *args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, ["--ledger", url, *args], env=env)


@pytest.fixture
def signing_on(keys: Keys, monkeypatch: pytest.MonkeyPatch) -> Keys:
    monkeypatch.setenv(TRUSTED_ENV, str(keys.trusted))
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    return keys


def test_with_trusted_keys_the_cli_refuses_a_decision_without_a_key_naming_the_flag(
    url: str, store: CacheBackend, signing_on: Keys
) -> None:
    rid = _ask(store, "INV-1")
    for args in (["approve", rid], ["deny", rid, "--reason", "no"]):
        refused = _cli(url, "approvals", *args)
        assert refused.exit_code == 1
        assert "--key FILE" in refused.output and SIGNING_KEY_ENV in refused.output
        assert "Nothing was written" in refused.output
    assert Approvals(store).get(rid).state is ApprovalState.PENDING


def test_the_cli_signs_with_the_key_given_or_named_in_the_environment(
    url: str, store: CacheBackend, signing_on: Keys
) -> None:
    rid = _ask(store, "INV-2", approvers=2)
    first = _cli(url, "approvals", "approve", rid, "--key", str(signing_on.alice.path))
    assert first.exit_code == 0, first.output
    assert f"signed by alice@example.com (key {signing_on.alice.key_id})" in first.output
    env = {SIGNING_KEY_ENV: str(signing_on.bob.path)}
    second = _cli(url, "approvals", "approve", rid, "--ttl", "2h", env=env)
    assert second.exit_code == 0, second.output
    request = Approvals(store).get(rid)
    assert request.state is ApprovalState.APPROVED
    assert [a["signature"]["key"] for a in request.approvals] == [
        signing_on.alice.key_id, signing_on.bob.key_id,
    ]  # fmt: skip
    assert request.approvals[1]["until"] == pytest.approx(store.now() + 7200, abs=30)
    denied = _cli(url, "approvals", "deny", _ask(store, "INV-3"), "--reason", "duplicate",
                  env=env)  # fmt: skip
    assert denied.exit_code == 0, denied.output
    assert "DENIED by bob@example.com" in denied.output


def test_the_cli_refuses_before_writing_a_key_the_workers_would_refuse(
    url: str, store: CacheBackend, signing_on: Keys, tmp_path: Path
) -> None:
    rid = _ask(store, "INV-4")
    mallory = Signer.create(tmp_path / "mallory.key", identity="mallory@example.com")
    refused = _cli(url, "approvals", "approve", rid, "--key", str(mallory.path))
    assert refused.exit_code == 1 and "(untrusted-key)" in refused.output
    assert "nothing was written" in refused.output
    assert mallory.path is not None
    mallory.path.chmod(0o644)
    loose = _cli(url, "approvals", "approve", rid, "--key", str(mallory.path))
    assert loose.exit_code == 1 and "may be read or written by group or others" in loose.output
    assert Approvals(store).get(rid).approvals == ()


def test_doctor_says_whether_decisions_are_signed(
    url: str, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TRUSTED_ENV, raising=False)
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    unsigned = _cli(url, "doctor").output
    assert "decisions are unsigned" in unsigned
    assert "whoever can write the ledger can approve" in unsigned
    monkeypatch.setenv(TRUSTED_ENV, str(keys.trusted))
    monkeypatch.setenv(SIGNING_KEY_ENV, str(keys.bob.path))
    signed = _cli(url, "doctor").output
    assert f"decisions are signed: 3 trusted key(s) from ${TRUSTED_ENV} ({keys.trusted})" in signed
    assert "alice@example.com: 2 key(s) (ed25519), roles approve, resolve" in signed
    assert "bob@example.com: 1 key(s) (ed25519), roles approve" in signed
    assert f"bob@example.com (key {keys.bob.key_id}), trusted for approve" in signed
    keys.trusted.chmod(0o666)
    broken = _cli(url, "doctor")
    assert broken.exit_code == 1 and "PROBLEM: " in broken.output
    assert "another user could change it" in broken.output


# -- the console and Slack, which cannot sign -------------------------------------------------

SECRET = "8f742231b10e8888abcd99yyyzzz85a5"


@pytest.fixture
def console(store: CacheBackend, signing_on: Keys) -> Iterator[object]:
    pytest.importorskip("starlette", reason="the console extra is not installed")
    from starlette.testclient import TestClient

    from crewai_idempotent.console import Accounts, ConsoleSettings, create_app
    from tests.support.console import PASSWORD

    Accounts(store).add("alice", "approver", PASSWORD, slack_user="UALICE01")
    app = create_app(store, ConsoleSettings(slack_signing_secret=SECRET))
    with TestClient(app, base_url="http://127.0.0.1", client=("127.0.0.1", 50000)) as client:
        yield client


def _click(rid: str, approve: bool) -> tuple[bytes, dict[str, str]]:
    from crewai_idempotent.console import _slack

    action = _slack.APPROVE if approve else _slack.DENY
    payload = {"type": "block_actions", "user": {"id": "UALICE01"}, "team": {"id": "T1"},
               "actions": [{"action_id": action, "value": f"{rid}:1"}]}  # fmt: skip
    body = urlencode({"payload": json.dumps(payload)}).encode()
    stamp = str(int(time.time()))
    return body, {
        "x-slack-request-timestamp": stamp,
        "x-slack-signature": _slack.signature(SECRET, stamp, body),
        "content-type": "application/x-www-form-urlencoded",
    }


def test_with_signing_on_a_slack_approve_changes_nothing_and_a_slack_deny_stops_the_call(
    store: CacheBackend, console: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    import crewai_idempotent.console._slack as slack

    said: list[str] = []
    monkeypatch.setattr(slack, "reply", lambda url, text, prefix: said.append(text))
    rid = _ask(store, "INV-5")
    body, headers = _click(rid, approve=True)
    assert console.post("/slack/interactive", content=body, headers=headers).status_code == 200  # type: ignore[attr-defined]
    assert Approvals(store).get(rid).state is ApprovalState.PENDING
    assert "Approvals of this ledger are signed" in said[-1] and "Nothing changed" in said[-1]
    assert f"approvals approve {rid} --key FILE" in said[-1]
    body, headers = _click(rid, approve=False)
    console.post("/slack/interactive", content=body, headers=headers)  # type: ignore[attr-defined]
    denied = Approvals(store).get(rid)
    assert denied.state is ApprovalState.DENIED and denied.decided_by == "alice"
    assert denied.history[-1]["via"] == "slack" and "signed" not in denied.history[-1]


def test_with_signing_on_the_console_form_refuses_an_approval_it_cannot_sign(
    store: CacheBackend, console: object
) -> None:
    from tests.support.console import csrf_of, login

    rid = _ask(store, "INV-6")
    assert login(console, "alice").status_code == 303
    page = console.get("/approvals").text  # type: ignore[attr-defined]
    answer = console.post(  # type: ignore[attr-defined]
        f"/approvals/{rid}/approve",
        data={"csrf": csrf_of(page), "round": "1", "ttl": "1h", "reason": "ok"},
    )
    assert answer.status_code == 409 and "Approvals of this ledger are signed" in answer.text
    assert Approvals(store).get(rid).state is ApprovalState.PENDING


@pytest.mark.parametrize("verdict", ["absent", "happened"])
def test_with_signing_on_the_console_refuses_a_resolution_it_cannot_sign_and_says_how(
    store: CacheBackend, console: object, keys: Keys, url: str, tmp_path: Path, verdict: str
) -> None:
    """Before, the console wrote the resolution unsigned and the workers refused it later;
    now it refuses first, and the command it prints, run as pasted by an operator whose
    key is named in the environment, makes the same resolution signed."""
    import html
    import os
    import re
    import subprocess
    import sys

    from crewai_idempotent import OutcomeUncertain, OutcomeUnknown, Status
    from crewai_idempotent.console import Accounts
    from tests.support.console import PASSWORD, csrf_of, login

    def unknown() -> None:
        raise OutcomeUnknown("the provider did not answer")

    key = "charge:o'brien 7"
    with pytest.raises((OutcomeUnknown, OutcomeUncertain)):
        Ledger(store).run(key, unknown)
    Accounts(store).add("olga", "operator", PASSWORD)
    assert login(console, "olga").status_code == 303
    page = console.get("/uncertain").text  # type: ignore[attr-defined]
    form = {"csrf": csrf_of(page), "key": key, "token": "1", "verdict": verdict,
            "reason": "checked: it's not in the dashboard"}  # fmt: skip
    if verdict == "happened":
        form |= {"receipt_kind": "json", "receipt": '{"id": "ch_9"}'}
    answer = console.post("/record/resolve", data=form)  # type: ignore[attr-defined]
    assert answer.status_code == 409 and "Resolutions of this ledger are signed" in answer.text
    record = Ledger(store).get(key)
    assert record is not None and record.status is Status.UNCERTAIN and not record.signed
    text = html.unescape(answer.text)
    (hint,) = re.findall(r"\): (crewai-idempotent [^\n]*?)\. Nothing changed", text)
    env = {**os.environ, SIGNING_KEY_ENV: str(keys.alice.path),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    pasted = subprocess.run(["bash", "-c", hint], env=env, capture_output=True, text=True)
    assert pasted.returncode == 0, pasted.stderr
    settled = Ledger(store).get(key)
    assert settled is not None and settled.signed and settled.history[-1].by == keys.alice.identity
    if verdict == "absent":
        assert settled.status is Status.FAILED
    else:
        assert settled.status is Status.COMMITTED and settled.value() == {"id": "ch_9"}
    assert url in hint


def test_a_console_told_of_trusted_keys_that_do_not_pass_does_not_start(
    store: CacheBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("starlette", reason="the console extra is not installed")
    from crewai_idempotent import SigningConfigurationError
    from crewai_idempotent.console import ConsoleSettings, create_app

    monkeypatch.setenv(TRUSTED_ENV, str(tmp_path / "missing"))
    with pytest.raises(SigningConfigurationError, match="does not exist"):
        create_app(store, ConsoleSettings())
