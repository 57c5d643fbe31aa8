"""`crewai-idempotent console users ...` (the console's accounts, kept in the ledger) and
the mistakes `crewai-idempotent console` refuses before it listens."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from crewai_idempotent import Ledger, Status, backend_from_url
from crewai_idempotent.cli import main
from crewai_idempotent.console import Accounts, Role
from crewai_idempotent.notifications import ENV, Outbox
from tests.support.console import PASSWORD, REPO, ask, served
from tests.support.notify import Receiver
from tests.support.reconcile import uncertain, wait_for

pytest.importorskip("argon2", reason="the console extra is not installed")


@pytest.fixture
def url(tmp_path: Path) -> str:
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    backend = backend_from_url(ledger)
    Ledger(backend).run("charge:1", lambda: "ch_1")  # a ledger in use: the CLI creates none
    backend.close()
    return ledger


def cli(url: str, *args: str, input: str | None = None) -> Any:
    return CliRunner().invoke(main, ["--ledger", url, "console", *args], input=input)


def _accounts(url: str) -> Accounts:
    return Accounts(backend_from_url(url))


def test_accounts_are_added_listed_changed_and_removed(url: str) -> None:
    added = cli(url, "users", "add", "alice", "--role", "approver", "--password-stdin",
                input=PASSWORD + "\n")  # fmt: skip
    assert added.exit_code == 0 and "added alice (approver, a password)" in added.output
    proxy = cli(url, "users", "add", "pat@example.com", "--role", "viewer", "--no-password")
    assert proxy.exit_code == 0 and "no password (auth proxy only)" in proxy.output
    prompted = cli(url, "users", "add", "olga", "--role", "operator",
                   input=f"{PASSWORD}\n{PASSWORD}\n")  # fmt: skip
    assert prompted.exit_code == 0, prompted.output
    listed = cli(url, "users", "ls")
    assert listed.output.splitlines() == [
        "alice  approver  password",
        "olga  operator  password",
        "pat@example.com  viewer  auth proxy only",
    ]
    changed = cli(url, "users", "set", "alice", "--role", "operator", "--slack-user", "U012AB3CDE")
    assert changed.exit_code == 0 and "alice: operator, U012AB3CDE, enabled" in changed.output
    account = _accounts(url).get("alice")
    assert account is not None and account.role is Role.OPERATOR
    assert account.password_hash is not None and account.password_hash.startswith("$argon2id$")
    assert PASSWORD not in Path(url.removeprefix("sqlite:///")).read_bytes().decode("latin-1")
    assert _accounts(url).verify("alice", PASSWORD) is not None
    disabled = cli(url, "users", "set", "alice", "--disable")
    assert disabled.exit_code == 0 and "disabled" in disabled.output
    assert _accounts(url).verify("alice", PASSWORD) is None
    cli(url, "users", "set", "alice", "--enable")
    new = "a brand new passphrase"
    assert cli(url, "users", "passwd", "alice", "--password-stdin", input=new + "\n").exit_code == 0
    assert _accounts(url).verify("alice", PASSWORD) is None
    assert _accounts(url).verify("alice", new) is not None
    assert cli(url, "users", "logout", "alice").exit_code == 0
    assert cli(url, "users", "rm", "pat@example.com").exit_code == 0
    assert "pat@example.com" not in cli(url, "users", "ls").output


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (["add", "alice", "--role", "approver", "--password-stdin"], "short\n",
         "at least 12 characters"),
        (["add", "alice", "--role", "approver", "--password-stdin"], "alice\n",
         "at least 12 characters"),
        (["add", "bad name", "--role", "viewer", "--no-password"], None, "an account name is"),
        (["add", "eve", "--role", "admin", "--no-password"], None, "'admin' is not one of"),
        (["add", "eve", "--role", "viewer", "--no-password", "--slack-user", "eve"], None,
         "a Slack user id looks like U012AB3CDE"),
        (["add", "known", "--role", "viewer", "--no-password"], None,
         "already an account 'known'"),
        (["set", "nobody", "--role", "viewer"], None, "no account 'nobody' (accounts: known)"),
        (["set", "known", "--slack-user", "U1234567", "--no-slack-user"], None, "contradict"),
        (["passwd", "nobody", "--password-stdin"], PASSWORD + "\n", "no account 'nobody'"),
        (["rm", "nobody"], None, "no account 'nobody'"),
    ],
)  # fmt: skip
def test_account_mistakes_are_refused_and_change_nothing(
    url: str, args: list[str], stdin: str | None, message: str
) -> None:
    _accounts(url).add("known", "viewer", None, slack_user="U7654321")
    before = _accounts(url).all()
    done = cli(url, "users", *args, input=stdin)
    assert done.exit_code != 0 and message in done.output
    assert _accounts(url).all() == before


def test_one_slack_user_links_one_account(url: str) -> None:
    _accounts(url).add("alice", "approver", None, slack_user="U7654321")
    done = cli(url, "users", "add", "bob", "--role", "viewer", "--no-password",
               "--slack-user", "U7654321")  # fmt: skip
    assert done.exit_code == 1 and "linked to account 'alice' already" in done.output


def test_serving_mistakes_are_refused_before_it_listens(url: str, tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("not really")
    for args, message in (
        (["--auth", "proxy"], "needs trusted_proxies"),
        (["--trusted-proxy", "proxy.internal"], "not an IP address or network"),
        (["--public-url", "https://example.com/console"], "without a path"),
        (["--tls-cert", str(cert)], "--tls-cert and --tls-key go together"),
        (["--refresh", "soon"], "not a duration"),
        (["--session-ttl", "30s"], "session_ttl_s must be more than 60"),
    ):
        done = cli(url, *args)
        assert done.exit_code == 2 and message in done.output, (args, done.output)
    missing = CliRunner().invoke(main, ["--ledger", f"sqlite:///{tmp_path}/nope.db", "console"])
    assert missing.exit_code == 1 and "no ledger at" in missing.output
    assert f"--ledger sqlite:///{tmp_path}/nope.db console users add NAME" in missing.output
    assert not (tmp_path / "nope.db").exists()  # serving makes no ledger


def test_the_limits_it_refuses_are_the_documented_ones(url: str, tmp_path: Path) -> None:
    docs = " ".join((REPO / "docs" / "console.md").read_text(encoding="utf-8").split())
    assert "a request; each must be more than 60 s" in docs
    assert "one shorter than 16 characters is refused" in docs
    for status in ("401", "403", "404", "409", "429", "503"):
        assert f"| {status} |" in docs, status
    for option, value in (("--idle-timeout", "60s"), ("--session-ttl", "1m")):
        done = cli(url, option, value)
        assert done.exit_code == 2 and "must be more than 60 seconds" in done.output, done.output
    short = tmp_path / "slack-secret"
    short.write_text("0123456789abcde\n")  # 15 characters
    done = cli(url, "--slack-signing-secret-file", str(short))
    assert done.exit_code == 2 and "Slack's are 32 hex characters" in done.output
    assert "more than 60 s" in cli(url, "--help").output


def test_a_busy_port_is_one_clear_error(url: str) -> None:
    _accounts(url).add("alice", "approver", PASSWORD)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = cli(url, "--port", str(port))
    assert done.exit_code == 1 and f"cannot listen on 127.0.0.1:{port}" in done.output


def test_the_console_says_where_it_listens_and_warns_off_loopback(url: str) -> None:
    with served(url, "--host", "0.0.0.0") as console:
        pass
    out = console.output()
    assert "WARNING: listening on 0.0.0.0, not loopback, without TLS" in out
    assert "no account can log in yet" in out
    assert "it answers only to the Host names localhost, 127.0.0.1 and ::1" in out
    assert console.url.startswith("http://0.0.0.0:")


def test_purge_all_says_it_takes_the_console_accounts(url: str) -> None:
    _accounts(url).add("alice", "approver", PASSWORD)
    done = CliRunner().invoke(main, ["--ledger", url, "purge", "--all"], input="n\n")
    assert done.exit_code == 1 and "the web console's accounts and sessions too" in done.output
    assert _accounts(url).get("alice") is not None


# -- what runs beside it ----------------------------------------------------------------------


def test_what_runs_beside_it_is_checked_before_it_listens(url: str) -> None:
    for args, message in (
        (["--channel", "carrier-pigeon://coop"], "not a notification channel URL"),
        (["--channel", "webhook+https://hooks.example.com/x"], "secret"),
        (["--no-dispatch", "--channel", "slack+https://hooks.slack.com/services/T/B/X"],
         "contradict"),
        (["--import", "tests.support.reconcile"], "are for --reconcile"),
        (["--reconcile", "--reconcile-interval", "never"], "not a duration"),
    ):  # fmt: skip
        done = cli(url, *args)
        assert done.exit_code == 2 and message in done.output, (args, done.output)
    missing = cli(url, "--reconcile", "--import", "no_such_module_of_reconcilers")
    assert missing.exit_code == 1 and "--import: ModuleNotFoundError" in missing.output


def test_the_console_delivers_what_the_notify_setting_names(url: str) -> None:
    receiver = Receiver().start()
    store = backend_from_url(url)
    try:
        with served(url, env={ENV: receiver.webhook()}) as console:
            rid = ask(store, "inv-served", {"amount_cents": 700})
            (got,) = receiver.wait_for(1, timeout=120)
        assert "delivering notifications to webhook-" in console.output()
        assert got["verified"] is True, got["error"]
        assert got["json"]["type"] == "approval.requested" and got["json"]["data"]["id"] == rid
        (entry,) = Outbox(store).entries()
        assert entry.state == "delivered" and got["id"] == entry.id
        assert len(receiver.received) == 1
    finally:
        receiver.stop()
        store.close()


def test_no_dispatch_leaves_delivery_to_notify(url: str) -> None:
    receiver = Receiver().start()
    store = backend_from_url(url)
    hook = receiver.webhook()
    try:
        ask(store, "inv-elsewhere", {"amount_cents": 800})
        with served(url, "--no-dispatch", env={ENV: hook}) as console:
            # Serving: its lifespan (where a dispatcher would start) has run.
            assert httpx.get(f"{console.url}/login", timeout=60).status_code == 200
        assert "not delivering notifications (--no-dispatch)" in console.output()
        assert receiver.received == []
        (entry,) = Outbox(store).entries()
        assert entry.state == "due" and entry.tries == 0
        done = CliRunner().invoke(main, ["--ledger", url, "notify", "--channel", hook])
        assert done.exit_code == 0, done.output
        (got,) = receiver.wait_for(1)
        assert got["verified"] is True and got["id"] == entry.id
    finally:
        receiver.stop()
        store.close()


def test_the_console_with_reconcile_settles_what_the_reconciler_finds(url: str) -> None:
    store = backend_from_url(url)
    ledger = Ledger(store)
    try:
        uncertain(ledger, "charge:lost", {"answer": "found"})
        args = ("--reconcile", "--import", "tests.support.reconcile",
                "--reconcile-interval", "0.2s")  # fmt: skip
        with served(url, *args) as console:

            def settled() -> bool:
                record = ledger.get("charge:lost")
                return record is not None and record.status is Status.COMMITTED

            wait_for(settled, "the console's sweep", timeout=120)
        assert "sweeping" in console.output()
        record = ledger.get("charge:lost")
        assert record is not None and record.value() == "receipt-charge:lost"
    finally:
        store.close()
