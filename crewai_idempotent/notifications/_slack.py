"""Slack: a Block Kit message through an incoming webhook.

    slack+https://hooks.slack.com/services/T000/B000/XXXX#console=https://ops.example.com

The message shows the whole call as far as Slack lets it: the tool, every argument (each
shortened to fit Slack's limits, with how much was left out), the crew, task and kickoff,
the amount against each cap, and the commands that decide it; with `console=` a button
opens the request in the console (`<console>/approvals/<id>`), and with `buttons=true`
Approve and Deny buttons post to the console's Slack endpoint (the console receives
them; without it Slack says the app cannot handle them).

Everything an agent or a tool wrote (arguments, keys, reasons, names) goes into
`plain_text` objects, which Slack never formats, with `&`, `<` and `>` escaped as Slack
asks, so `<!channel>` cannot ping anyone and `*bold*` stays two asterisks. Only this
module's own labels are `mrkdwn`. The limits (`LIMITS`, from Slack's Block Kit
reference) hold whatever the call holds: 50 blocks, 150 characters of header, 3,000 of a
section's text, 10 fields of 2,000, 75 of a button's text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from .._errors import LedgerConfigurationError
from ._channels import Channel, check_options, flag, http_client, post
from ._message import _TITLES, Message, approval_link, display, shorten, stamp

#: Block Kit's limits that a message of ours could reach.
LIMITS = {
    "blocks": 50,
    "header": 150,
    "section_text": 3000,
    "fields": 10,
    "field_text": 2000,
    "context_elements": 10,
    "button_text": 75,
    "button_url": 3000,
    "button_value": 2000,
    "text": 3000,  # the fallback text, shown in notifications (Slack's own limit is 40,000)
}
_ARGUMENTS_SHOWN = 20  # argument sections at most; the rest are counted
_ARGUMENT_BUDGET = 24_000  # characters of argument values in one message


def escape(text: str) -> str:
    """Slack's control characters as the entities it asks for."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def plain(text: str, limit: int) -> dict[str, Any]:
    """A plain_text object, escaped, within `limit` characters once escaped."""
    room = limit
    while True:
        out = escape(shorten(text, room))
        if len(out) <= limit:
            return {"type": "plain_text", "text": out or " ", "emoji": False}
        room -= len(out) - limit  # the entities took that much more room


def _label(text: str) -> dict[str, Any]:
    """One of this module's own labels (never data), in bold."""
    return {"type": "mrkdwn", "text": f"*{text}*"}


_OWN_LABELS = {
    "Request", "Tool", "Key", "Why", "Crew", "Task", "Kickoff", "Amount", "Decided by",
    "Reason given", "Grant until", "Status", "Flagged", "By", "Owner", "Cap", "Used",
    "Key that crossed it", "Host", "Process", "From", "Until", "Failed operations",
    "Last error", "About", "Ledger", "Alert", "Open for", "Unknown answers",
}  # fmt: skip


def payload(
    message: Message, *, console: str | None = None, buttons: bool = False
) -> dict[str, Any]:
    """The message as Slack's incoming webhook takes it: `text` (the notification's
    fallback, this module's words and ids only) and `blocks`."""
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": plain(message.title, LIMITS["header"])}
    ]
    if message.text:
        blocks.append({"type": "section", "text": plain(message.text, LIMITS["section_text"])})
    facts = message.facts()
    per_section = LIMITS["fields"] // 2
    for start in range(0, len(facts), per_section):
        fields = []
        for label, value in facts[start : start + per_section]:
            own = label in _OWN_LABELS
            fields.append(_label(label) if own else plain(label, LIMITS["field_text"]))
            fields.append(plain(value, 1000))
        blocks.append({"type": "section", "fields": fields})
    blocks += _arguments(message)
    commands = message.commands()
    if commands:
        lines = "\n".join(f"{name}: {line}" for name, line in commands.items())
        blocks.append({"type": "section", "text": plain(lines, LIMITS["section_text"])})
    actions = _actions(message, console, buttons)
    if actions:
        blocks.append({"type": "actions", "elements": actions})
    context = f"entry {message.id} · {stamp(message.at)} · {message.ledger_url}"
    blocks.append({"type": "context", "elements": [plain(context, 2000)]})
    assert len(blocks) <= LIMITS["blocks"], len(blocks)
    head = _TITLES.get(message.type, "notification")
    about = message.data.get("id") if message.type.startswith("approval.") else None
    fallback = f"crewai-idempotent: {head} ({about or message.id})"
    return {"text": escape(shorten(fallback, LIMITS["text"])), "blocks": blocks}


def _arguments(message: Message) -> list[dict[str, Any]]:
    args = message.arguments()
    if not args:
        return []
    shown = args[:_ARGUMENTS_SHOWN]
    each = min(LIMITS["section_text"] - 100, max(200, _ARGUMENT_BUDGET // len(shown)))
    heading = plain(f"The call's {len(args)} argument(s):", 200)
    blocks: list[dict[str, Any]] = [{"type": "context", "elements": [heading]}]
    for name, value in shown:
        text = f"{name} = {shorten(display(value), each)}"
        blocks.append({"type": "section", "text": plain(text, LIMITS["section_text"])})
    if len(args) > len(shown):
        more = f"… and {len(args) - len(shown)} more argument(s): `approvals show` has them all"
        blocks.append({"type": "context", "elements": [plain(more, 300)]})
    return blocks


def _actions(message: Message, console: str | None, buttons: bool) -> list[dict[str, Any]]:
    if message.type != "approval.requested" or not message.data.get("id"):
        return []
    rid = str(message.data["id"])
    elements: list[dict[str, Any]] = []
    if console:
        link = approval_link(console, rid)
        if len(link) <= LIMITS["button_url"]:
            elements.append({
                "type": "button", "text": plain("Open in the console", LIMITS["button_text"]),
                "url": link, "action_id": "crewai_idempotent.open",
            })  # fmt: skip
    if buttons:
        value = json.dumps({"id": rid, "round": message.data.get("round")})
        for verb, style in (("approve", "primary"), ("deny", "danger")):
            elements.append({
                "type": "button", "text": plain(verb.capitalize(), LIMITS["button_text"]),
                "style": style, "action_id": f"crewai_idempotent.{verb}", "value": value,
            })  # fmt: skip
    return elements


class SlackChannel(Channel):
    scheme = "slack"

    def __init__(self, target: str, options: Mapping[str, str]) -> None:
        check_options(self.scheme, options, ("console", "buttons"))
        super().__init__(target, options)
        parts = urlsplit(target)
        loopback = parts.hostname in ("127.0.0.1", "localhost", "::1")
        secure = parts.scheme == "https" or (parts.scheme == "http" and loopback)
        if not parts.hostname or not secure:
            raise LedgerConfigurationError(
                "a slack channel posts to the incoming webhook's https:// URL "
                "(https://hooks.slack.com/services/...)"
            )
        console = options.get("console") or None
        if console is not None and urlsplit(console).scheme not in ("https", "http"):
            raise LedgerConfigurationError(f"console must be the console's URL, not {console!r}")
        self.console = console
        self.buttons = flag(options.get("buttons"), "buttons")
        self._client: Any = None

    def send(self, message: Message) -> None:
        body = json.dumps(payload(message, console=self.console, buttons=self.buttons))
        if self._client is None:
            self._client = http_client()
        headers = {"content-type": "application/json; charset=utf-8"}
        post(self._client, self.target, body.encode("utf-8"), headers, self.timeout_s)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
