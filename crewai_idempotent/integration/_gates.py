"""Approval gates and spend caps for crewAI tools: the options, and the guard's use of them.

Options (on `@tool(...)`, `BaseTool` fields, `idempotent(tool, ...)`; a crew or
`configure()` gives them by tool name):

- `approval`: True, or a callable `(args, ctx) -> bool` (ctx: `GateContext`);
- `spend`: a callable `(args) -> Money`;
- `caps`: `SpendCap`s (on a tool: that tool's calls; on a crew or `configure()`: every
  call that has a `spend`);
- `on_approval`: "raise" (default) stops the kickoff with `ApprovalRequired`; "report"
  hands it to the agent as a tool error;
- `approval_wait_s`: wait that long for a decision (polling the ledger) before stopping;
- `redact`: argument names whose values the stored request hides.

Nothing here imports crewai at module level (see `_guard`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from .. import _approvals, _gating
from .._errors import ApprovalDenied, ApprovalRequired, SpendCapExceeded
from .._spend import Money, SpendCap, Where
from . import _config

if TYPE_CHECKING:
    from ._config import IdempotencyConfig, ToolOptions
    from ._guard import _Call

T = TypeVar("T")

_ON_APPROVAL = ("raise", "report")


@dataclass(frozen=True, slots=True)
class GateContext:
    """What an `approval` callable may look at besides the arguments."""

    tool: str
    key: str
    crew: str | None
    task: str | None
    kickoff: str | None


@dataclass(frozen=True, slots=True)
class Gates:
    """The gates of one guarded call: what `_gating` checks, and how a wait is reported."""

    plan: _gating.Plan
    on_approval: str


# -- checking options where they are given ---------------------------------------------


def _check_approval(where: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool) and not callable(value):
        raise TypeError(
            f"{where}: approval must be True, False or a callable (args, ctx) -> bool, "
            f"not {type(value).__name__}"
        )


def _check_spend(where: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(
            f"{where}: spend must be a callable (args) -> Money, not {type(value).__name__}"
        )


def _check_caps(where: str, value: Any) -> tuple[SpendCap, ...] | None:
    if value is None:
        return None
    caps = (value,) if isinstance(value, SpendCap) else value
    if isinstance(caps, str | bytes) or not hasattr(caps, "__iter__"):
        raise TypeError(f"{where}: caps must be a SpendCap or a list of them, not {value!r}")
    caps = tuple(caps)
    for cap in caps:
        if not isinstance(cap, SpendCap):
            raise TypeError(f"{where}: caps must hold SpendCap objects, not {cap!r}")
    labels = [c.label for c in caps]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{where}: two caps share a name {labels}; give them name=...")
    return caps


def _check_common(where: str, on_approval: Any, wait_s: Any) -> None:
    if on_approval is not None and on_approval not in _ON_APPROVAL:
        raise ValueError(f"{where}: on_approval must be 'raise' or 'report', not {on_approval!r}")
    if wait_s is not None and (
        isinstance(wait_s, bool)
        or not isinstance(wait_s, int | float)
        or math.isnan(wait_s)
        or wait_s < 0
    ):
        raise ValueError(f"{where}: approval_wait_s must be 0 or more seconds, not {wait_s!r}")


def check_tool_options(options: ToolOptions) -> None:
    """Called by `ToolOptions.__post_init__`."""
    where = "tool options"
    _check_approval(where, options.approval)
    _check_spend(where, options.spend)
    caps = _check_caps(where, options.caps)
    if caps is not None:
        object.__setattr__(options, "caps", caps)
    _check_common(where, options.on_approval, options.approval_wait_s)
    redact = options.redact
    if redact is not None:
        if isinstance(redact, str) or not all(isinstance(n, str) for n in redact):
            raise TypeError(f"{where}: redact must be a list of argument names, not {redact!r}")
        object.__setattr__(options, "redact", tuple(redact))


def check_crew_options(config: IdempotencyConfig) -> None:
    """Called by `IdempotencyConfig.__post_init__`."""
    where = "IdempotencyConfig"
    for field in ("approval", "spend"):
        value = getattr(config, field)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise TypeError(f"{where}: {field} must map tool names to the option, not {value!r}")
        for name, option in value.items():
            if not isinstance(name, str):
                raise TypeError(f"{where}: {field} keys are tool names, not {name!r}")
            (_check_approval if field == "approval" else _check_spend)(
                f"{where}.{field}[{name!r}]", option
            )
    caps = _check_caps(where, config.caps)
    if caps is not None:
        object.__setattr__(config, "caps", caps)
    _check_common(where, config.on_approval, config.approval_wait_s)


# -- one call ---------------------------------------------------------------------------


def _pick(name: str, tool: Any, levels: list[Any]) -> Any:
    value = getattr(tool, name, None)
    if value is not None:
        return value
    for config in levels:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _by_tool(name: str, tool_name: str, levels: list[Any]) -> Any:
    for config in levels:
        table = getattr(config, name, None)
        if table is not None and tool_name in table:
            return table[tool_name]
    return None


def plan(
    options: ToolOptions,
    crew_config: IdempotencyConfig | None,
    tool_name: str,
    key: str,
    fingerprint: str,
    arguments: dict[str, Any],
    ctx: GateContext,
) -> Gates | None:
    """The gates of one call, or None when it has none. A rule that cannot be evaluated
    refuses the call (TypeError): nothing was run."""
    process_config = _config._process_config
    if (
        options.approval is None
        and options.spend is None
        and (crew_config is None or (crew_config.approval is None and crew_config.spend is None))
        and (
            process_config is None
            or (process_config.approval is None and process_config.spend is None)
        )
    ):
        return None  # the common case, on every guarded call: no gate anywhere
    levels = [c for c in (crew_config, process_config) if c is not None]
    approval = options.approval
    if approval is None:
        approval = _by_tool("approval", tool_name, levels)
    spend = options.spend
    if spend is None:
        spend = _by_tool("spend", tool_name, levels)
    caps: list[tuple[str, SpendCap]] = [(tool_name, c) for c in options.caps or ()]
    for config in levels:
        caps += [("crew", c) for c in config.caps or ()]
        if config.caps:
            break  # the nearest level that sets caps
    if not approval and spend is None:
        return None

    needs_approval = False
    reason = ""
    if approval is True:
        needs_approval, reason = True, f"tool {tool_name!r} always requires approval"
    elif callable(approval):
        try:
            answer = approval(dict(arguments), ctx)
        except Exception as exc:
            raise TypeError(
                f"tool {tool_name!r}: the approval rule raised {type(exc).__name__}: {exc}; "
                "nothing was run"
            ) from exc
        if not isinstance(answer, bool):
            raise TypeError(
                f"tool {tool_name!r}: the approval rule returned {answer!r}, not True or "
                "False; nothing was run"
            )
        needs_approval, reason = answer, f"the approval rule of tool {tool_name!r} matched"

    amount: Money | None = None
    if spend is not None:
        try:
            amount = spend(dict(arguments))
        except Exception as exc:
            raise TypeError(
                f"tool {tool_name!r}: the spend callable raised {type(exc).__name__}: {exc}; "
                "nothing was run"
            ) from exc
        if not isinstance(amount, Money):
            raise TypeError(
                f"tool {tool_name!r}: spend must return a Money(amount_minor_units, currency), "
                f"not {amount!r}; nothing was run"
            )
        if caps and not any(c.currency == amount.currency for _, c in caps):
            raise SpendCapExceeded(key, f"no cap in {amount.currency}", amount.amount,
                                   amount.currency, 0, 0, 0)  # fmt: skip
    if not needs_approval and (amount is None or not caps):
        return None
    _listen()
    wait_s = _pick("approval_wait_s", options, levels)
    gated = _gating.Plan(
        tool=tool_name,
        fingerprint=fingerprint,
        amount=amount,
        caps=caps,
        where=Where(kickoff=ctx.kickoff, crew=ctx.crew, task=ctx.task),
        approval=needs_approval,
        approval_reason=reason,
        summary=_approvals.summarize(arguments, options.redact or ()),
        approval_wait_s=float(wait_s or 0.0),
    )
    return Gates(gated, _pick("on_approval", options, levels) or "raise")


def run(call: _Call, body: Callable[[], T]) -> T:
    gates = call.gates
    if gates is None:
        return body()
    return _gating.run(call.settings.ledger.backend, gates.plan, body)


async def arun(call: _Call, body: Callable[[], Awaitable[T]]) -> T:
    gates = call.gates
    if gates is None:
        return await body()
    return await _gating.arun(call.settings.ledger.backend, gates.plan, body)


def refused(call: _Call, cause: Exception) -> BaseException:
    """What the guard raises for a body that did not start because a gate refused it:
    `ApprovalRequired` stops the kickoff (unless on_approval="report"); the others are
    tool errors the agent sees."""
    gates = call.gates
    if gates is None or not isinstance(cause, ApprovalRequired):
        return cause
    from . import _guard

    if gates.on_approval == "raise" and _guard._depth.get() > 0:
        return cast(Any, _guard.Halt)(cause)  # a Halt carries any error out to the kickoff
    return cause


# -- events on crewAI's bus -------------------------------------------------------------

_listening = False


def _listen() -> None:
    global _listening
    if not _listening:
        _listening = True
        _approvals.add_listener(_to_bus)


def _to_bus(kind: str, request: _approvals.ApprovalRequest) -> None:
    from crewai.events.event_bus import crewai_event_bus

    from .approval_events import ApprovalDecidedEvent, ApprovalRequestedEvent

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
    }
    if kind == "created":
        event: Any = ApprovalRequestedEvent(**common)
    else:
        event = ApprovalDecidedEvent(
            **common,
            decided_by=request.decided_by,
            decision_reason=request.decision_reason,
            grant_expires_at=request.grant_expires_at,
        )
    crewai_event_bus.emit(request, event)


__all__ = [
    "ApprovalDenied",
    "ApprovalRequired",
    "GateContext",
    "Money",
    "SpendCap",
    "SpendCapExceeded",
    "check_crew_options",
    "check_tool_options",
    "plan",
]
