"""Slack's interactive buttons: Approve / Deny on a request's message, posted back here.

Slack signs every interactive post with the app's signing secret: the header
`X-Slack-Signature` is `v0=` and the hex HMAC-SHA256 of `v0:{X-Slack-Request-Timestamp}:{raw
body}`. A post is believed only with a valid signature over its exact body and a timestamp
within five minutes of the console's clock (a captured post cannot be replayed later);
anything else is refused before its body is read as a payload.

The Slack user who clicked must be linked to a console account (`console users set NAME
--slack-user U...`) whose role may decide; the decision is recorded under that account's
name, via "slack". A button names the request and its round (`button_value`), so a click on
an old message never decides a round nobody showed. The answer goes back to the clicker as
an ephemeral message through the post's `response_url` (only to Slack's own hooks host).

`actions_block` is the Block Kit element a Slack message carries to offer the buttons.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from ..gates._approvals import ApprovalRequest

WINDOW_S = 300.0
APPROVE = "crewai_idempotent_approve"
DENY = "crewai_idempotent_deny"
_VALUE = re.compile(r"^(ap_[0-9a-f]{20}):([1-9][0-9]{0,8})$")


class SlackRefused(Exception):
    """The post is not Slack's, or not for us: nothing was read from it. `status` is the
    HTTP answer."""

    def __init__(self, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.status = status


def signature(secret: str, timestamp: str, body: bytes) -> str:
    base = b"v0:" + timestamp.encode("ascii") + b":" + body
    return "v0=" + hmac.new(secret.encode("utf-8"), base, hashlib.sha256).hexdigest()


def verify(secret: str, headers: Mapping[str, str], body: bytes, now: float) -> None:
    """Raise `SlackRefused` unless `body` was signed with `secret` less than five minutes
    from `now`."""
    timestamp = headers.get("x-slack-request-timestamp", "")
    given = headers.get("x-slack-signature", "")
    if not timestamp.isascii() or not timestamp.isdigit() or len(timestamp) > 12:
        raise SlackRefused("no valid X-Slack-Request-Timestamp")
    if abs(now - int(timestamp)) > WINDOW_S:
        raise SlackRefused("the request's timestamp is more than five minutes away")
    if not given.startswith("v0="):
        raise SlackRefused("no v0 X-Slack-Signature")
    if not hmac.compare_digest(given.encode("ascii", "replace"),
                               signature(secret, timestamp, body).encode("ascii")):  # fmt: skip
        raise SlackRefused("the signature does not match")


@dataclass(frozen=True, slots=True)
class Click:
    """One button click, from a verified post."""

    user: str
    team: str | None
    approve: bool
    request_id: str
    round: int
    response_url: str | None


def parse(body: bytes) -> Click:
    """The click in a verified `block_actions` post; `SlackRefused(400)` for anything
    else (it is Slack's, but not a button of ours)."""
    try:
        fields = parse_qs(body.decode("utf-8"), strict_parsing=True)
        payload = json.loads(fields["payload"][0])
    except (UnicodeDecodeError, ValueError, KeyError, IndexError):
        raise SlackRefused("not an interactive payload", 400) from None
    if not isinstance(payload, dict) or payload.get("type") != "block_actions":
        raise SlackRefused("not a block_actions payload", 400)
    actions = payload.get("actions")
    user = payload.get("user")
    if not isinstance(actions, list) or len(actions) != 1 or not isinstance(user, dict):
        raise SlackRefused("a block_actions payload without one action and a user", 400)
    action = actions[0]
    if not isinstance(action, dict) or action.get("action_id") not in (APPROVE, DENY):
        raise SlackRefused("not one of our buttons", 400)
    match = _VALUE.match(str(action.get("value", "")))
    if match is None or not isinstance(user.get("id"), str):
        raise SlackRefused("a button without a request and round", 400)
    team = payload.get("team")
    team_id = team.get("id") if isinstance(team, dict) else None
    response_url = payload.get("response_url")
    return Click(
        user=user["id"], team=team_id if isinstance(team_id, str) else None,
        approve=action["action_id"] == APPROVE, request_id=match.group(1),
        round=int(match.group(2)),
        response_url=response_url if isinstance(response_url, str) else None,
    )  # fmt: skip


def button_value(request: ApprovalRequest) -> str:
    """What the buttons of the approval `request`'s message carry: its id and round
    (`ap_...:N`), so a click decides only the round it was shown. Raises nothing."""
    return f"{request.id}:{request.round}"


def actions_block(request: ApprovalRequest) -> dict[str, Any]:
    """The Approve / Deny buttons for the Slack message of the approval `request` (a
    Block Kit actions block). Raises nothing."""
    value = button_value(request)
    return {
        "type": "actions",
        "block_id": f"crewai_idempotent:{value}",
        "elements": [
            {"type": "button", "action_id": APPROVE, "value": value, "style": "primary",
             "text": {"type": "plain_text", "text": "Approve"}},
            {"type": "button", "action_id": DENY, "value": value, "style": "danger",
             "text": {"type": "plain_text", "text": "Deny"},
             "confirm": {"title": {"type": "plain_text", "text": "Deny this call?"},
                         "text": {"type": "plain_text", "text": "It will never run."},
                         "confirm": {"type": "plain_text", "text": "Deny"},
                         "deny": {"type": "plain_text", "text": "Cancel"}}},
        ],
    }  # fmt: skip


def reply(response_url: str | None, text: str, allowed_prefix: str) -> None:
    """Tell the clicker what happened (ephemeral), through Slack's `response_url`; only a
    URL under `allowed_prefix` (Slack's hooks host) is ever posted to. Best effort: the
    decision is already made or refused."""
    if not response_url or not response_url.startswith(allowed_prefix):
        return
    body = json.dumps({"response_type": "ephemeral", "replace_original": False, "text": text})
    request = urllib.request.Request(
        response_url, data=body.encode("utf-8"), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()
    except Exception:
        import logging

        logging.getLogger("crewai_idempotent.console").warning(
            "could not answer the Slack click at its response_url", exc_info=True
        )
