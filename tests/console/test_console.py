"""The web console over HTTP, in process (Starlette's test client): who may do what, what
every response carries, and that a refused request changes nothing in the ledger.

Decisions are read back from the ledger (`Approvals.get`, records), never from page text
alone. The browser tests (tests/console/test_console_browser.py) run the same console in Chromium.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the console extra is not installed")

from starlette.testclient import TestClient

from crewai_idempotent import (
    CacheBackend,
    InMemoryCacheBackend,
    Ledger,
    OutcomeUncertain,
    OutcomeUnknown,
    Status,
    backend_from_url,
)
from crewai_idempotent.console import (
    Accounts,
    ConsoleSettings,
    _slack,
    create_app,
    sweeping,
)
from crewai_idempotent.console._live import Watcher
from crewai_idempotent.gates._approvals import Approvals, ApprovalState
from tests.support.console import PASSWORD, ask, csrf_of, login

BASE = "http://127.0.0.1"
SECRET = "8f742231b10e8888abcd99yyyzzz85a5"


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[CacheBackend]:
    store = backend_from_url(f"sqlite:///{tmp_path / 'ledger.db'}")
    accounts = Accounts(store)
    accounts.add("alice", "approver", PASSWORD, slack_user="UALICE01")
    accounts.add("bob", "approver", PASSWORD)
    accounts.add("victor", "viewer", PASSWORD, slack_user="UVICTOR1")
    accounts.add("olga", "operator", PASSWORD)
    accounts.add("pat@example.com", "approver", None)
    yield store
    store.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _client(backend: CacheBackend, clock: Clock | None = None, **settings: Any) -> TestClient:
    options: dict[str, Any] = {"client": settings.pop("client", ("127.0.0.1", 50000))}
    app = create_app(backend, ConsoleSettings(**settings), clock=clock or Clock())
    return TestClient(app, base_url=settings.get("public_url") or BASE, **options)


@pytest.fixture
def client(backend: CacheBackend, clock: Clock) -> Iterator[TestClient]:
    with _client(backend, clock, slack_signing_secret=SECRET) as c:
        yield c


def _as(client: TestClient, name: str) -> TestClient:
    client.cookies.clear()
    assert login(client, name).status_code == 303
    return client


def _state(backend: CacheBackend, rid: str) -> ApprovalState:
    return Approvals(backend).get(rid).state


# -- logging in -----------------------------------------------------------------------------


def test_pages_need_a_login_and_the_session_cookie_is_strict(client: TestClient) -> None:
    first = client.get("/approvals", follow_redirects=False)
    assert first.status_code == 303 and first.headers["location"] == "/login?next=%2Fapprovals"
    answer = login(client, "alice")
    assert answer.status_code == 303 and answer.headers["location"] == "/approvals"
    cookie = next(
        c for c in answer.headers.get_list("set-cookie") if c.startswith("crewai_console=")
    )
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    assert "Secure" not in cookie  # plain HTTP on loopback: a Secure cookie would never come back
    assert client.get("/approvals").status_code == 200
    logout = client.post("/logout", data={"csrf": csrf_of(client.get("/approvals").text)},
                         follow_redirects=False)  # fmt: skip
    assert logout.status_code == 303
    assert client.get("/approvals", follow_redirects=False).status_code == 303


def test_the_ledger_is_named_only_to_someone_logged_in(
    backend: CacheBackend, client: TestClient
) -> None:
    """Its URL names a host, a file, a user: not for whoever reaches the login page."""
    ledger = backend.url  # type: ignore[attr-defined]
    path = ledger.split(":///", 1)[1]
    for answer in (
        client.get("/login"),  # the login page
        client.get("/events"),  # 401: not logged in
        client.post("/logout", data={"csrf": "x"}),  # 401 too
        login(client, "alice", "not the password"),  # 401: wrong password
    ):
        assert answer.status_code in (200, 401), answer.text
        assert ledger not in answer.text and path not in answer.text, answer.status_code
    assert "console users add" not in client.get("/login").text  # no command without --ledger
    assert login(client, "alice").status_code == 303
    assert f"ledger <code>{ledger}</code>" in client.get("/approvals").text


def test_wrong_passwords_say_nothing_about_which_part_was_wrong(client: TestClient) -> None:
    for name, password in (("alice", "wrong password!"), ("nobody", PASSWORD),
                           ("pat@example.com", PASSWORD)):  # fmt: skip
        answer = login(client, name, password)
        assert answer.status_code == 401 and "Wrong name or password." in answer.text
    assert client.get("/approvals", follow_redirects=False).status_code == 303


def test_login_is_throttled_per_name_and_address(
    backend: CacheBackend, client: TestClient, clock: Clock
) -> None:
    for _ in range(5):
        assert login(client, "alice", "not the password").status_code == 401
    throttled = login(client, "alice")  # the right password, but too soon
    assert throttled.status_code == 429 and "Too many failed logins" in throttled.text
    assert int(throttled.headers["retry-after"]) > 0
    assert login(client, "bob").status_code == 303  # another name from here still may
    client.cookies.clear()
    clock.now += 901  # the window passes
    assert login(client, "alice").status_code == 303


def test_address_limit_holds_across_names(backend: CacheBackend, clock: Clock) -> None:
    with _client(backend, clock, login_failures_per_address=3) as c:
        for name in ("a1", "a2", "a3"):
            assert login(c, name, "guess guess guess").status_code == 401
        assert login(c, "alice").status_code == 429


def test_login_needs_its_form_token_and_next_stays_on_the_console(client: TestClient) -> None:
    refused = client.post("/login", data={"name": "alice", "password": PASSWORD},
                          follow_redirects=False)  # fmt: skip
    assert refused.status_code == 403
    page = client.get("/login?next=//evil.example/steal")
    token = re.search(r'name="login_csrf" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
    answer = client.post("/login?next=//evil.example/steal",
                         data={"login_csrf": token, "name": "alice", "password": PASSWORD},
                         follow_redirects=False)  # fmt: skip
    assert answer.status_code == 303 and answer.headers["location"] == "/approvals"


def test_a_password_change_or_removal_ends_sessions_and_a_role_change_applies(
    backend: CacheBackend, client: TestClient
) -> None:
    rid = ask(backend, "inv-role", {"amount_cents": 100})
    _as(client, "bob")
    assert "/approve" in client.get("/approvals").text
    Accounts(backend).set("bob", role="viewer")
    assert "/approve" not in client.get("/approvals").text  # at the next request
    Accounts(backend).set_password("bob", "another good password")
    assert client.get("/approvals", follow_redirects=False).status_code == 303
    _as(client, "olga")
    Accounts(backend).remove("olga")
    assert client.get("/approvals", follow_redirects=False).status_code == 303
    assert _state(backend, rid) is ApprovalState.PENDING


# -- what every response carries ------------------------------------------------------------


class _Inline(HTMLParser):
    """Anything that would run or style inline: <script> without src, on* handlers,
    style attributes, javascript: URLs."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = dict(attrs)
        if tag == "script" and not names.get("src"):
            self.found.append("inline <script>")
        if tag == "style":
            self.found.append("<style>")
        for name, value in attrs:
            if name.startswith("on") or name == "style":
                self.found.append(f"{tag} {name}=")
            if name in ("href", "src", "action") and (value or "").lower().startswith(
                "javascript:"
            ):
                self.found.append(f"{tag} {name}=javascript:")


