"""Passkeys in the console over HTTP, in process: registering one, and approving or
denying with it, each answer made by a software authenticator (tests/signing/authenticator.py,
built from the WebAuthn spec and `cryptography`, not from py_webauthn).

What is read back is the ledger (`Approvals.get`, the accounts) and the trusted keys line
the page shows, checked with `signing.verify`: never page text alone. The same flow in
Chromium with a virtual authenticator and a real crew is test_passkeys_browser.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from html import unescape
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the console extra is not installed")
pytest.importorskip("webauthn", reason="the passkeys extra is not installed")

from starlette.testclient import TestClient

from crewai_idempotent import CacheBackend, Ledger, backend_from_url
from crewai_idempotent._errors import AccountError, ApprovalRequired
from crewai_idempotent.console import Accounts, ConsoleSettings, create_app
from crewai_idempotent.gates._approvals import Approvals, ApprovalState
from crewai_idempotent.gates._plan import Plan
from crewai_idempotent.gates._spend import Where
from crewai_idempotent.signing import ENV, Decision, SignatureEnvelope, TrustedKeys, verify
from crewai_idempotent.signing._encoding import from_b64url
from tests.signing.authenticator import Authenticator
from tests.support.console import PASSWORD, REPO, csrf_of, login, served

BASE = "http://localhost"  # passkeys belong to a name: never an IP address
ORIGIN = "http://localhost"


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[CacheBackend]:
    store = backend_from_url(f"sqlite:///{tmp_path / 'ledger.db'}")
    accounts = Accounts(store)
    for name, role in (("alice", "approver"), ("bob", "approver"), ("victor", "viewer")):
        accounts.add(name, role, PASSWORD)
    yield store
    store.close()


def _client(backend: CacheBackend, base: str = BASE, **options: Any) -> TestClient:
    app = create_app(backend, ConsoleSettings(), **options)
    return TestClient(app, base_url=base, client=("127.0.0.1", 50000))


@pytest.fixture
def client(backend: CacheBackend) -> Iterator[TestClient]:
    with _client(backend) as c:
        yield c


def _as(client: TestClient, name: str) -> TestClient:
    client.cookies.clear()
    assert login(client, name).status_code == 303
    return client


def ask(backend: CacheBackend, invoice: str, approvers: int = 1) -> str:
    """A request for a call as a crew's gate stores it (a SHA-256 fingerprint), its id."""
    key = f"pay_invoice:{invoice}"
    plan = Plan(
        tool="pay_invoice", fingerprint=hashlib.sha256(key.encode()).hexdigest(),
        approval=True, summary={"invoice": invoice, "amount_cents": 90_000},
        where=Where(kickoff="kick-1", crew="crew", task="task"), approvers=approvers,
    )  # fmt: skip
    try:
        Ledger(backend).run(key, lambda: "ran", fingerprint=plan.fingerprint, stage=plan)
    except ApprovalRequired as asked:
        return asked.request_id
    raise AssertionError("the call ran without approval")


def register(client: TestClient, passkey: Authenticator, label: str = "laptop") -> Any:
    csrf = csrf_of(client.get("/passkeys").text)
    options = client.post("/passkeys/options", data={"csrf": csrf})
    assert options.status_code == 200, options.text
    challenge = from_b64url(options.json()["publicKey"]["challenge"])
    made = passkey.create(challenge, ORIGIN)
    return client.post(
        "/passkeys/register",
        data={"csrf": csrf, "credential": json.dumps(made), "label": label},
        follow_redirects=False,
    )


def challenge(client: TestClient, rid: str, verdict: str = "approve", **fields: str) -> Any:
    csrf = csrf_of(client.get(f"/approvals/{rid}").text)
    data = {"csrf": csrf, "round": "1", "verdict": verdict, "ttl": "1h", "reason": "checked"}
    return client.post(f"/approvals/{rid}/passkey/challenge", data={**data, **fields})


def post_signed(
    client: TestClient, rid: str, decision: Any, assertion: Any, verdict: str = "approve"
) -> Any:
    csrf = csrf_of(client.get("/passkeys").text)
    data = {"csrf": csrf, "decision": json.dumps(decision), "assertion": json.dumps(assertion)}
    return client.post(f"/approvals/{rid}/passkey/{verdict}", data=data, follow_redirects=False)


