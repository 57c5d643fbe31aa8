"""Passkeys in a real browser: Debian's Chromium, headless, with a virtual authenticator
(Chrome DevTools' WebAuthn domain through Playwright's CDP session: ctap2, internal,
resident keys, user verification, presence answered at once).

The console is the real command in its own process, opened at http://localhost:PORT
(a passkey belongs to a name, never an IP address). Crews run in processes of their own
(tests/support/crewai/run_gated.py) against the same SQLite ledger with
$CREWAI_IDEMPOTENCY_TRUSTED_KEYS naming a file that holds the line the console showed;
every payment is counted at the fake provider.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("webauthn", reason="the passkeys extra is not installed")

from crewai_idempotent import Approvals, ApprovalState, backend_from_url
from crewai_idempotent.console import Accounts
from crewai_idempotent.signing import ENV, TrustedKeys, verify
from tests.console.test_console_browser import Person, browser  # noqa: F401 - a fixture
from tests.console.test_passkeys import ask
from tests.signing.authenticator import Authenticator
from tests.support.console import PASSWORD, REPO, Served, served
from tests.support.crewai.fixtures import PYTHON, subprocess_env
from tests.support.crewai.provider import FakeProvider

pytestmark = pytest.mark.slow  # a browser, a console server and crews per test


@pytest.fixture
def ledger_url(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    backend = backend_from_url(url)
    for name in ("alice", "bob"):
        Accounts(backend).add(name, "approver", PASSWORD)
    backend.close()
    yield url


@pytest.fixture
def console(ledger_url: str) -> Iterator[Served]:
    with served(ledger_url) as running:
        yield running


@pytest.fixture
def people(browser: Any, console: Served) -> Iterator[Any]:  # noqa: F811 - the fixture
    opened: list[Person] = []
    by_name = console.url.replace("://127.0.0.1:", "://localhost:")

    def person(name: str) -> Person:
        opened.append(Person(browser, by_name))
        someone = opened[-1].login(name)
        # A platform authenticator that holds passkeys and verifies its user at once.
        cdp = someone.context.new_cdp_session(someone.page)
        cdp.send("WebAuthn.enable")
        cdp.send("WebAuthn.addVirtualAuthenticator", {"options": {
            "protocol": "ctap2", "transport": "internal", "hasResidentKey": True,
            "hasUserVerification": True, "isUserVerified": True,
            "automaticPresenceSimulation": True,
        }})  # fmt: skip
        return someone

    yield person
    for p in opened:
        p.close()


@pytest.fixture
def charges(tmp_path: Path) -> FakeProvider:
    return FakeProvider(tmp_path / "charges.jsonl")


def trusting(path: Path, *lines: str) -> Path:
    """A trusted keys file as the workers' deployment writes it: theirs, 0600."""
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    path.chmod(0o600)
    return path


