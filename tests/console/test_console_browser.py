"""The console in a real browser: Debian's Chromium, headless, driven by Playwright (which
downloads no browser here: it is pointed at /usr/bin/chromium). The console is the real
command (`crewai-idempotent console`) in its own process; crews run in processes of their
own (tests/support/crewai/run_gated.py) against the same SQLite ledger, and every payment
is counted at the fake provider.

Locally a missing Chromium or Playwright skips these tests with the reason; with CI=true
it fails them (.ci/run installs chromium).

`UPDATE_SCREENSHOTS=1` makes the approval test write docs/console.png, the picture in
docs/console.md.
"""

from __future__ import annotations

import contextlib
import http.cookiejar
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from crewai_idempotent import Approvals, ApprovalState, Ledger, Status, backend_from_url
from crewai_idempotent.console import Accounts
from tests.support.console import PASSWORD, REPO, Served, ask, served
from tests.support.crewai.fixtures import PYTHON, subprocess_env
from tests.support.crewai.provider import FakeProvider
from tests.support.servers import ON_CI

pytestmark = pytest.mark.slow  # a real browser and a console server per test: started first

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    *(["--no-sandbox"] if os.geteuid() == 0 else []),
]


def _missing(what: str) -> None:
    if ON_CI:
        pytest.fail(f"{what}; CI=true, so this is a failure, not a skip", pytrace=False)
    pytest.skip(what)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (pip install -e '.[test]')")
    if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
        _missing(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as playwright:
        # launch() gives the browser a fresh temporary --user-data-dir of its own.
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium"),
            headless=True,
            args=FLAGS,
        )
        yield chromium
        chromium.close()


