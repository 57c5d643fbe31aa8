"""The channels: Slack's Block Kit payloads within Slack's limits whatever the call holds
(1 MB arguments, a hundred of them) and with mention and markdown injection escaped;
a fake Slack and apprise's own JSON plugin against a local receiver."""

from __future__ import annotations

import json
from typing import Any

import pytest

from crewai_idempotent import InMemoryCacheBackend, Ledger
from crewai_idempotent._errors import ApprovalRequired
from crewai_idempotent.gates._plan import Plan
from crewai_idempotent.gates._spend import Money, SpendCap, Where
from crewai_idempotent.notifications import (
    Dispatcher,
    Message,
    Outbox,
    alert,
    channel_from_url,
)
from crewai_idempotent.notifications._slack import _OWN_LABELS, LIMITS, payload
from tests.support.notify import Receiver

INJECTION = (
    "<!channel> <@U024BE7LH> <!subteam^S1> *bold* _it_ ~no~ `code` "
    "<https://evil.example|click> &amp; &lt;"
)


def _approval_message(**summary: Any) -> Message:
    backend = InMemoryCacheBackend()
    ledger = Ledger(backend)
    cap = SpendCap(500_000, "EUR", per="day", name="daily")
    plan = Plan(
        tool="pay_invoice", fingerprint="fp", approval=True, approval_reason=INJECTION,
        amount=Money(123_456, "EUR"), caps=[("crew", cap)], summary=summary,
        where=Where(kickoff="kick-<!here>", crew="crew *x*", task="task"),
    )  # fmt: skip
    with pytest.raises(ApprovalRequired):
        ledger.run("pay:<!channel>", lambda: "x", fingerprint="fp", stage=plan)
    (entry,) = Outbox(backend).entries()
    return Message.of(entry, backend)