def sign(client: TestClient, passkey: Authenticator, rid: str, verdict: str = "approve") -> Any:
    answer = challenge(client, rid, verdict)
    assert answer.status_code == 200, answer.text
    asked = answer.json()
    assertion = passkey.get(from_b64url(asked["publicKey"]["challenge"]), ORIGIN)
    return asked["decision"], assertion


def _line(page: str) -> str:
    found = re.search(r'<pre class="value line"[^>]*>([^<]+)</pre>', page)
    assert found, "no trusted keys line on the page"
    return unescape(found.group(1))


# -- registering ------------------------------------------------------------------------


def test_a_registered_passkey_s_line_verifies_what_it_signs(
    client: TestClient, backend: CacheBackend
) -> None:
    _as(client, "alice")
    passkey = Authenticator("localhost")
    answer = register(client, passkey, "laptop Touch ID")
    assert answer.status_code == 303, answer.text
    page = client.get(answer.headers["location"]).text
    assert "Registered." in page and "laptop Touch ID" in page
    line = _line(page)
    assert line.startswith("approve webauthn ") and " alice credential=" in line
    assert "rp=localhost origin=http://localhost uv=required" in line
    # The command to paste appends exactly that line.
    command = unescape(re.search(r'<pre class="value command"[^>]*>([^<]+)</pre>', page)[1])
    assert command == f"printf '%s\\n' '{line}' >> \"$CREWAI_IDEMPOTENCY_TRUSTED_KEYS\""
    (kept,) = Accounts(backend).get("alice").passkeys  # type: ignore[union-attr]
    assert kept.line == line and kept.label == "laptop Touch ID"

    trusted = TrustedKeys.from_lines([line])
    decision = Decision.approval(
        request="ap_" + "0" * 20, round=1, key="k", fingerprint="a" * 64, until=time.time() + 60,
        by="alice", via="console",
    )  # fmt: skip
    assertion = passkey.get(decision.challenge(), ORIGIN)
    envelope = SignatureEnvelope.from_assertion(assertion, kept.key_id)
    assert verify(decision, envelope, trusted).identity == "alice"


def test_a_registration_answers_only_its_own_session_s_fresh_challenge(
    backend: CacheBackend,
) -> None:
    passkey = Authenticator("localhost")
    with _client(backend) as alice, _client(backend) as bob:
        _as(alice, "alice")
        _as(bob, "bob")
        # Bob's options, answered and posted by alice: another session's challenge.
        options = bob.post("/passkeys/options", data={"csrf": csrf_of(bob.get("/passkeys").text)})
        made = passkey.create(from_b64url(options.json()["publicKey"]["challenge"]), ORIGIN)
        csrf = csrf_of(alice.get("/passkeys").text)
        answer = alice.post(
            "/passkeys/register", data={"csrf": csrf, "credential": json.dumps(made)}
        )
        assert answer.status_code == 403 and "another session" in answer.text
        # A challenge the console never gave.
        made = passkey.create(b"\x07" * 40, ORIGIN)
        answer = alice.post(
            "/passkeys/register", data={"csrf": csrf, "credential": json.dumps(made)}
        )
        assert answer.status_code == 403
        assert Accounts(backend).get("alice").passkeys == ()  # type: ignore[union-attr]
        # Made on another origin: py_webauthn refuses it, nothing is kept.
        options = alice.post("/passkeys/options", data={"csrf": csrf})
        elsewhere = passkey.create(
            from_b64url(options.json()["publicKey"]["challenge"]), "http://localhost:9"
        )
        answer = alice.post(
            "/passkeys/register", data={"csrf": csrf, "credential": json.dumps(elsewhere)}
        )
        assert answer.status_code == 400 and "Not registered" in answer.text
        assert Accounts(backend).get("alice").passkeys == ()  # type: ignore[union-attr]


def test_the_same_passkey_is_kept_once(client: TestClient, backend: CacheBackend) -> None:
    passkey = Authenticator("localhost")
    assert register(_as(client, "alice"), passkey).status_code == 303
    again = register(client, passkey)
    assert again.status_code == 400 and "registered already" in again.text
    taken = register(_as(client, "bob"), passkey)
    assert taken.status_code == 400 and "registered already (to &#39;alice&#39;" in taken.text
    assert Accounts(backend).get("bob").passkeys == ()  # type: ignore[union-attr]


