"""Events the guard puts on crewai's event bus.

They are new event types, not crewai's own ToolUsage started/finished pairs: a replay
still flows through crewai's normal tool events with the replayed result, and these say
what the guard decided. Subscribe with `@crewai_event_bus.on(IdempotencyReplayEvent)`.
"""

from __future__ import annotations

from typing import Literal

from crewai.events.base_events import BaseEvent


class IdempotencyEvent(BaseEvent):
    """What the guard decided for one call of an idempotent tool."""

    type: str = "idempotency"
    key: str
    tool_name: str
    status: str | None = None
    token: int | None = None
    attempts: int | None = None
    fingerprint: str | None = None
    owner: str | None = None
    backend: str | None = None
    kickoff_id: str | None = None


class IdempotencyClaimEvent(IdempotencyEvent):
    """The key was claimed (or taken over after a failure); the tool body runs now."""

    type: Literal["idempotency_claim"] = "idempotency_claim"
    takeover: bool = False


class IdempotencyReplayEvent(IdempotencyEvent):
    """The tool did not run: the stored result of an earlier run was returned."""

    type: Literal["idempotency_replay"] = "idempotency_replay"
    reconciled: bool = False


class IdempotencyConflictEvent(IdempotencyEvent):
    """Nothing ran: the key belongs to other arguments, or another worker holds it."""

    type: Literal["idempotency_conflict"] = "idempotency_conflict"
    reason: Literal["fingerprint_mismatch", "in_progress"]
    message: str


class IdempotencyUncertainEvent(IdempotencyEvent):
    """Whether the operation happened is unknown; nothing runs until it is resolved."""

    type: Literal["idempotency_uncertain"] = "idempotency_uncertain"
    reason: str
    halted: bool


EVENT_TYPES: tuple[type[IdempotencyEvent], ...] = (
    IdempotencyClaimEvent,
    IdempotencyReplayEvent,
    IdempotencyConflictEvent,
    IdempotencyUncertainEvent,
)

__all__ = [
    "EVENT_TYPES",
    "IdempotencyClaimEvent",
    "IdempotencyConflictEvent",
    "IdempotencyEvent",
    "IdempotencyReplayEvent",
    "IdempotencyUncertainEvent",
]