def test_every_page_has_the_strict_policy_and_no_inline_code(
    backend: CacheBackend, client: TestClient
) -> None:
    hostile = (
        "<script>alert(1)</script><img src=x onerror=alert(1)><a href='javascript:alert(1)'>x</a>"
    )
    rid = ask(backend, "inv-xss", {"memo": hostile, "amount_cents": 1})
    Ledger(backend).run("charge:x", lambda: {"receipt": hostile})
    _as(client, "olga")
    pages = ["/login", "/approvals", f"/approvals/{rid}", "/uncertain", "/records", "/spend",
             "/record?key=charge%3Ax", "/notifications", "/nowhere"]  # fmt: skip
    for path in pages:
        answer = client.get(path)
        policy = answer.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "default-src 'none'" in policy, path
        assert "frame-ancestors 'none'" in policy and "form-action 'self'" in policy
        assert answer.headers["x-content-type-options"] == "nosniff"
        if answer.headers.get("content-type", "").startswith("text/html"):
            assert answer.headers["cache-control"] == "no-store", path
            parser = _Inline()
            parser.feed(answer.text)
            assert parser.found == [], (path, parser.found)
    page = client.get(f"/approvals/{rid}").text
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page


def test_hidden_characters_are_shown_not_obeyed(backend: CacheBackend, client: TestClient) -> None:
    rid = ask(backend, "inv-bidi", {"iban": "DE89\u202e3704\u2066 0044\u200b", "note": "a\x1bb"})
    _as(client, "alice")
    page = client.get(f"/approvals/{rid}").text
    for code in ("U+202E", "U+2066", "U+200B", "U+001B"):
        assert f'<span class="hidden-char" title="an invisible character">{code}</span>' in page
    assert "\u202e" not in page and "\u2066" not in page and "\x1b" not in page


def test_unknown_hosts_and_large_bodies_are_refused(backend: CacheBackend) -> None:
    app = create_app(backend, ConsoleSettings())
    with TestClient(app, base_url="http://rebound.example") as c:
        answer = c.get("/login")
        assert answer.status_code == 400 and "--allowed-host" in answer.text
    with TestClient(app, base_url=BASE) as c:
        assert c.post("/login", content=b"x" * (300 * 1024)).status_code == 413
    with TestClient(create_app(backend, ConsoleSettings(allowed_hosts=("ops.internal",))),
                    base_url="http://ops.internal:8765") as c:  # fmt: skip
        assert c.get("/login").status_code == 200


# -- deciding ---------------------------------------------------------------------------------


def test_an_approver_approves_with_a_ttl_and_the_decision_is_theirs(
    backend: CacheBackend, client: TestClient
) -> None:
    rid = ask(backend, "inv-ok", {"invoice": "INV-9", "amount_cents": 90_000})
    _as(client, "alice")
    page = client.get("/approvals").text
    assert "INV-9" in page and "90000" in page and "Payables" in page and "Cashier" in page
    answer = client.post(f"/approvals/{rid}/approve", data={
        "csrf": csrf_of(page), "round": "1", "ttl": "4h", "reason": "invoice checked",
        "by": "the CFO",  # a typed name is ignored: the decision is the session's
    }, follow_redirects=False)  # fmt: skip
    assert answer.status_code == 303 and answer.headers["location"].startswith("/approvals?done=")
    request = Approvals(backend).get(rid)
    assert request.state is ApprovalState.APPROVED and request.decided_by == "alice"
    assert request.history[-1]["via"] == "console" and request.decision_reason == "invoice checked"
    assert request.grant_expires_at == pytest.approx(backend.now() + 4 * 3600, abs=30)
    assert "the next run of this call goes ahead" in client.get(answer.headers["location"]).text


def test_deny_needs_a_reason(backend: CacheBackend, client: TestClient) -> None:
    rid = ask(backend, "inv-deny", {"amount_cents": 5})
    _as(client, "bob")
    csrf = csrf_of(client.get("/approvals").text)
    empty = client.post(f"/approvals/{rid}/deny", data={"csrf": csrf, "round": "1", "reason": " "})
    assert empty.status_code == 409 and _state(backend, rid) is ApprovalState.PENDING
    client.post(f"/approvals/{rid}/deny", data={"csrf": csrf, "round": "1", "reason": "duplicate"})
    request = Approvals(backend).get(rid)
    assert request.state is ApprovalState.DENIED and request.decided_by == "bob"


