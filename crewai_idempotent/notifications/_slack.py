"""Slack: a Block Kit message through an incoming webhook.

    slack+https://hooks.slack.com/services/T000/B000/XXXX#console=https://ops.example.com

The message shows the whole call as far as Slack lets it: the tool, every argument (a
line each, long values collapsed to fit Slack's limits, saying how long they were; only a
call of several hundred arguments has the last ones counted instead), the crew, task and kickoff,
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
from ._kinds import Channel, built_in, check_options, flag, http_client, http_target, post
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
_ARGUMENT_BUDGET = 30_000  # characters of the arguments in one message (escaped), shared
_VALUE_LEAST = 40  # the shortest an argument's value is collapsed to
_NAME_MOST = 100  # an argument's name is cut at this many characters


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
    head: list[dict[str, Any]] = [
        {"type": "header", "text": plain(message.title, LIMITS["header"])}
    ]
    if message.text:
        head.append({"type": "section", "text": plain(message.text, LIMITS["section_text"])})
    facts = message.facts()
    per_section = LIMITS["fields"] // 2
    for start in range(0, len(facts), per_section):
        fields = []
        for label, value in facts[start : start + per_section]:
            own = label in _OWN_LABELS
            fields.append(_label(label) if own else plain(label, LIMITS["field_text"]))
            fields.append(plain(value, 1000))
        head.append({"type": "section", "fields": fields})
    tail: list[dict[str, Any]] = []
    commands = message.commands()
    if commands:
        lines = "\n".join(f"{name}: {line}" for name, line in commands.items())
        tail.append({"type": "section", "text": plain(lines, LIMITS["section_text"])})
    actions = _actions(message, console, buttons)
    if actions:
        tail.append({"type": "actions", "elements": actions})
    context = f"entry {message.id} · {stamp(message.at)} · {message.ledger_url}"
    tail.append({"type": "context", "elements": [plain(context, 2000)]})
    room = LIMITS["blocks"] - len(head) - len(tail)
    blocks = [*head, *_arguments(message, room), *tail]
    assert len(blocks) <= LIMITS["blocks"], len(blocks)
    title = _TITLES.get(message.type, "notification")
    about = message.data.get("id") if message.type.startswith("approval.") else None
    fallback = f"crewai-idempotent: {title} ({about or message.id})"
    return {"text": escape(shorten(fallback, LIMITS["text"])), "blocks": blocks}


def _arguments(message: Message, room: int) -> list[dict[str, Any]]:
    """Every argument, one line each (`name = value`), packed into as few sections as
    hold them in at most `room` blocks: long values are collapsed (cut, saying how long
    they were), more the more arguments there are, never whole arguments left out, as
    long as each can keep `_VALUE_LEAST` characters within `_ARGUMENT_BUDGET`. Past that
    (several hundred arguments) the last block says how many are not shown."""
    args = message.arguments()
    if not args:
        return []
    heading = plain(f"The call's {len(args)} argument(s):", 200)
    sections = room - 1  # the heading is a block too
    each = max(_VALUE_LEAST, min(LIMITS["section_text"] - 200, _ARGUMENT_BUDGET // len(args)))
    while True:
        lines = [_argument_line(name, value, each) for name, value in args]
        packed = _pack(lines)
        size = sum(len(escape(line)) for line in lines)
        if (len(packed) <= sections and size <= _ARGUMENT_BUDGET) or each == _VALUE_LEAST:
            break
        each = max(_VALUE_LEAST, each * 2 // 3)
    more = None
    if len(packed) > sections or size > _ARGUMENT_BUDGET:
        # Even collapsed they do not fit: the first that do, and how many are not shown.
        packed = _pack(_within(lines, _ARGUMENT_BUDGET), most=sections - 1)
        left = len(args) - sum(text.count("\n") + 1 for text in packed)
        more = f"… and {left} more argument(s), not shown: the show command below has them all"
    blocks: list[dict[str, Any]] = [{"type": "context", "elements": [heading]}]
    blocks += [{"type": "section", "text": plain(text, LIMITS["section_text"])} for text in packed]
    if more is not None:
        blocks.append({"type": "context", "elements": [plain(more, 300)]})
    return blocks


def _argument_line(name: str, value: Any, each: int) -> str:
    """One argument as one line: its name (cut at `_NAME_MOST`), ` = `, and its value cut
    to `each` characters, line breaks shown as `↵` (the next line is the next argument),
    within a section's limit once escaped."""
    label, whole = shorten(str(name), _NAME_MOST), display(value)
    while True:
        text = f"{label} = {shorten(whole, each)}"
        text = text.replace("\r\n", "\n").replace("\n", "↵").replace("\r", "↵")
        over = len(escape(text)) - LIMITS["section_text"]
        if over <= 0 or each == 0:
            return text
        each = max(0, each - over)  # Slack's entities made it longer: cut the value more


def _within(lines: list[str], budget: int) -> list[str]:
    """The first of `lines` whose escaped size is within `budget` characters."""
    size = 0
    for count, line in enumerate(lines):
        size += len(escape(line)) + 1
        if size > budget:
            return lines[:count]
    return lines


def _pack(lines: list[str], most: int | None = None) -> list[str]:
    """`lines` joined into as few section texts as hold them, in order, each within a
    section's limit once escaped; with `most`, no more than that many (the lines that do
    not fit are left out)."""
    packed: list[str] = []
    size = 0
    for line in lines:
        grown = len(escape(line))
        if packed and size + 1 + grown <= LIMITS["section_text"]:
            packed[-1] += "\n" + line
            size += 1 + grown
        elif most is not None and len(packed) == most:
            break
        else:
            packed.append(line)
            size = grown
    return packed


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
        http_target(
            target, "a slack channel", "https://hooks.slack.com/services/...",
            lambda host: host in ("127.0.0.1", "localhost", "::1"),
        )  # fmt: skip
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


built_in(SlackChannel.scheme, SlackChannel)