class Person:
    """One browser context (its own cookies): someone at the console."""

    def __init__(self, browser: Any, url: str) -> None:
        self.context = browser.new_context(base_url=url, viewport={"width": 1280, "height": 900})
        self.context.set_default_timeout(60_000)
        self.page = self.context.new_page()
        self.dialogs: list[str] = []
        self.errors: list[str] = []

        def dialog(d: Any) -> None:
            self.dialogs.append(d.message)
            d.dismiss()

        self.page.on("dialog", dialog)
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def login(self, name: str) -> Person:
        self.page.goto("/approvals")
        assert "/login" in self.page.url
        self.page.fill("input[name=name]", name)
        self.page.fill("input[name=password]", PASSWORD)
        self.page.click("button[type=submit]")
        self.page.wait_for_url("**/approvals")
        return self

    def card(self, text: str) -> Any:
        return self.page.locator("article.request", has_text=text)

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def ledger_url(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    backend = backend_from_url(url)
    accounts = Accounts(backend)
    for name, role in (("alice", "approver"), ("bob", "approver"), ("victor", "viewer"),
                       ("olga", "operator")):  # fmt: skip
        accounts.add(name, role, PASSWORD)
    backend.close()
    yield url


@pytest.fixture
def console(ledger_url: str) -> Iterator[Served]:
    with served(ledger_url) as running:
        yield running


@pytest.fixture
def people(browser: Any, console: Served) -> Iterator[Any]:
    opened: list[Person] = []

    def person(name: str) -> Person:
        opened.append(Person(browser, console.url))
        return opened[-1].login(name)

    yield person
    for p in opened:
        p.close()


@pytest.fixture
def charges(tmp_path: Path) -> FakeProvider:
    return FakeProvider(tmp_path / "charges.jsonl")


def kickoff(ledger_url: str, charges: FakeProvider, invoice: str, **spec: Any) -> dict[str, Any]:
    """One run of the payment crew in its own process."""
    spec = {"provider": str(charges.path), "invoice": invoice, "amount_cents": 90_000, **spec}
    done = subprocess.run(
        [PYTHON, "-m", "tests.support.crewai.run_gated", json.dumps(spec)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env=subprocess_env(
            CREWAI_IDEMPOTENCY_URL=ledger_url, XDG_DATA_HOME=str(charges.path.parent / "xdg")
        ),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _request(ledger_url: str, state: str = "all") -> list[Any]:
    backend = backend_from_url(ledger_url)
    try:
        return Approvals(backend).list(state)
    finally:
        backend.close()


def test_an_approver_sees_the_whole_call_live_and_one_approval_pays_once(
    people: Any, ledger_url: str, charges: FakeProvider, tmp_path: Path
) -> None:
    alice = people("alice")
    page = alice.page
    assert page.locator("section[data-live=pending] p.empty").is_visible()
    page.evaluate("window.stillTheSamePage = true")

    memo = "Q3 hosting, contract 2024-117 — pay to the account on file"
    asked = kickoff(ledger_url, charges, "INV-7", memo=memo)
    assert asked["error"] == "ApprovalRequired" and charges.count() == 0

    card = alice.card("INV-7")
    card.wait_for()  # it arrives without a reload
    assert page.evaluate("window.stillTheSamePage") is True
    (request,) = _request(ledger_url, "pending")
    args = {
        row.locator("th").inner_text(): row.locator("pre.value").inner_text()
        for row in card.locator("table.args tbody tr").all()
    }
    assert args == {"invoice": "INV-7", "amount_cents": "90000", "memo": memo}
    facts = card.locator("dl.facts").inner_text()
    for shown in ("Payables", "Pay invoice INV-7.", "Cashier", request.kickoff, request.key):
        assert shown in facts
    assert card.locator("h2").inner_text().startswith("pay_invoice")
    shot = tmp_path / "console.png"
    page.screenshot(path=str(shot))
    if os.environ.get("UPDATE_SCREENSHOTS") == "1":
        shutil.copy(shot, REPO / "docs" / "console.png")

    card.locator("select[name=ttl]").select_option("4h")
    card.locator("form.approve input[name=reason]").fill("invoice checked against the contract")
    card.locator("button.approve").click()
    page.wait_for_url("**/approvals?done=approved*")
    assert "the next run of this call goes ahead, once" in page.locator(".notice").inner_text()
    (decided,) = _request(ledger_url)
    assert decided.state is ApprovalState.APPROVED and decided.decided_by == "alice"
    assert decided.grant_expires_at - decided.decided_at == pytest.approx(4 * 3600, abs=5)

    paid = kickoff(ledger_url, charges, "INV-7", memo=memo)
    again = kickoff(ledger_url, charges, "INV-7", memo=memo)
    (charge,) = charges.effects("charge")
    assert charge["invoice"] == "INV-7" and charge["receipt"] in paid["raw"]
    assert charge["receipt"] in again["raw"]  # replayed: counted once at the provider
    assert alice.dialogs == [] and alice.errors == []


def test_a_live_update_leaves_a_form_being_filled_in_alone(people: Any, ledger_url: str) -> None:
    backend = backend_from_url(ledger_url)
    first = ask(backend, "pay_invoice:typing", {"invoice": "INV-20", "amount_cents": 5})
    alice = people("alice")
    card = alice.card(first)
    card.locator("form.deny input[name=reason]").fill("half written")
    ask(backend, "pay_invoice:other", {"invoice": "INV-21", "amount_cents": 6})
    backend.close()
    status = alice.page.locator("#live-status")
    status.wait_for()  # the news is announced, the region with the form is kept
    assert "reload to see it" in status.inner_text()
    assert card.locator("form.deny input[name=reason]").input_value() == "half written"
    assert alice.card("INV-21").count() == 0
    card.locator("form.deny input[name=reason]").fill("")
    alice.page.locator("header.top").click()  # nothing focused, nothing edited: it updates
    ask_again = backend_from_url(ledger_url)
    ask(ask_again, "pay_invoice:third", {"invoice": "INV-22", "amount_cents": 7})
    ask_again.close()
    alice.card("INV-22").wait_for()
    assert alice.card("INV-21").count() == 1 and alice.errors == []


def test_a_denial_leaves_it_unpaid(people: Any, ledger_url: str, charges: FakeProvider) -> None:
    assert kickoff(ledger_url, charges, "INV-8")["error"] == "ApprovalRequired"
    alice = people("alice")
    card = alice.card("INV-8")
    card.locator("form.deny input[name=reason]").fill("duplicate of INV-6")
    card.locator("button.deny").click()
    alice.page.wait_for_url("**/approvals?done=denied*")
    (request,) = _request(ledger_url)
    assert request.state is ApprovalState.DENIED and request.decided_by == "alice"
    told = kickoff(ledger_url, charges, "INV-8")
    assert "duplicate of INV-6" in json.dumps(told)  # the agent was told why
    assert charges.count() == 0


def test_a_viewer_sees_no_buttons_and_a_forged_post_is_refused(
    people: Any, ledger_url: str, charges: FakeProvider
) -> None:
    assert kickoff(ledger_url, charges, "INV-9")["error"] == "ApprovalRequired"
    victor = people("victor")
    card = victor.card("INV-9")
    assert card.is_visible() and "90000" in card.inner_text()
    assert card.locator("form, button").count() == 0
    assert victor.page.locator("main form").count() == 0
    (request,) = _request(ledger_url)
    status = victor.page.evaluate(
        """async ([rid]) => {
            const csrf = document.querySelector("form[action='/logout'] input[name=csrf]").value;
            const body = new URLSearchParams({csrf, round: "1", ttl: "24h", reason: "me"});
            const answer = await fetch(`/approvals/${rid}/approve`, {method: "POST", body});
            return [answer.status, await answer.text()];
        }""",
        [request.id],
    )
    assert status[0] == 403 and "victor is a viewer" in status[1]
    assert _request(ledger_url)[0].state is ApprovalState.PENDING
    assert kickoff(ledger_url, charges, "INV-9")["error"] == "ApprovalRequired"
    assert charges.count() == 0


def test_the_two_person_rule_needs_two_approvers(
    people: Any, ledger_url: str, charges: FakeProvider
) -> None:
    assert kickoff(ledger_url, charges, "INV-10", approvers=2)["error"] == "ApprovalRequired"
    alice = people("alice")
    card = alice.card("INV-10")
    assert "Needs 2 distinct approvers: 0 so far" in card.inner_text()
    card.locator("button.approve").click()
    alice.page.wait_for_url("**/approvals?done=approved*")
    assert "1 more distinct approver(s) needed" in alice.page.locator(".notice").inner_text()
    assert "You approved this round" in alice.card("INV-10").inner_text()
    assert alice.card("INV-10").locator("button.approve").count() == 0

    waiting = kickoff(ledger_url, charges, "INV-10", approvers=2)
    assert waiting["error"] == "ApprovalRequired" and "1 of 2 approvers" in waiting["message"]
    assert charges.count() == 0

    bob = people("bob")
    card = bob.card("INV-10")
    assert "1 so far (alice via console)" in card.inner_text()
    card.locator("button.approve").click()
    bob.page.wait_for_url("**/approvals?done=approved*")
    (request,) = _request(ledger_url)
    assert request.state is ApprovalState.APPROVED and request.decided_by == "alice, bob"
    kickoff(ledger_url, charges, "INV-10", approvers=2)
    kickoff(ledger_url, charges, "INV-10", approvers=2)
    assert [c["invoice"] for c in charges.effects("charge")] == ["INV-10"]


HOSTILE = {
    "script": "<script>alert('script ran')</script>",
    "image": "<img src=x onerror=\"alert('onerror ran')\">",
    "link": "<a href=\"javascript:alert('link ran')\">open the invoice</a>",
    "bidi": "IBAN DE89 \u202e0013 0044 3705\u202c \u2066pay\u2069 \u200b",
    "big": "A1B2C3D4 " * (1024 * 1024 // 9 + 1),
}


def test_hostile_arguments_render_as_text_and_the_page_stays_usable(
    people: Any, ledger_url: str
) -> None:
    # Stored as the gate stores a call (the whole arguments), through the same API a
    # crew's gate uses: the summary a tool call stores is cut at 200 characters today.
    backend = backend_from_url(ledger_url)
    rid = ask(backend, "pay_invoice:hostile", HOSTILE)
    backend.close()
    alice = people("alice")
    page = alice.page
    page.goto(f"/approvals/{rid}")
    card = alice.card(rid)
    values = {
        row.locator("th").inner_text(): row.locator("pre.value")
        for row in card.locator("table.args tbody tr").all()
    }
    assert values["script"].inner_text() == HOSTILE["script"]
    assert values["image"].inner_text() == HOSTILE["image"]
    assert values["link"].inner_text() == HOSTILE["link"]
    assert "U+202E" in values["bidi"].inner_text() and "U+2066" in values["bidi"].inner_text()
    assert "\u202e" not in values["bidi"].inner_text()
    length = values["big"].evaluate("element => element.textContent.length")
    assert length == len(HOSTILE["big"]) > 1_000_000
    assert page.locator("main img, main a[href^='javascript']").count() == 0
    assert page.locator("script").count() == 1  # the console's own file, nothing else
    # Still usable: the form under a megabyte of text takes a decision.
    card.locator("button.approve").click()
    page.wait_for_url(f"**/approvals/{rid}?done=approved*")
    assert _request(ledger_url)[0].state is ApprovalState.APPROVED
    assert alice.dialogs == [] and alice.errors == []


class _Elsewhere(BaseHTTPRequestHandler):
    """Another origin (another port): a page whose form posts to the console."""

    page = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.end_headers()
        self.wfile.write(self.page)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def elsewhere(page: str) -> Iterator[str]:
    handler = type("Page", (_Elsewhere,), {"page": page.encode()})
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()


def test_a_post_without_the_token_or_from_another_origin_changes_nothing(
    people: Any, ledger_url: str, console: Served
) -> None:
    backend = backend_from_url(ledger_url)
    rid = ask(backend, "pay_invoice:csrf", {"invoice": "INV-11", "amount_cents": 90_000})
    backend.close()
    alice = people("alice")
    page = alice.page
    answer = page.evaluate(
        """async ([rid]) => {
            const body = new URLSearchParams({round: "1", ttl: "24h"});
            const response = await fetch(`/approvals/${rid}/approve`, {method: "POST", body});
            return [response.status, await response.text()];
        }""",
        [rid],
    )
    assert answer[0] == 403 and "security token" in answer[1]
    csrf = page.locator("form[action='/logout'] input[name=csrf]").get_attribute("value")
    # Even holding the session's token, a form on another origin is refused.
    action = f"{console.url}/approvals/{rid}/approve"
    fields = f'<input name="csrf" value="{csrf}"><input name="round" value="1">' + (
        '<input name="ttl" value="24h">'
    )
    attack = (
        f'<!doctype html><form id="f" method="post" action="{action}">{fields}</form>'
        '<script>document.getElementById("f").submit()</script>'
    )
    with elsewhere(attack) as url:
        page.goto(url)
        page.wait_for_url(f"{console.url}/approvals/{rid}/approve")
        assert "not sent from the console" in page.locator("main").inner_text()
    assert _request(ledger_url)[0].state is ApprovalState.PENDING


def test_an_uncertain_record_resolved_in_the_browser_replays_on_the_next_run(
    people: Any, ledger_url: str, charges: FakeProvider
) -> None:
    first = kickoff(ledger_url, charges, "INV-12", mode="unknown")
    assert first["error"] == "OutcomeUncertain"
    (charge,) = charges.effects("charge")
    olga = people("olga")
    page = olga.page
    page.click("nav >> text=Uncertain")
    record = page.locator("article.record")
    assert "UNCERTAIN" in record.locator(".badge").inner_text()
    history = record.locator("table.history").inner_text()
    assert "claim" in history and "uncertain" in history
    assert "answer was lost" in record.inner_text()
    happened = record.locator("form.happened")
    happened.locator("textarea[name=receipt]").fill(charge["receipt"])
    happened.locator("input[name=reason]").fill(f"{charge['receipt']} in the provider dashboard")
    happened.locator("button").click()
    page.wait_for_url("**/uncertain?done=resolved")
    assert "No record is uncertain." in page.locator("main").inner_text()
    backend = backend_from_url(ledger_url)
    (resolved,) = [r for r in backend.scan() if r.key.startswith("record_payment:")]
    backend.close()
    assert resolved.status is Status.COMMITTED and resolved.history[-1].by == "olga"

    replay = kickoff(ledger_url, charges, "INV-12", mode="unknown")
    assert charge["receipt"] in replay["raw"]
    assert charges.count() == 1  # the replay ran nothing at the provider
    assert olga.errors == []


def test_a_link_from_another_site_keeps_the_session(
    people: Any, browser: Any, console: Served, ledger_url: str
) -> None:
    """SameSite=Strict keeps the cookie off a navigation from another site (a Slack link);
    the console starts the same navigation again from itself, which carries it."""
    backend = backend_from_url(ledger_url)
    rid = ask(backend, "pay_invoice:link", {"invoice": "INV-13", "amount_cents": 5})
    backend.close()
    alice = people("alice")
    link = f'<!doctype html><a id="go" href="{console.url}/approvals/{rid}">open</a>'
    with elsewhere(link) as url:
        alice.page.goto(url.replace("127.0.0.1", "localhost"))  # another site
        alice.page.click("#go")
        alice.page.wait_for_url(f"{console.url}/approvals/{rid}")
        alice.card(rid).wait_for()
    assert "alice · approver" in alice.page.locator("header.top").inner_text()
    # Twice: the navigation from the other site (no cookie: the page that starts it again),
    # then the same one from the console itself (the cookie, the request).
    assert len(re.findall(f'"GET /approvals/{rid} HTTP/1.1" 200', console.output())) == 2


def test_the_notifications_page_shows_a_delivery_as_it_happens(
    browser: Any, ledger_url: str
) -> None:
    from crewai_idempotent.notifications import ENV, Outbox
    from tests.support.notify import Receiver

    receiver = Receiver().start()
    receiver.hold = threading.Event()  # the first try waits at the receiver until released
    store = backend_from_url(ledger_url)
    try:
        with served(ledger_url, env={ENV: receiver.webhook(name="ops-hook")}) as running:
            victor = Person(browser, running.url).login("victor")
            try:
                ask(store, "inv-told", {"invoice": "INV-77", "amount_cents": 4200})
                (entry,) = Outbox(store).entries()
                assert receiver.holding.acquire(timeout=120), "no delivery came"
                page = victor.page
                page.click("nav >> text=Notifications")
                page.wait_for_url("**/notifications")
                card = page.locator(f"article#{entry.id}")
                assert "approval.requested" in card.inner_text()
                assert card.locator("tr.ok").count() == 0
                receiver.hold.set()
                # No reload: the live update brings the try in.
                card.locator("table.tries tr.ok").wait_for()
                text = card.inner_text()
                assert "ops-hook" in text and "delivered" in text
                assert victor.errors == []
            finally:
                victor.close()
        assert len(receiver.received) == 1 and receiver.received[0]["verified"] is True
    finally:
        receiver.hold.set()
        receiver.stop()
        store.close()


def _log_in_over_http(url: str, name: str) -> None:
    """A login as a browser makes one (it writes a session into the ledger)."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    with opener.open(f"{url}/login", timeout=60) as answer:
        form = answer.read().decode()
    token = re.search(r'name="login_csrf" value="([^"]+)"', form)
    assert token, form
    body = urlencode({"login_csrf": token.group(1), "name": name, "password": PASSWORD})
    sent = urllib.request.Request(f"{url}/login", body.encode(), headers={"Origin": url})
    with opener.open(sent, timeout=60) as answer:
        assert answer.status == 200 and "/approvals" in answer.url


def test_live_updates_survive_pages_coming_and_going_while_the_ledger_changes(
    browser: Any, console: Served, ledger_url: str
) -> None:
    """Several pages hold update streams while one page navigates between pages over and
    over (its stream cancelled at whatever point it was), pages open and close, and the
    ledger changes meanwhile (logins write sessions, calls run, crews ask for approval). Then every
    page still open, and one opened afterwards, is updated by the next change without a
    reload, and the console logged no error. Before the live updates waited on an event,
    this left the console's lock taken ("Lock is not acquired") and no page was updated
    again until it restarted."""
    chance = random.Random(30)
    store = backend_from_url(ledger_url)
    alice = Person(browser, console.url).login("alice")
    bob = Person(browser, console.url).login("bob")
    olga = Person(browser, console.url).login("olga")  # the one navigating
    victor = Person(browser, console.url).login("victor")  # opens and closes pages
    approvals_pages = [alice.page, bob.page]
    records_pages = []
    for person in (alice, bob):
        extra = person.context.new_page()
        extra.goto("/records")
        records_pages.append(extra)
    for page in approvals_pages + records_pages:
        page.evaluate("window.stillTheSamePage = true")

    stop = threading.Event()
    failures: list[str] = []

    def meanwhile() -> None:
        try:
            for i in itertools.count():
                if stop.is_set():
                    return
                _log_in_over_http(console.url, chance.choice(["victor", "alice", "olga"]))
                Ledger(store).run(f"charge:storm-{i}", lambda: "charged")
                if i < 8:
                    ask(store, f"pay_invoice:storm-{i}", {"invoice": f"INV-S{i}"})
        except Exception as exc:  # noqa: BLE001 - every failure is the finding
            failures.append(repr(exc))

    writer = threading.Thread(target=meanwhile)
    writer.start()
    sections = ["/approvals", "/uncertain", "/records", "/records?order=oldest", "/spend",
                "/notifications", "/approvals?pending_order=newest"]  # fmt: skip
    opened: list[Any] = []
    try:
        for step in range(60):
            waiting = chance.choice(["commit", "commit", "domcontentloaded", "load"])
            olga.page.goto(chance.choice(sections), wait_until=waiting)
            if step % 4 == 0:
                opened.append(victor.context.new_page())
                opened[-1].goto(chance.choice(sections), wait_until=waiting)
            if len(opened) > 2 or (opened and step % 4 == 2):
                opened.pop(chance.randrange(len(opened))).close()
    finally:
        stop.set()
        writer.join(timeout=300)
    assert not writer.is_alive() and failures == []
    olga.page.goto("/approvals")
    approvals_pages.append(olga.page)
    fresh = victor.context.new_page()
    with fresh.expect_response("**/events**"):
        fresh.goto("/records")
    records_pages.append(fresh)

    ask(store, "pay_invoice:after-the-storm", {"invoice": "INV-AFTER"})
    for page in approvals_pages:
        page.locator("article.request", has_text="INV-AFTER").wait_for()
    for page in records_pages:
        page.locator("table.records code", has_text="pay_invoice:after-the-storm").wait_for()
    for page in approvals_pages[:2] + records_pages[:2]:
        assert page.evaluate("window.stillTheSamePage") is True  # updated, not reloaded
    store.close()
    for person in (alice, bob, olga, victor):
        person.close()
    log = console.output()
    assert "RuntimeError" not in log and "Traceback" not in log, log[-3000:]
    assert "could not read the ledger" not in log