def test_a_viewer_sees_no_form_and_a_forged_post_is_refused(
    backend: CacheBackend, client: TestClient
) -> None:
    rid = ask(backend, "inv-viewer", {"amount_cents": 5})
    _as(client, "victor")
    page = client.get("/approvals").text
    assert "inv-viewer" in page and "<form" in page  # the log-out form only
    assert "/approve" not in page and "/deny" not in page and "/record/resolve" not in page
    csrf = csrf_of(page)
    forged = client.post(f"/approvals/{rid}/approve",
                         data={"csrf": csrf, "round": "1", "ttl": "1h"})  # fmt: skip
    assert forged.status_code == 403 and "victor is a viewer" in forged.text
    assert _state(backend, rid) is ApprovalState.PENDING


def test_an_approver_may_not_resolve_or_purge(backend: CacheBackend, client: TestClient) -> None:
    _uncertain(backend, "charge:u1")
    _as(client, "alice")
    csrf = csrf_of(client.get("/uncertain").text)
    refused = client.post("/record/resolve", data={"csrf": csrf, "key": "charge:u1", "token": "1",
                          "verdict": "absent", "reason": "not there"})  # fmt: skip
    assert refused.status_code == 403
    assert client.post("/records/purge", data={"csrf": csrf}).status_code == 403
    assert Ledger(backend).get("charge:u1").status is Status.UNCERTAIN  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": "http://evil.example"},
        {"origin": "null"},
        {"sec-fetch-site": "cross-site"},
        {"sec-fetch-site": "same-site"},
        {"referer": "http://evil.example/page"},
    ],
    ids=["origin", "null-origin", "fetch-cross-site", "fetch-same-site", "referer"],
)
def test_a_post_from_another_origin_changes_nothing(
    backend: CacheBackend, client: TestClient, headers: dict[str, str]
) -> None:
    rid = ask(backend, "inv-origin", {"amount_cents": 5})
    _as(client, "alice")
    csrf = csrf_of(client.get("/approvals").text)  # even with the right token
    answer = client.post(f"/approvals/{rid}/approve", headers=headers,
                         data={"csrf": csrf, "round": "1", "ttl": "1h"})  # fmt: skip
    assert answer.status_code == 403 and "not sent from the console" in answer.text
    assert _state(backend, rid) is ApprovalState.PENDING


@pytest.mark.parametrize("token", [None, "", "x" * 43])
def test_a_post_without_the_csrf_token_changes_nothing(
    backend: CacheBackend, client: TestClient, token: str | None
) -> None:
    rid = ask(backend, "inv-csrf", {"amount_cents": 5})
    _as(client, "alice")
    data = {"round": "1", "ttl": "1h"} | ({} if token is None else {"csrf": token})
    answer = client.post(f"/approvals/{rid}/approve", data=data,
                         headers={"origin": BASE})  # fmt: skip
    assert answer.status_code == 403 and "security token" in answer.text
    assert _state(backend, rid) is ApprovalState.PENDING


def test_a_page_showing_round_one_cannot_approve_round_two(
    backend: CacheBackend, client: TestClient
) -> None:
    rid = ask(backend, "inv-round", {"amount_cents": 5})
    _as(client, "alice")
    csrf = csrf_of(client.get("/approvals").text)
    Approvals(backend).approve(rid, by="bob", ttl_s=60)
    Approvals(backend).deny(rid, by="bob", reason="changed my mind")
    answer = client.post(
        f"/approvals/{rid}/approve", data={"csrf": csrf, "round": "2", "ttl": "1h"}
    )
    assert answer.status_code == 409 and "round 1 now, not 2" in answer.text
    assert _state(backend, rid) is ApprovalState.DENIED


def test_two_person_rule_in_the_console(backend: CacheBackend, client: TestClient) -> None:
    rid = ask(backend, "inv-2p", {"amount_cents": 500_000}, approvers=2)
    _as(client, "alice")
    page = client.get("/approvals").text
    assert "Needs 2 distinct approvers: 0 so far" in page
    client.post(
        f"/approvals/{rid}/approve", data={"csrf": csrf_of(page), "round": "1", "ttl": "1h"}
    )
    assert _state(backend, rid) is ApprovalState.PENDING
    page = client.get("/approvals").text
    assert "You approved this round; another approver must approve" in page
    again = client.post(f"/approvals/{rid}/approve",
                        data={"csrf": csrf_of(page), "round": "1", "ttl": "1h"})  # fmt: skip
    assert again.status_code == 409 and "alice has already approved" in again.text
    assert _state(backend, rid) is ApprovalState.PENDING
    _as(client, "bob")
    page = client.get("/approvals").text
    assert "1 so far (alice via console)" in page
    client.post(
        f"/approvals/{rid}/approve", data={"csrf": csrf_of(page), "round": "1", "ttl": "1h"}
    )
    request = Approvals(backend).get(rid)
    assert request.state is ApprovalState.APPROVED and request.decided_by == "alice, bob"


def test_what_changed_since_the_earlier_request_of_the_key(
    backend: CacheBackend, client: TestClient
) -> None:
    first = ask(backend, "inv-diff", {"invoice": "INV-5", "amount_cents": 90_000, "iban": "DE1"})
    Approvals(backend).deny(first, by="bob", reason="too much")
    second = ask(backend, "inv-diff", {"invoice": "INV-5", "amount_cents": 45_000, "memo": "half"})
    _as(client, "alice")
    page = client.get(f"/approvals/{second}").text
    assert "Changed since the earlier request for this key" in page and first in page
    assert "too much" in page
    rows = re.findall(
        r'<tr class="(changed|added|removed)"><th scope="row"><code>(\w+)</code>', page
    )
    assert sorted(rows) == [("added", "memo"), ("changed", "amount_cents"), ("removed", "iban")]


