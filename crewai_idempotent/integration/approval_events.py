"""Events for approval requests, on crewai's event bus.

Subscribe to post a request to Slack or a ticket queue::

    @crewai_event_bus.on(ApprovalRequestedEvent)
    def notify(source, event):
        post(f"{event.tool_name}: {event.summary} needs approval: "
             f"crewai-idempotent approvals approve {event.request_id}")

`ApprovalRequestedEvent` is emitted by the process whose call created the request (or
opened a new round after an expired or spent grant). `ApprovalDecidedEvent` is emitted by
the process that approved or denied it through the Python API
(`crewai_idempotent.approve` / `deny`); a decision made with the CLI in another process
is seen by the crew at its next call.
"""

from __future__ import annotations

from typing import Any, Literal

from crewai.events.base_events import BaseEvent


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


class ApprovalRequestedEvent(ApprovalEvent):
    """A call needs approval; nothing ran."""

    type: Literal["approval_requested"] = "approval_requested"


class ApprovalDecidedEvent(ApprovalEvent):
    """An operator approved or denied a request."""

    type: Literal["approval_decided"] = "approval_decided"
    decided_by: str | None = None
    decision_reason: str = ""
    grant_expires_at: float | None = None


__all__ = ["ApprovalDecidedEvent", "ApprovalEvent", "ApprovalRequestedEvent"]