def test_a_viewer_registers_nothing_and_an_ip_address_is_told_to_use_a_name(
    backend: CacheBackend, client: TestClient
) -> None:
    _as(client, "victor")
    page = client.get("/passkeys")
    assert page.status_code == 200 and "Only approvers sign decisions" in page.text
    assert 'href="/passkeys"' not in page.text.split("<main>")[0]  # no link in the header
    refused = client.post("/passkeys/options", data={"csrf": csrf_of(page.text)})
    assert refused.status_code == 403 and "victor is a viewer" in refused.text
    with _client(backend, "http://127.0.0.1:8765") as by_address:
        _as(by_address, "alice")
        page = by_address.get("/passkeys").text
        assert "open it by name (http://localhost:8765 on this machine" in page
        assert "data-register" not in page
        answer = by_address.post("/passkeys/options", data={"csrf": csrf_of(page)})
        assert answer.status_code == 409 and "domain name" in answer.json()["error"]


def test_removing_a_passkey_here_says_the_workers_file_is_what_revokes_it(
    client: TestClient, backend: CacheBackend
) -> None:
    assert register(_as(client, "alice"), Authenticator("localhost")).status_code == 303
    (kept,) = Accounts(backend).get("alice").passkeys  # type: ignore[union-attr]
    csrf = csrf_of(client.get("/passkeys").text)
    answer = client.post("/passkeys/remove", data={"csrf": csrf, "key": kept.key_id})
    assert answer.status_code == 200 and "Take its line out of the workers" in answer.text
    assert Accounts(backend).get("alice").passkeys == ()  # type: ignore[union-attr]
    no_token = client.post("/passkeys/remove", data={"key": kept.key_id})
    assert no_token.status_code == 403


def test_an_account_keeps_only_its_own_passkey_lines(backend: CacheBackend) -> None:
    accounts = Accounts(backend)
    passkey = Authenticator("localhost")
    line = passkey.line("alice", origin=ORIGIN)
    with pytest.raises(AccountError, match="identity is its name"):
        accounts.add_passkey("bob", line)
    with pytest.raises(AccountError, match="not a passkey's trusted keys line"):
        accounts.add_passkey("alice", "approve webauthn nonsense alice")
    with pytest.raises(AccountError, match="label"):
        accounts.add_passkey("alice", line, "two\nlines")
    kept = accounts.add_passkey("alice", line, " laptop ")
    assert kept.label == "laptop" and accounts.get("alice").passkeys == (kept,)  # type: ignore[union-attr]
    with pytest.raises(AccountError, match="no passkey"):
        accounts.remove_passkey("alice", "SHA256:nothing")
    assert accounts.remove_passkey("alice", kept.key_id) == kept


# -- signing ------------------------------------------------------------------------------


def test_the_challenge_is_the_decision_on_the_request_as_it_stands(
    client: TestClient, backend: CacheBackend
) -> None:
    rid = ask(backend, "INV-1")
    passkey = Authenticator("localhost")
    assert register(_as(client, "alice"), passkey).status_code == 303
    answer = challenge(client, rid, ttl="4h", reason="checked the contract")
    assert answer.status_code == 200, answer.text
    asked = answer.json()
    request = Approvals(backend).get(rid)
    decision = Decision.from_json(asked["decision"])
    assert (decision.kind, decision.request, decision.round) == ("approve", rid, 1)
    assert (decision.key, decision.fingerprint) == (request.key, request.fingerprint)
    assert (decision.by, decision.via, decision.reason) == (
        "alice",
        "console",
        "checked the contract",
    )
    assert decision.until - decision.at == pytest.approx(4 * 3600)  # type: ignore[operator]
    options = asked["publicKey"]
    assert from_b64url(options["challenge"]) == decision.challenge()
    assert options["rpId"] == "localhost" and options["userVerification"] == "required"
    assert [c["id"] for c in options["allowCredentials"]] == [
        Accounts(backend).get("alice").passkeys[0].credential  # type: ignore[union-attr]
    ]
    # Another round than the page showed, or nothing to approve: no challenge.
    assert challenge(client, rid, round="2").status_code == 409
    assert challenge(client, rid, verdict="deny", reason="").status_code == 400


def test_without_a_passkey_the_request_page_says_where_to_register_one(
    client: TestClient, backend: CacheBackend
) -> None:
    rid = ask(backend, "INV-2")
    page = _as(client, "alice").get(f"/approvals/{rid}").text
    assert "Sign with your passkey" in page and 'href="/passkeys">register one' in page
    assert "passkeys.js" not in page  # no script for nothing to sign
    assert "Optional: this console has no trusted keys" in page
    assert 'action="/approvals/' + rid + '/approve"' in page  # the unsigned form stays
    answer = challenge(client, rid)
    assert answer.status_code == 409 and "register one" in answer.json()["error"]