def _texts(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every text object in a payload, with where it is."""
    found = []
    if isinstance(node, dict):
        if node.get("type") in ("plain_text", "mrkdwn") and "text" in node:
            found.append((path, node))
        for key, value in node.items():
            found += _texts(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _texts(value, f"{path}[{i}]")
    return found


def _check_limits(body: dict[str, Any]) -> None:
    """Slack's Block Kit limits, checked by slack_sdk's own models where it checks them and
    by the reference's numbers where it does not."""
    from slack_sdk.models.blocks import Block, ButtonElement, PlainTextObject

    blocks = body["blocks"]
    assert len(blocks) <= 50
    assert len(body["text"]) <= LIMITS["text"]
    assert len(json.dumps(body)) < 64_000  # the whole message stays small
    for block in blocks:
        Block.parse(block).validate_json()  # section text, fields count, block ids...
        if block["type"] == "header":
            assert block["text"]["type"] == "plain_text" and len(block["text"]["text"]) <= 150
        if block["type"] == "section":
            assert len(block.get("text", {}).get("text", "")) <= 3000
            assert len(block.get("fields", ())) <= 10
            assert all(len(f["text"]) <= 2000 for f in block.get("fields", ()))
        if block["type"] == "context":
            assert len(block["elements"]) <= 10
            assert all(len(e["text"]) <= 2000 for e in block["elements"])
        if block["type"] == "actions":
            assert len(block["elements"]) <= 25
            for e in block["elements"]:
                assert e["type"] == "button" and len(e["text"]["text"]) <= 75
                ButtonElement(
                    text=PlainTextObject(text=e["text"]["text"]), action_id=e["action_id"],
                    url=e.get("url"), value=e.get("value"), style=e.get("style"),
                ).validate_json()  # fmt: skip
                assert len(e.get("url", "")) <= 3000 and len(e.get("value", "")) <= 2000


def _check_escaped(body: dict[str, Any]) -> None:
    """Nothing a model or a tool wrote can ping, link or format: it is all in plain_text,
    with Slack's control characters escaped; mrkdwn holds this package's labels only."""
    raw = json.dumps(body)
    for mention in ("<!channel>", "<!here>", "<@U024BE7LH>", "<!subteam", "<https://evil"):
        assert mention not in raw
    for path, text in _texts(body):
        if text["type"] == "mrkdwn":
            label = text["text"]
            assert label.startswith("*") and label.endswith("*"), (path, label)
            assert label.strip("*") in _OWN_LABELS, (path, label)
        else:
            assert "<" not in text["text"] and ">" not in text["text"], path
    assert "*bold*" in raw  # shown as it was written, in plain text, where it is not bold
    assert "&amp;amp;" in raw  # an escaped entity in the data is shown as typed


@pytest.mark.parametrize(
    "summary",
    [
        {"memo": "m" * 1_000_000, "note": INJECTION},
        {f"arg_{i}": INJECTION * 20 for i in range(100)},
        {"lines": [{"sku": INJECTION, "qty": i, "desc": "d" * 50_000} for i in range(40)]},
        {"<!channel>": "key as name", "x" * 5000: "a long name"},
        {},
    ],
    ids=["1mb-argument", "100-arguments", "nested-json", "hostile-names", "no-arguments"],
)
def test_slack_payloads_stay_within_block_kit_limits_and_escape_everything(
    summary: dict[str, Any],
) -> None:
    message = _approval_message(**summary)
    for console, buttons in ((None, False), ("https://ops.example.com/console", True)):
        body = payload(message, console=console, buttons=buttons)
        _check_limits(body)
        _check_escaped(body)
        raw = json.dumps(body)
        assert "pay_invoice" in raw and "1,234.56 EUR" in raw  # the tool and the amount
        assert "0.00 EUR spent + 0.00 EUR reserved of 5,000.00 EUR" in raw  # against the cap
        assert "crew *x*" in raw and "kick-&lt;!here&gt;" in raw
        if summary:
            assert "argument(s)" in raw
    if "memo" in summary:
        assert "1,000,000 characters in all" in json.dumps(payload(message))


def test_every_entry_type_renders_within_the_limits() -> None:
    backend = InMemoryCacheBackend()
    long = INJECTION * 400
    samples = {
        "record.uncertain": {"key": long, "status": "UNCERTAIN", "error": long, "by": long},
        "record.resolved": {"key": "k", "status": "COMMITTED", "by": "ops", "note": long},
        "spend.refused": {"key": long, "tool": long, "amount": 5, "currency": "JPY",
                          "cap": long, "limit": 1, "committed": 0, "reserved": 0,
                          "summary": {"a": long}},
        "spend.threshold": {"cap": long, "currency": "KWD", "limit": 1000, "committed": 800,
                            "reserved": 100, "share": 0.8, "key": long},
        "ledger.unavailable": {"host": long, "count": 3, "first_at": 1.0, "last_at": 2.0,
                               "error": long, "alert": long},
        "alert.stale": {"title": long, "text": long, "fields": {f"f{i}": long for i in range(30)}},
        "alert.uncertain_too_long": {"title": long, "text": long,
                                     "fields": {"key": long, "tool": long, "age_s": 1e12,
                                                "unknowns": 7, "reason": long}},
        "alert.verifier_unknown": {"title": long, "text": long, "fields": {"tool": long}},
    }  # fmt: skip
    from crewai_idempotent.notifications import put

    for kind, data in samples.items():
        entry = put(backend, kind, data, subject=long)
        body = payload(Message.of(entry, backend), console="https://c.example", buttons=True)
        _check_limits(body)
        for mention in ("<!channel>", "<@U024BE7LH>"):
            assert mention not in json.dumps(body), kind


def test_slack_gets_the_message_and_the_console_s_buttons() -> None:
    slack = Receiver(secret=None).start()
    try:
        backend = InMemoryCacheBackend()
        ledger = Ledger(backend)
        plan = Plan(
            tool="pay_invoice", fingerprint="fp", approval=True, approval_reason="big",
            summary={"invoice": "INV-1", "amount_cents": 80_000},
        )  # fmt: skip
        with pytest.raises(ApprovalRequired) as asked:
            ledger.run("pay:INV-1", lambda: "x", fingerprint="fp", stage=plan)
        rid = asked.value.request_id
        url = (
            f"slack+http://127.0.0.1:{slack.port}/services/T1/B2/XYZ"
            "#console=https://ops.example.com/console&buttons=true&name=ops-slack"
        )
        done = Dispatcher(backend, [url]).run_once()
        assert done.sent == 1
        (got,) = slack.received
        assert got["path"] == "/services/T1/B2/XYZ" and got["verified"] is None
        body = got["json"]
        assert body["text"] == f"crewai-idempotent: Approval requested ({rid})"
        (actions,) = [b for b in body["blocks"] if b["type"] == "actions"]
        by_id = {e["action_id"]: e for e in actions["elements"]}
        assert (
            by_id["crewai_idempotent.open"]["url"]
            == f"https://ops.example.com/console/approvals/{rid}"
        )
        assert json.loads(by_id["crewai_idempotent.approve"]["value"]) == {"id": rid, "round": 1}
        assert by_id["crewai_idempotent.deny"]["style"] == "danger"
        assert "INV-1" in json.dumps(body) and f"approvals approve {rid}" in json.dumps(body)
        assert Outbox(backend).entries()[0].deliveries[0].channel == "ops-slack"
    finally:
        slack.stop()


def test_apprise_delivers_through_its_own_plugin_and_says_why_it_failed() -> None:
    target = Receiver(secret=None).start()
    try:
        backend = InMemoryCacheBackend()
        entry = alert(backend, "alert.stale", "charge:1 uncertain for 2 h", "Check it",
                      subject="charge:1", fields={"age": "2 h"})  # fmt: skip
        url = f"apprise+json://127.0.0.1:{target.port}/notify"
        channel = channel_from_url(url)
        assert channel.url == f"apprise+json://127.0.0.1:{target.port}/…"
        target.status = 500
        dispatcher = Dispatcher(backend, [channel], backoff_s=0.001)
        assert dispatcher.run_once().failed == 1
        (delivery,) = Outbox(backend).get(entry.id).deliveries  # type: ignore[union-attr]
        assert delivery.last_error and "500" in delivery.last_error
        target.status = 200
        import time

        time.sleep(0.01)  # the backoff of one millisecond passes
        assert dispatcher.run_once().sent == 1
        sent = target.received[-1]["json"]
        assert sent["title"] == "charge:1 uncertain for 2 h"
        assert "Check it" in sent["message"] and entry.id in sent["message"]
        assert "age: 2 h" in sent["message"]
    finally:
        target.stop()


def test_a_channel_registered_before_any_url_leaves_the_built_in_ones() -> None:
    """An application that registers its own kind first (at import, before a URL is read)
    still gets webhook+, slack+ and apprise+; a built-in scheme it registers stays its own."""
    import subprocess
    import sys

    script = (
        "import base64\n"
        "from crewai_idempotent.notifications import channel_from_url, register\n"
        "from crewai_idempotent.notifications._webhook import WebhookChannel\n"
        "class Pager(WebhookChannel): pass\n"
        "register('pager', Pager)\n"
        "register('slack', Pager)\n"
        "secret = 'whsec_' + base64.b64encode(b'k' * 24).decode()\n"
        "kinds = [type(channel_from_url(u)).__name__ for u in (\n"
        "    'webhook+https://example.invalid/hook#secret=' + secret,\n"
        "    'pager+https://example.invalid/page#secret=' + secret,\n"
        "    'slack+https://hooks.slack.com/services/T/B/x#secret=' + secret,\n"
        ")]\n"
        "print(' '.join(kinds))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["WebhookChannel", "Pager", "Pager"]