# -- records ----------------------------------------------------------------------------------


def _uncertain(backend: CacheBackend, key: str) -> None:
    def unknown() -> None:
        raise OutcomeUnknown("the provider did not answer")

    with pytest.raises((OutcomeUnknown, OutcomeUncertain)):
        Ledger(backend).run(key, unknown)
    assert Ledger(backend).get(key).status is Status.UNCERTAIN  # type: ignore[union-attr]


def test_an_operator_resolves_an_uncertain_record_with_the_receipt(
    backend: CacheBackend, client: TestClient
) -> None:
    _uncertain(backend, "charge:u2")
    _uncertain(backend, "charge:u3")
    _as(client, "olga")
    page = client.get("/uncertain").text
    assert "charge:u2" in page and "the provider did not answer" in page and "History" in page
    csrf = csrf_of(page)
    bad = client.post("/record/resolve", data={"csrf": csrf, "key": "charge:u2", "token": "1",
                      "verdict": "happened", "receipt_kind": "json", "receipt": "{nope",
                      "reason": "in the dashboard"})  # fmt: skip
    assert bad.status_code == 409 and "not JSON" in bad.text
    stale = client.post("/record/resolve", data={"csrf": csrf, "key": "charge:u2", "token": "7",
                        "verdict": "absent", "reason": "x"})  # fmt: skip
    assert stale.status_code == 409 and "changed since the page was shown" in stale.text
    done = client.post("/record/resolve", data={"csrf": csrf, "key": "charge:u2", "token": "1",
                       "verdict": "happened", "receipt_kind": "json",
                       "receipt": '{"id": "ch_42"}', "reason": "ch_42 in the dashboard"},
                       follow_redirects=False)  # fmt: skip
    assert done.status_code == 303
    record = Ledger(backend).get("charge:u2")
    assert record is not None and record.status is Status.COMMITTED
    assert record.value() == {"id": "ch_42"} and record.history[-1].by == "olga"
    assert Ledger(backend).run("charge:u2", lambda: pytest.fail("ran again")) == {"id": "ch_42"}
    client.post("/record/resolve", data={"csrf": csrf, "key": "charge:u3", "token": "1",
                "verdict": "absent", "reason": "no such charge"})  # fmt: skip
    assert Ledger(backend).get("charge:u3").status is Status.FAILED  # type: ignore[union-attr]
    assert "No record is uncertain." in client.get("/uncertain").text


def test_records_filter_by_status_tool_and_age_and_hide_the_console(
    backend: CacheBackend, client: TestClient
) -> None:
    ledger = Ledger(backend)
    ledger.run("charge_card:1", lambda: "r1")
    ledger.run("send_mail:1", lambda: "m1")
    _uncertain(backend, "charge_card:2")
    _as(client, "victor")
    found = client.get("/records?tool=charge_card").text
    assert "charge_card:1" in found and "charge_card:2" in found and "send_mail:1" not in found
    uncertain = client.get("/records?status=uncertain").text
    assert "charge_card:2" in uncertain and "charge_card:1" not in uncertain
    assert "charge_card:1" not in client.get("/records?older=1h").text
    assert "charge_card:1" in client.get("/records?newer=1h").text
    assert client.get("/records?older=soon").status_code == 400
    everything = client.get("/records?documents=1").text
    assert "console/accounts" not in everything and "console/session" not in everything
    assert client.get("/record?key=crewai-idempotent/console/accounts").status_code == 404
    record = client.get("/record?key=charge_card%3A2").text
    assert "OutcomeUnknown" in record or "did not answer" in record


def test_an_operator_purges_expired_receipts_only(
    backend: CacheBackend, client: TestClient
) -> None:
    ledger = Ledger(backend, ttl=60)
    ledger.run("old:1", lambda: 1)
    rid = ask(backend, "inv-keep", {"amount_cents": 5})
    _as(client, "olga")
    time_passes = backend.now() + 120
    record = backend.get("old:1")
    assert record is not None
    backend.replace(record, record.evolve(None, expires_at=time_passes - 240))
    answer = client.post("/records/purge", data={"csrf": csrf_of(client.get("/records").text)},
                         follow_redirects=False)  # fmt: skip
    assert answer.status_code == 303 and "n=1" in answer.headers["location"]
    assert backend.get("old:1") is None and _state(backend, rid) is ApprovalState.PENDING


def test_spend_shows_each_cap_and_window(backend: CacheBackend, client: TestClient) -> None:
    from crewai_idempotent.gates._plan import Plan
    from crewai_idempotent.gates._spend import Money, SpendCap

    cap = SpendCap(100_000, "EUR", per="day")
    plan = Plan(tool="pay", fingerprint="fp", amount=Money(12_345, "EUR"), caps=[("pay", cap)])
    Ledger(backend).run("pay:1", lambda: "ok", fingerprint="fp", stage=plan)
    _as(client, "victor")
    page = client.get("/spend").text
    assert "pay/day-EUR" in page and "1,000.00 EUR" in page and "123.45 EUR" in page
    assert "876.55 EUR" in page and "<meter" in page


# -- the auth proxy ---------------------------------------------------------------------------