def test_a_signed_approval_is_recorded_with_its_signature(
    client: TestClient, backend: CacheBackend
) -> None:
    rid = ask(backend, "INV-3")
    passkey = Authenticator("localhost")
    assert register(_as(client, "alice"), passkey).status_code == 303
    page = client.get(f"/approvals/{rid}").text
    assert "Approve with passkey" in page and "/static/passkeys.js" in page
    decision, assertion = sign(client, passkey, rid)
    answer = post_signed(client, rid, decision, assertion)
    assert answer.status_code == 303, answer.text
    assert answer.headers["location"] == f"/approvals/{rid}?done=approved&id={rid}"
    request = Approvals(backend).get(rid)
    assert request.state is ApprovalState.APPROVED and request.decided_by == "alice"
    (entry,) = request.approvals
    assert entry["until"] == decision["until"]
    # What the ledger keeps verifies against the line the console showed.
    (kept,) = Accounts(backend).get("alice").passkeys  # type: ignore[union-attr]
    trusted = TrustedKeys.from_lines([kept.line])
    assert verify(entry["decision"], entry["signature"], trusted).identity == "alice"


def test_a_signed_denial_is_recorded(client: TestClient, backend: CacheBackend) -> None:
    rid = ask(backend, "INV-4")
    passkey = Authenticator("localhost")
    assert register(_as(client, "alice"), passkey).status_code == 303
    answer = challenge(client, rid, "deny", reason="a duplicate of INV-3")
    decision = answer.json()["decision"]
    assertion = passkey.get(from_b64url(answer.json()["publicKey"]["challenge"]), ORIGIN)
    assert post_signed(client, rid, decision, assertion, "deny").status_code == 303
    request = Approvals(backend).get(rid)
    assert (
        request.state is ApprovalState.DENIED and request.decision_reason == "a duplicate of INV-3"
    )


def test_the_same_passkey_counts_once_for_two_approvers(
    client: TestClient, backend: CacheBackend
) -> None:
    rid = ask(backend, "INV-5", approvers=2)
    passkey = Authenticator("localhost")
    assert register(_as(client, "alice"), passkey).status_code == 303
    first = sign(client, passkey, rid)
    assert post_signed(client, rid, *first).status_code == 303
    (kept,) = Accounts(backend).get("alice").passkeys  # type: ignore[union-attr]
    page = client.get(f"/approvals/{rid}").text
    assert f"alice via console: signed by key <code>{kept.key_id}</code>" in page
    assert "You approved this round" in page and "Approve with passkey" not in page
    second = post_signed(client, rid, *sign(client, passkey, rid))
    assert second.status_code == 409 and "already approved" in second.text
    replayed = post_signed(client, rid, *first)
    assert replayed.status_code == 409
    request = Approvals(backend).get(rid)
    assert request.state is ApprovalState.PENDING and len(request.approvals) == 1


def test_an_assertion_for_another_call_changes_nothing(
    client: TestClient, backend: CacheBackend
) -> None:
    rid, other = ask(backend, "INV-6"), ask(backend, "INV-7")
    passkey = Authenticator("localhost")
    assert register(_as(client, "alice"), passkey).status_code == 303
    decision, assertion = sign(client, passkey, rid)
    # The decision and its assertion, sent to the other request's endpoint.
    moved = post_signed(client, other, decision, assertion)
    assert moved.status_code == 403 and f"not this one to approve {other}" in moved.text
    # The other request's own decision, with the assertion made for the first one.
    theirs, _ = sign(client, passkey, other)
    swapped = post_signed(client, other, theirs, assertion)
    assert swapped.status_code == 403 and "(challenge)" in swapped.text
    # A denial's endpoint does not take an approval.
    assert post_signed(client, rid, decision, assertion, "deny").status_code == 403
    for each in (rid, other):
        assert Approvals(backend).get(each).state is ApprovalState.PENDING