def kickoff(
    ledger_url: str, charges: FakeProvider, invoice: str, trusted: Path, **spec: Any
) -> dict[str, Any]:
    """One run of the payment crew in its own process, trusting the keys in `trusted`."""
    spec = {"provider": str(charges.path), "invoice": invoice, "amount_cents": 90_000, **spec}
    done = subprocess.run(
        [PYTHON, "-m", "tests.support.crewai.run_gated", json.dumps(spec)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env=subprocess_env(
            CREWAI_IDEMPOTENCY_URL=ledger_url, XDG_DATA_HOME=str(charges.path.parent / "xdg"),
            **{ENV: str(trusted)},
        ),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def register(person: Person, label: str) -> str:
    """Register a passkey on the Passkeys page: the trusted keys line it shows."""
    page = person.page
    page.click("header.top >> text=Passkeys")
    page.wait_for_url("**/passkeys")
    page.fill("form.register input[name=label]", label)
    page.click("form.register button")
    page.wait_for_url("**/passkeys?done=registered*")
    line = page.locator("article.passkey.fresh pre.line").inner_text()
    command = page.locator("article.passkey.fresh pre.command").inner_text()
    assert command == f"printf '%s\\n' '{line}' >> \"${ENV}\""
    return line


def approve(person: Person, rid: str, reason: str) -> None:
    page = person.page
    page.goto(f"/approvals/{rid}")
    form = page.locator("form.passkey.approve")
    form.locator("select[name=ttl]").select_option("4h")
    form.locator("input[name=reason]").fill(reason)
    form.locator("button").click()
    page.wait_for_url(f"**/approvals/{rid}?done=approved*")


def script_errors(person: Person) -> list[str]:
    """What went wrong in the page's scripts: the refusals the test provokes on purpose
    are logged by the browser as failed loads, and are not among them."""
    return [e for e in person.errors if not e.startswith("Failed to load resource")]


def _requests(ledger_url: str, state: str = "all") -> list[Any]:
    backend = backend_from_url(ledger_url)
    try:
        return Approvals(backend).list(state)
    finally:
        backend.close()


# Signs with the page's passkey what the console's challenge endpoint of request `asked`
# gives, then posts the decision and its assertion to `target`'s endpoint (the decision
# of `theirs` instead, when given). [status, text of the answer].
SIGN_AND_POST = """async ([asked, target, theirs, verdict]) => {
    const csrf = document.querySelector("form[action='/logout'] input[name=csrf]").value;
    const b = (t) => Uint8Array.from(atob(t.replace(/-/g, "+").replace(/_/g, "/")
        + "===".slice((t.length + 3) % 4)), (c) => c.charCodeAt(0));
    async function challenge(rid) {
        const body = new URLSearchParams({csrf, round: "1", verdict, ttl: "1h",
                                          reason: "signed by the test"});
        const answer = await fetch(`/approvals/${rid}/passkey/challenge`, {method: "POST", body});
        return answer.json();
    }
    const made = await challenge(asked);
    const options = Object.assign({}, made.publicKey, {
        challenge: b(made.publicKey.challenge),
        allowCredentials: made.publicKey.allowCredentials.map(
            (c) => Object.assign({}, c, {id: b(c.id)})),
    });
    const credential = await navigator.credentials.get({publicKey: options});
    const decision = theirs ? (await challenge(theirs)).decision : made.decision;
    const body = new URLSearchParams({csrf, decision: JSON.stringify(decision),
                                      assertion: JSON.stringify(credential.toJSON())});
    const answer = await fetch(`/approvals/${target}/passkey/${verdict}`,
                               {method: "POST", body, redirect: "manual"});
    const main = new DOMParser().parseFromString(await answer.text(), "text/html")
        .querySelector("main");
    return [answer.status, main ? main.innerText : ""];
}"""


def test_a_passkey_registered_in_the_console_approves_a_real_crew_s_payment_once(
    people: Any, ledger_url: str, charges: FakeProvider, tmp_path: Path
) -> None:
    alice = people("alice")
    line = register(alice, "laptop")
    assert line.startswith("approve webauthn ") and " alice credential=" in line
    assert alice.page.locator("p.notice").inner_text().startswith("Registered.")
    trusted = trusting(tmp_path / "trusted_keys", line)
    origin = alice.page.url.split("/passkeys", 1)[0]
    carol = Authenticator("localhost").line("carol", origin=origin)
    elsewhere = trusting(tmp_path / "other_keys", carol)

    asked = kickoff(ledger_url, charges, "INV-31", trusted)
    assert asked["error"] == "ApprovalRequired" and charges.count() == 0
    (request,) = _requests(ledger_url, "pending")
    approve(alice, request.id, "invoice checked against the contract")
    assert (
        "the next run of this call goes ahead, once" in alice.page.locator(".notice").inner_text()
    )
    (decided,) = _requests(ledger_url)
    assert decided.state is ApprovalState.APPROVED and decided.decided_by == "alice"
    (entry,) = decided.approvals
    assert verify(entry["decision"], entry["signature"], TrustedKeys.from_file(trusted))

    # A worker that does not trust this passkey (its file names someone else's) runs
    # nothing, and the request is asked again: a new round, which alice signs again.
    refused = kickoff(ledger_url, charges, "INV-31", elsewhere)
    assert refused["error"] == "DecisionRefused" and "untrusted-key" in refused["message"]
    assert charges.count() == 0
    (again_asked,) = _requests(ledger_url, "pending")
    assert again_asked.round == 2
    approve(alice, request.id, "checked again")
    # The workers that hold the line verify the signature and pay, once.
    paid = kickoff(ledger_url, charges, "INV-31", trusted)
    again = kickoff(ledger_url, charges, "INV-31", trusted)
    (charge,) = charges.effects("charge")
    assert charge["invoice"] == "INV-31" and charge["receipt"] in paid["raw"]
    assert charge["receipt"] in again["raw"]  # replayed: counted once at the provider
    assert alice.dialogs == [] and alice.errors == []


def test_one_passkey_counts_once_and_a_second_person_s_makes_two(
    people: Any, ledger_url: str, charges: FakeProvider, tmp_path: Path
) -> None:
    alice, bob = people("alice"), people("bob")
    lines = [register(alice, "alice's laptop"), register(bob, "bob's key")]
    trusted = trusting(tmp_path / "trusted_keys", *lines)
    asked = kickoff(ledger_url, charges, "INV-32", trusted, approvers=2)
    assert asked["error"] == "ApprovalRequired"
    (request,) = _requests(ledger_url, "pending")

    approve(alice, request.id, "checked")
    assert "1 more distinct approver(s) needed" in alice.page.locator(".notice").inner_text()
    assert alice.page.locator("form.passkey.approve").count() == 0
    # The same passkey signs a second approval of the same round: not counted.
    status, text = alice.page.evaluate(SIGN_AND_POST, [request.id, request.id, None, "approve"])
    assert status == 409 and "already approved" in text and "Nothing was decided" in text
    (waiting,) = _requests(ledger_url)
    assert waiting.state is ApprovalState.PENDING and len(waiting.approvals) == 1
    still = kickoff(ledger_url, charges, "INV-32", trusted, approvers=2)
    assert still["error"] == "ApprovalRequired" and "1 of 2 approvers" in still["message"]
    assert charges.count() == 0

    approve(bob, request.id, "checked too")
    (decided,) = _requests(ledger_url)
    assert decided.state is ApprovalState.APPROVED and decided.decided_by == "alice, bob"
    kickoff(ledger_url, charges, "INV-32", trusted, approvers=2)
    kickoff(ledger_url, charges, "INV-32", trusted, approvers=2)
    assert [c["invoice"] for c in charges.effects("charge")] == ["INV-32"]
    assert script_errors(alice) == [] and script_errors(bob) == []


def test_an_assertion_for_another_call_s_challenge_is_refused(people: Any, ledger_url: str) -> None:
    backend = backend_from_url(ledger_url)
    first, other = ask(backend, "INV-33"), ask(backend, "INV-34")
    backend.close()
    alice = people("alice")
    register(alice, "laptop")
    alice.page.goto(f"/approvals/{first}")
    # The first request's decision and assertion, posted to the other request.
    status, text = alice.page.evaluate(SIGN_AND_POST, [first, other, None, "approve"])
    assert status == 403 and f"not this one to approve {other}" in text
    # The other request's own decision, with the assertion made for the first one.
    status, text = alice.page.evaluate(SIGN_AND_POST, [first, other, other, "approve"])
    assert status == 403 and "(challenge)" in text and "Nothing was decided" in text
    assert {r.id: r.state for r in _requests(ledger_url)} == {
        first: ApprovalState.PENDING,
        other: ApprovalState.PENDING,
    }
    # The flow itself works on that page: the other request, signed for itself.
    status, _ = alice.page.evaluate(SIGN_AND_POST, [other, other, None, "approve"])
    assert status in (0, 303)  # an opaque redirect: recorded
    assert {r.id: r.state for r in _requests(ledger_url)}[other] is ApprovalState.APPROVED
    assert script_errors(alice) == []
