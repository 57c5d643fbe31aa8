"""Events for approval requests, on crewai's event bus.

Subscribe to post a request to Slack or a ticket queue::

    @crewai_event_bus.on(ApprovalRequestedEvent)
    def notify(source, event):
        post(f"{event.tool_name}: {event.summary} needs approval: {event.approve_command}")

`approve_command` is `crewai-idempotent approvals approve ID`, with `--ledger URL`
(passwords as `***`) when the request is not in the CLI's default ledger.

`ApprovalRequestedEvent` is emitted by the process whose call created the request (or
opened a new round after an expired or spent grant). `ApprovalDecidedEvent` is emitted by
the process that approved or denied it through the Python API
(`crewai_idempotent.approve` / `deny`); a decision made with the CLI in another process
is seen by the crew at its next call.
"""

from __future__ import annotations

from typing import Any, Literal

from crewai.events.base_events import BaseEvent
from crewai.events.event_bus import crewai_event_bus

from ..gates import _approvals


class ApprovalEvent(BaseEvent):
    type: str = "approval"
    request_id: str
    key: str
    tool_name: str
    state: str
    summary: dict[str, Any]
    reason: str
    crew_key: str | None = None
    task_key: str | None = None
    kickoff_id: str | None = None
    round: int = 1
    approve_command: str = ""


class ApprovalRequestedEvent(ApprovalEvent):
    """A call needs approval; nothing ran."""

    type: Literal["approval_requested"] = "approval_requested"


class ApprovalDecidedEvent(ApprovalEvent):
    """An operator approved or denied a request."""

    type: Literal["approval_decided"] = "approval_decided"
    decided_by: str | None = None
    decision_reason: str = ""
    grant_expires_at: float | None = None


_listening = False


def listen() -> None:
    """Put this process's approval requests and decisions on crewai's bus (from the first
    gated call on; the guard calls this)."""
    global _listening
    if not _listening:
        _listening = True
        _approvals.add_listener(_to_bus)


def _to_bus(kind: str, request: _approvals.ApprovalRequest) -> None:
    common: dict[str, Any] = {
        "request_id": request.id,
        "key": request.key,
        "tool_name": request.tool,
        "state": request.state.value,
        "summary": request.summary,
        "reason": request.reason,
        "crew_key": request.crew,
        "task_key": request.task,
        "kickoff_id": request.kickoff,
        "round": request.round,
        "approve_command": request.approve_command,
    }
    if kind == "created":
        event: ApprovalEvent = ApprovalRequestedEvent(**common)
    else:
        event = ApprovalDecidedEvent(
            **common,
            decided_by=request.decided_by,
            decision_reason=request.decision_reason,
            grant_expires_at=request.grant_expires_at,
        )
    crewai_event_bus.emit(request, event)


__all__ = ["ApprovalDecidedEvent", "ApprovalEvent", "ApprovalRequestedEvent", "listen"]