def test_a_decision_changed_after_the_challenge_or_too_old_is_refused(
    client: TestClient, backend: CacheBackend
) -> None:
    rid = ask(backend, "INV-8")
    passkey = Authenticator("localhost")
    assert register(_as(client, "alice"), passkey).status_code == 303
    asked = challenge(client, rid).json()["decision"]

    def signed_as(**changes: Any) -> Any:
        decision = Decision.from_json({**asked, **changes})
        return post_signed(
            client, rid, decision.to_json(), passkey.get(decision.challenge(), ORIGIN)
        )

    assert signed_as(by="bob").status_code == 403  # another identity than who is logged in
    assert signed_as(via="api").status_code == 403
    assert signed_as(round=2).status_code == 409
    old = signed_as(at=asked["at"] - 3600, until=asked["until"] - 3600)
    assert old.status_code == 409 and "too long ago" in old.text
    long = signed_as(until=asked["at"] + 31 * 86400)
    assert long.status_code == 403 and "deadline" in long.text
    # Signed by a passkey the account does not hold.
    stranger = Authenticator("localhost")
    decision = Decision.from_json(asked)
    foreign = post_signed(client, rid, asked, stranger.get(decision.challenge(), ORIGIN))
    assert foreign.status_code == 403
    assert "not by one of alice's passkeys" in unescape(foreign.text)
    # Without the session's token.
    plain = {
        "decision": json.dumps(asked),
        "assertion": json.dumps(passkey.get(decision.challenge(), ORIGIN)),
    }
    assert client.post(f"/approvals/{rid}/passkey/approve", data=plain).status_code == 403
    assert Approvals(backend).get(rid).state is ApprovalState.PENDING


def test_with_trusted_keys_the_console_offers_only_signed_decisions(
    backend: CacheBackend, tmp_path: Path
) -> None:
    rid = ask(backend, "INV-9")
    passkey = Authenticator("localhost")
    other = Authenticator("localhost")
    trusted_file = tmp_path / "trusted_keys"
    trusted_file.write_text(other.line("someone", origin=ORIGIN) + "\n")
    trusted_file.chmod(0o600)
    with _client(backend, trusted_keys=TrustedKeys.from_file(trusted_file)) as client:
        assert register(_as(client, "alice"), passkey).status_code == 303
        listing = client.get("/approvals").text
        assert 'button type="submit" class="approve"' not in listing
        assert "approve with your passkey on the request" in listing
        assert 'button type="submit" class="deny"' in listing  # obeyed signed or not
        page = unescape(client.get("/passkeys").text)
        assert "not in this console's trusted keys yet" in page
        assert f">> {trusted_file}" in page
        # An unsigned approval, posted all the same: refused, nothing written.
        csrf = csrf_of(listing)
        plain = client.post(
            f"/approvals/{rid}/approve", data={"csrf": csrf, "round": "1", "ttl": "1h"}
        )
        assert plain.status_code == 409 and "Approvals of this ledger are signed" in plain.text
        assert Approvals(backend).get(rid).approvals == ()
        # Not in the trusted keys yet: the workers would refuse it, so it is not recorded.
        refused = post_signed(client, rid, *sign(client, passkey, rid))
        assert (
            refused.status_code == 403 and "workers would refuse it (untrusted-key)" in refused.text
        )
        assert Approvals(backend).get(rid).state is ApprovalState.PENDING
        # Once its line is in the file, the same flow is recorded.
        (kept,) = Accounts(backend).get("alice").passkeys  # type: ignore[union-attr]
        with trusted_file.open("a") as out:
            out.write(kept.line + "\n")
        assert "trusted by this console" in client.get("/passkeys").text
        assert post_signed(client, rid, *sign(client, passkey, rid)).status_code == 303
        assert Approvals(backend).get(rid).state is ApprovalState.APPROVED


def test_the_console_command_reads_the_workers_trusted_keys_before_it_listens(
    backend: CacheBackend, tmp_path: Path
) -> None:
    url = backend.url  # type: ignore[attr-defined]
    missing = tmp_path / "no-such-file"
    done = subprocess.run(
        [sys.executable, "-m", "crewai_idempotent.cli", "--ledger", url, "console", "--port", "0"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env={**os.environ, ENV: str(missing)},
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"${ENV}: trusted keys file {missing} does not exist" in done.stderr
    trusted = tmp_path / "trusted_keys"
    trusted.write_text(Authenticator("localhost").line("carol", origin=ORIGIN) + "\n")
    trusted.chmod(0o600)
    with served(url, env={ENV: str(trusted)}) as running:
        assert f"approvals must be signed by a key in {trusted} (1 trusted)" in running.output()