def test_proxy_identity_is_believed_only_from_the_proxy(backend: CacheBackend) -> None:
    rid = ask(backend, "inv-proxy", {"amount_cents": 5})
    settings = {"auth": "proxy", "trusted_proxies": ("10.1.2.3",)}
    with _client(backend, client=("10.1.2.3", 4000), **settings) as proxied:
        page = proxied.get("/approvals", headers={"x-forwarded-email": "pat@example.com"})
        assert page.status_code == 200 and "pat@example.com · approver" in page.text
        assert (
            "Log out" not in page.text
            and proxied.get("/login", follow_redirects=False).status_code == 303
        )
        answer = proxied.post(f"/approvals/{rid}/approve", headers={
            "x-forwarded-email": "pat@example.com"}, data={"csrf": csrf_of(page.text),
            "round": "1", "ttl": "1h"}, follow_redirects=False)  # fmt: skip
        assert answer.status_code == 303
        request = Approvals(backend).get(rid)
        assert (
            request.decided_by == "pat@example.com" and request.history[-1]["via"] == "auth proxy"
        )
        # Another identity through the same proxy gets a session of its own.
        other = proxied.get("/approvals", headers={"x-forwarded-email": "alice"})
        assert "alice · approver" in other.text
        missing = proxied.get("/approvals")
        assert missing.status_code == 401 and "X-Forwarded-Email" in missing.text
        stranger = proxied.get("/approvals", headers={"x-forwarded-email": "eve@example.com"})
        assert stranger.status_code == 403 and "has no console account" in stranger.text
    with _client(backend, client=("10.9.9.9", 4000), **settings) as direct:
        refused = direct.get("/approvals", headers={"x-forwarded-email": "pat@example.com"})
        assert refused.status_code == 403 and "directly" in refused.text


def test_with_the_auth_proxy_an_account_with_a_password_is_accepted_too(
    backend: CacheBackend,
) -> None:
    """docs/console.md says so: the proxy's login is the one that counts; the password is
    unused there, and a stranger's 403 names no ledger."""
    settings = {"auth": "proxy", "trusted_proxies": ("10.1.2.3",)}
    with _client(backend, client=("10.1.2.3", 4000), **settings) as proxied:
        page = proxied.get("/approvals", headers={"x-forwarded-email": "olga"})
        assert page.status_code == 200 and "olga · operator · auth proxy" in page.text
        stranger = proxied.get("/approvals", headers={"x-forwarded-email": "eve@example.com"})
        assert stranger.status_code == 403 and "has no console account" in stranger.text
        assert backend.url not in stranger.text  # type: ignore[attr-defined]
        assert "crewai-idempotent console users add" not in stranger.text
    docs = " ".join(
        (Path(__file__).resolve().parents[2] / "docs" / "console.md").read_text().split()
    )
    assert "An account that also has a password is accepted through the header too" in docs


def test_forwarded_headers_count_only_from_trusted_proxies(
    backend: CacheBackend, clock: Clock
) -> None:
    tls = {"x-forwarded-proto": "https", "x-forwarded-for": "203.0.113.7"}
    with _client(backend, clock, client=("10.1.2.3", 1), trusted_proxies=("10.1.2.0/24",),
                 public_url="https://approvals.example.com") as behind:  # fmt: skip
        cookie = login_cookie(behind, tls)
        assert cookie.startswith("__Host-crewai_console=") and "Secure" in cookie
        assert "strict-transport-security" in behind.get("/login", headers=tls).headers
    with _client(backend, clock, client=("192.0.2.1", 1)) as untrusted:
        cookie = login_cookie(untrusted, tls)
        assert cookie.startswith("crewai_console=") and "Secure" not in cookie


