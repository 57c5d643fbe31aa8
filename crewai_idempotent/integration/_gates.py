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

The options are checked where they are given (`_config`); this module decides, at each
call, which gates apply and runs the body through them (`_gating`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from .. import _approvals, _gating
from .._backend import CacheBackend
from .._errors import ApprovalDenied, ApprovalRequired, SpendCapExceeded
from .._spend import Money, SpendCap, Where
from ._call import halting

if TYPE_CHECKING:
    from ._config import IdempotencyConfig, ToolOptions

T = TypeVar("T")


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
    process_config: IdempotencyConfig | None,
    tool_name: str,
    key: str,
    fingerprint: str,
    arguments: dict[str, Any],
    ctx: GateContext,
) -> Gates | None:
    """The gates of one call, or None when it has none. A rule that cannot be evaluated
    refuses the call (TypeError): nothing was run."""
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


def run(gates: Gates | None, backend: CacheBackend, body: Callable[[], T]) -> T:
    if gates is None:
        return body()
    return _gating.run(backend, gates.plan, body)


async def arun(gates: Gates | None, backend: CacheBackend, body: Callable[[], Awaitable[T]]) -> T:
    if gates is None:
        return await body()
    return await _gating.arun(backend, gates.plan, body)


def refused(gates: Gates | None, cause: Exception) -> BaseException:
    """What the guard raises for a body that did not start because a gate refused it:
    `ApprovalRequired` stops the kickoff (unless on_approval="report"); the others are
    tool errors the agent sees."""
    if gates is None or not isinstance(cause, ApprovalRequired):
        return cause
    return halting(cause) if gates.on_approval == "raise" else cause


__all__ = [
    "ApprovalDenied",
    "ApprovalRequired",
    "GateContext",
    "Money",
    "SpendCap",
    "SpendCapExceeded",
    "plan",
]