def login_cookie(client: TestClient, headers: dict[str, str]) -> str:
    page = client.get("/login", headers=headers)
    token = re.search(r'name="login_csrf" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
    form = {"login_csrf": token, "name": "alice", "password": PASSWORD}
    answer = client.post("/login", headers=headers, data=form, follow_redirects=False)
    assert answer.status_code == 303, answer.text
    return next(c for c in answer.headers.get_list("set-cookie") if "crewai_console=" in c)


def test_proxy_mode_needs_trusted_proxies() -> None:
    with pytest.raises(ValueError, match="needs trusted_proxies"):
        ConsoleSettings(auth="proxy")
    with pytest.raises(ValueError, match="not an IP address"):
        ConsoleSettings(trusted_proxies=("proxy.local",))
    with pytest.raises(ValueError, match="without a path"):
        ConsoleSettings(public_url="https://example.com/approvals")


# -- Slack ------------------------------------------------------------------------------------


def _click(rid: str, round_: int = 1, user: str = "UALICE01", approve: bool = True,
           team: str = "T1", response_url: str = "") -> bytes:  # fmt: skip
    action = _slack.APPROVE if approve else _slack.DENY
    payload = {"type": "block_actions", "user": {"id": user}, "team": {"id": team},
               "actions": [{"action_id": action, "value": f"{rid}:{round_}"}],
               "response_url": response_url}  # fmt: skip
    from urllib.parse import urlencode

    return urlencode({"payload": json.dumps(payload)}).encode()


def _signed(body: bytes, at: float | None = None, secret: str = SECRET) -> dict[str, str]:
    stamp = str(int(time.time() if at is None else at))
    return {
        "x-slack-request-timestamp": stamp,
        "x-slack-signature": _slack.signature(secret, stamp, body),
        "content-type": "application/x-www-form-urlencoded",
    }


def test_a_signed_slack_click_approves_as_the_linked_account(
    backend: CacheBackend, client: TestClient
) -> None:
    rid = ask(backend, "inv-slack", {"amount_cents": 5})
    body = _click(rid)
    answer = client.post("/slack/interactive", content=body, headers=_signed(body))
    assert answer.status_code == 200
    request = Approvals(backend).get(rid)
    assert request.state is ApprovalState.APPROVED and request.decided_by == "alice"
    assert request.history[-1]["via"] == "slack"


@pytest.mark.parametrize("case", ["stale", "future", "forged", "other-secret", "unsigned",
                                  "unmapped", "viewer", "old-round", "tampered"])  # fmt: skip
def test_a_slack_post_that_is_not_right_changes_nothing(
    backend: CacheBackend, client: TestClient, case: str
) -> None:
    rid = ask(backend, "inv-slack-no", {"amount_cents": 5})
    body = _click(rid, user={"unmapped": "UNOBODY1", "viewer": "UVICTOR1"}.get(case, "UALICE01"),
                  round_=2 if case == "old-round" else 1)  # fmt: skip
    headers = _signed(body)
    if case == "stale":
        headers = _signed(body, time.time() - 301)
    elif case == "future":
        # Past the window by more than the stamp's truncation to whole seconds and the
        # time a loaded machine takes to deliver the post (301 s was accepted once).
        headers = _signed(body, time.time() + 360)
    elif case == "forged":
        headers["x-slack-signature"] = "v0=" + "0" * 64
    elif case == "other-secret":
        headers = _signed(body, secret="another-secret-of-32-characters!")
    elif case == "unsigned":
        del headers["x-slack-signature"]
    elif case == "tampered":
        body = _click(rid, approve=False)  # signed the approval, sends a denial
    answer = client.post("/slack/interactive", content=body, headers=headers)
    expected = 200 if case in ("unmapped", "viewer", "old-round") else 401
    assert answer.status_code == expected
    assert _state(backend, rid) is ApprovalState.PENDING


def test_slack_answers_the_clicker_and_refuses_other_workspaces(
    backend: CacheBackend, clock: Clock
) -> None:
    heard: list[dict[str, Any]] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            heard.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hook = f"http://127.0.0.1:{server.server_port}/hooks/"
    rid = ask(backend, "inv-hook", {"amount_cents": 5})
    try:
        with _client(backend, clock, slack_signing_secret=SECRET, slack_team="T1",
                     slack_response_prefix=hook) as c:  # fmt: skip
            other = _click(rid, team="T2", response_url=hook + "1")
            assert (
                c.post("/slack/interactive", content=other, headers=_signed(other)).status_code
                == 200
            )
            assert _state(backend, rid) is ApprovalState.PENDING
            body = _click(rid, response_url=hook + "2")
            c.post("/slack/interactive", content=body, headers=_signed(body))
            elsewhere = _click(rid, response_url="http://169.254.169.254/latest")
            c.post("/slack/interactive", content=elsewhere, headers=_signed(elsewhere))
    finally:
        server.shutdown()
    assert _state(backend, rid) is ApprovalState.APPROVED
    texts = [h["text"] for h in heard]
    assert len(texts) == 2 and "another Slack workspace" in texts[0]
    assert texts[1].startswith(f"Approved {rid} as alice")
    assert all(h["response_type"] == "ephemeral" for h in heard)


def test_slack_is_off_without_a_signing_secret(backend: CacheBackend) -> None:
    with _client(backend) as c:
        assert c.post("/slack/interactive", content=b"payload=%7B%7D").status_code == 404


def test_the_buttons_name_the_request_and_its_round(backend: CacheBackend) -> None:
    rid = ask(backend, "inv-block", {"amount_cents": 5})
    block = _slack.actions_block(Approvals(backend).get(rid))
    values = {e["action_id"]: e["value"] for e in block["elements"]}
    assert values == {_slack.APPROVE: f"{rid}:1", _slack.DENY: f"{rid}:1"}


# -- live updates -----------------------------------------------------------------------------


def test_the_event_stream_says_changed_when_the_ledger_moves(backend: CacheBackend) -> None:
    watcher = Watcher(backend, refresh_s=0.05)

    async def main() -> list[bytes]:
        runner = asyncio.create_task(watcher.run())
        stream = watcher.stream(lambda: True)
        got = [await anext(stream)]
        await asyncio.to_thread(Ledger(backend).run, "charge:live", lambda: "r")
        got.append(await asyncio.wait_for(anext(stream), 60))
        await stream.aclose()
        runner.cancel()
        return got

    first, changed = asyncio.run(main())
    assert first.startswith(b"retry:") and changed.startswith(b"event: changed\n")
    assert watcher.listeners == 0 and not watcher.pages


def test_live_updates_survive_pages_coming_and_going_at_any_moment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pages open and close (their streams cancelled) at every point of a stream's wait
    while the ledger changes; afterwards a new page still hears of the next change, and no
    stream failed. A stream's wait used to hold a Condition's lock: one cancelled at the
    wrong moment released a lock it no longer held ("Lock is not acquired"), the lock stayed
    taken, and no page was told of a change again until the console restarted."""
    from crewai_idempotent.console import _live

    monkeypatch.setattr(_live, "HEARTBEAT_S", 0.0005)  # a wait ends every few steps
    # In memory: the race is the streams', and every page opening reads the ledger once on
    # a thread, which on a busy machine's SQLite file would make the storm crawl.
    backend = InMemoryCacheBackend()
    watcher = _live.Watcher(backend, refresh_s=0.001)
    ledger = Ledger(backend)
    failures: list[str] = []

    async def page() -> None:
        try:
            async for _ in watcher.stream(lambda: True):
                pass
        except Exception as exc:  # noqa: BLE001 - every failure is the finding
            failures.append(repr(exc))

    async def main() -> bytes:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: failures.append(context["message"]))
        runner = asyncio.create_task(watcher.run())
        chance = random.Random(7)
        pages: list[asyncio.Task[None]] = []
        for i in range(700):
            pages.append(asyncio.create_task(page()))
            if i % 5 == 0:
                ledger.run(f"charge:storm-{i}", lambda: "r")
            for _ in range(chance.randrange(3)):
                if pages:
                    pages.pop(chance.randrange(len(pages))).cancel()
            await asyncio.sleep(chance.choice([0, 0, 0.0003, 0.0007]))
        for task in pages:
            task.cancel()
        await asyncio.wait_for(asyncio.gather(*pages, return_exceptions=True), 300)
        fresh = watcher.stream(lambda: True)
        await asyncio.wait_for(anext(fresh), 120)
        await asyncio.to_thread(ledger.run, "charge:after-the-storm", lambda: "r")
        heard = b""
        while not heard.startswith(b"event: changed"):
            heard = await asyncio.wait_for(anext(fresh), 120)  # a hang, not a time bound
        await fresh.aclose()
        runner.cancel()
        return heard

    assert asyncio.run(main()).startswith(b"event: changed\n")
    assert failures == []
    assert watcher.listeners == 0


def test_ended_sessions_are_deleted_by_purge_and_by_the_sweep(backend: CacheBackend) -> None:
    from crewai_idempotent.console._sessions import PREFIX, Sessions

    sessions = Sessions(backend, ttl_s=3600, idle_s=600)
    token, _ = sessions.start("alice", 1, "password")
    gone, _ = sessions.start("bob", 1, "password")
    live = [r.key for r in backend.scan() if r.key.startswith(PREFIX)]
    assert len(live) == 2 and all(token not in key and gone not in key for key in live)
    # Past its end by the ledger's clock: purge (expired receipts only) deletes it.
    record = next(r for r in backend.scan() if r.key.startswith(PREFIX))
    backend.replace(record, record.evolve(None, expires_at=backend.now() - 1))
    assert Ledger(backend).purge() == 1
    # Idle too long: the sweep deletes it, and it no longer opens anything.
    later = Sessions(backend, ttl_s=3600, idle_s=600)
    later.idle_s = 0.0
    assert later.sweep() == 1
    assert [r for r in backend.scan() if r.key.startswith(PREFIX)] == []
    assert sessions.find(token) is None and sessions.find(gone) is None


def test_live_updates_do_not_keep_an_unattended_session_alive(backend: CacheBackend) -> None:
    from crewai_idempotent.console._sessions import Sessions
    from tests.support.clock import ClockedBackend, ManualClock

    clock = ManualClock()
    sessions = Sessions(ClockedBackend(backend, clock), ttl_s=3600, idle_s=600)
    watched, _ = sessions.start("alice", 1, "password")
    used, _ = sessions.start("bob", 1, "password")
    for _ in range(5):
        clock.advance(100)
        assert sessions.find(watched, touch=False) is not None  # a page's live update
        assert sessions.find(used) is not None  # a person's request
    clock.advance(150)  # 650 s after login: idle for the first, not for the second
    assert sessions.find(watched, touch=False) is None
    assert sessions.find(used) is not None
    clock.advance(3000)  # past the session's end, whatever the activity
    assert sessions.find(used) is None


# -- notifications ----------------------------------------------------------------------------


def test_the_notifications_page_shows_entries_tries_and_filters(backend: CacheBackend) -> None:
    from crewai_idempotent.notifications import Dispatcher, Outbox, alert
    from tests.support.notify import Receiver

    down, up = Receiver().start(), Receiver().start()
    try:
        down.status = 503
        channels = [down.webhook(types="approval.*", name="pager"),
                    up.webhook(types="alert.*", name="hook")]  # fmt: skip
        dispatcher = Dispatcher(backend, channels, backoff_s=3600)
        rid = ask(backend, "inv-notify", {"amount_cents": 1200})
        dispatcher.run_once()
        hostile = "<script>alert(1)</script> stale \u202e"
        alert(backend, "alert.stale_uncertain", hostile, "look at it", subject="charge:9")
        dispatcher.run_once()
        assert len(down.received) == 1 and len(up.received) == 1
        entries = {e.type: e for e in Outbox(backend).entries()}
        asked, said = entries["approval.requested"], entries["alert.stale_uncertain"]
        assert asked.state == "due" and said.state == "delivered"
    finally:
        down.stop()
        up.stop()
    with _client(backend) as c:
        assert c.get("/notifications", follow_redirects=False).status_code == 303
        _as(c, "victor")  # a viewer
        page = c.get("/notifications")
        assert page.status_code == 200, page.text
        assert 'href="/notifications" aria-current="page"' in page.text
        for shown in (asked.id, said.id, rid, "pager", "hook", "HTTP 503", "failing", "charge:9"):
            assert shown in page.text, shown
        tries = re.findall(r'<tr class="(ok|failed)">.*?</tr>', page.text, re.S)
        assert sorted(tries) == ["failed", "ok"]
        assert "<script>alert(1)" not in page.text and "&lt;script&gt;alert(1)" in page.text
        assert "U+202E" in page.text and "\u202e" not in page.text
        parser = _Inline()
        parser.feed(page.text)
        assert parser.found == []
        failing = c.get("/notifications", params={"state": "failing"}).text
        assert asked.id in failing and said.id not in failing
        delivered = c.get("/notifications", params={"state": "delivered"}).text
        assert said.id in delivered and asked.id not in delivered
        typed = c.get("/notifications", params={"type": "alert.*"}).text
        assert said.id in typed and asked.id not in typed
        assert "This console delivers nothing" in page.text  # no dispatcher runs here
        wrong = c.get("/notifications", params={"state": "lost"})
        assert wrong.status_code == 400 and "No state" in wrong.text


def test_the_notifications_page_shows_waiting_entries_as_waiting(backend: CacheBackend) -> None:
    """An entry written before its transition (stored as the previous release writes it)
    is listed under `waiting` and said to wait, and is not counted as pending."""
    from crewai_idempotent.notifications import Outbox
    from crewai_idempotent.notifications._outbox import Note, of_document

    (stored,) = of_document(
        "crewai-idempotent/approval/ap_never", None, [Note("alert.test", {"title": "later"})],
        backend.now(),
    )  # fmt: skip
    backend.insert(stored)
    (entry,) = Outbox(backend).entries(waiting=True)
    with _client(backend) as c:
        _as(c, "victor")
        waiting = c.get("/notifications", params={"state": "waiting"}).text
        assert entry.id in waiting and "Waiting for its transition" in waiting
        pending = c.get("/notifications", params={"state": "pending"}).text
        assert entry.id not in pending


def test_the_console_delivers_the_outbox_while_it_runs(backend: CacheBackend) -> None:
    from crewai_idempotent.console import dispatching
    from crewai_idempotent.notifications import Dispatcher, Outbox
    from tests.support.notify import SECRET, Receiver

    receiver = Receiver().start()
    try:
        dispatcher = Dispatcher(backend, [receiver.webhook()], poll_s=0.05)
        app = create_app(backend, ConsoleSettings(), background=[dispatching(dispatcher)])
        with TestClient(app, base_url=BASE, client=("127.0.0.1", 50000)) as c:
            rid = ask(backend, "inv-live", {"amount_cents": 500})
            (got,) = receiver.wait_for(1, timeout=60)
            assert got["verified"] is True, got["error"]
            _as(c, "victor")
            said = c.get("/notifications").text
            assert f"(dispatcher <code>{dispatcher.name}</code>)" in said
        # Stopped with the console: nothing more is sent from here.
        assert dispatcher._thread is not None and not dispatcher._thread.is_alive()
        from standardwebhooks import Webhook

        body = Webhook(SECRET).verify(got["body"], got["headers"])
        assert body["type"] == "approval.requested" and body["data"]["id"] == rid
        (entry,) = Outbox(backend).entries()
        assert got["id"] == entry.id and entry.state == "delivered"
        assert [t["by"] for t in entry.log] == [dispatcher.name]
        assert len(receiver.received) == 1
    finally:
        receiver.stop()


def test_the_console_sweeps_while_it_runs(backend: CacheBackend) -> None:
    from crewai_idempotent.console import sweeping
    from crewai_idempotent.reconciliation import Sweeper
    from tests.support.reconcile import uncertain, wait_for

    ledger = Ledger(backend)
    uncertain(ledger, "charge:swept", {"answer": "found"})
    sweeper = Sweeper(ledger, imports=["tests.support.reconcile"])
    app = create_app(backend, ConsoleSettings(), background=[sweeping(sweeper, 0.05)])
    with TestClient(app, base_url=BASE, client=("127.0.0.1", 50000)):
        wait_for(lambda: ledger.get("charge:swept").status is Status.COMMITTED, "the sweep")
    record = ledger.get("charge:swept")
    assert record is not None and record.value() == "receipt-charge:swept"


def test_slack_channels_link_to_the_console_s_public_origin_unless_told_otherwise() -> None:
    from crewai_idempotent.console._beside import link_console
    from crewai_idempotent.notifications._slack import SlackChannel

    hook = "https://hooks.slack.com/services/T000/B000/XXXX"
    plain = SlackChannel(hook, {"name": "plain"})
    own = SlackChannel(hook, {"name": "own", "console": "https://x.test"})
    assert link_console([plain, own], None) == [] and plain.console is None
    settings = ConsoleSettings(public_url="https://Approvals.example.com/")
    assert link_console([plain, own], settings.public_origin) == ["plain"]
    assert plain.console == "https://approvals.example.com" and own.console == "https://x.test"


def test_a_decision_in_the_console_is_delivered_without_waiting_for_a_poll(
    backend: CacheBackend,
) -> None:
    from crewai_idempotent.console import dispatching
    from crewai_idempotent.notifications import Dispatcher
    from tests.support.notify import Receiver
    from tests.support.reconcile import wait_for

    receiver = Receiver().start()
    try:
        # Its first pass comes at once; the next only when woken (an hour is never reached).
        dispatcher = Dispatcher(backend, [receiver.webhook()], poll_s=3600)
        app = create_app(backend, ConsoleSettings(), background=[dispatching(dispatcher)])
        before = dispatcher.last
        with TestClient(app, base_url=BASE, client=("127.0.0.1", 50000)) as c:
            wait_for(lambda: dispatcher.last is not before, "the dispatcher's first pass")
            rid = ask(backend, "inv-woken", {"amount_cents": 900})
            _as(c, "alice")
            page = c.get(f"/approvals/{rid}")
            done = c.post(f"/approvals/{rid}/approve", follow_redirects=False, data={
                "csrf": csrf_of(page.text), "round": "1", "ttl": "1h", "reason": "checked",
            })  # fmt: skip
            assert done.status_code == 303
            got = receiver.wait_for(2, timeout=60)
        types = sorted(r["json"]["type"] for r in got)
        assert types == ["approval.approved", "approval.requested"]
    finally:
        receiver.stop()


# -- what runs beside it ----------------------------------------------------------------------


def test_a_sweeping_interval_that_cannot_work_is_refused_where_it_is_given(
    backend: CacheBackend,
) -> None:
    from crewai_idempotent.reconciliation import Sweeper

    sweeper = Sweeper(backend)
    with pytest.raises(ValueError, match="interval_s"):
        sweeping(sweeper, -1)
    with pytest.raises(TypeError, match="interval_s"):
        sweeping(sweeper, "often")  # type: ignore[arg-type]


def test_a_job_beside_the_console_that_stops_with_an_error_is_logged(
    backend: CacheBackend, caplog: pytest.LogCaptureFixture
) -> None:
    started = threading.Event()

    async def broken(console: Any) -> None:
        started.set()
        raise RuntimeError("the dispatcher's channel vanished")

    app = create_app(backend, ConsoleSettings(), background=[broken])
    with caplog.at_level("ERROR", logger="crewai_idempotent.console"), TestClient(app) as c:
        assert started.wait(60)
        for _ in range(200):  # the done callback runs on the app's loop, soon after
            if any("stopped" in r.getMessage() for r in caplog.records):
                break
            c.get("/login")
    stopped = [r for r in caplog.records if "a job beside the console stopped" in r.getMessage()]
    assert len(stopped) == 1
    assert "the dispatcher's channel vanished" in str(stopped[0].exc_info[1])
