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
- `redact`: argument names whose values the stored request hides;
- `approvers`: how many distinct people must approve before the grant is live (the
  two-person rule), or a callable `(args, ctx) -> int` (more above an amount).

With trusted keys in force (`_signing`: configure() or the environment, the process's
alone), every call's plan carries them: a grant is used only if its approvals verify
against them and are about the call (`DecisionRefused` otherwise), which stops the
kickoff whatever `on_approval` says, as it is no wait for a person but a decision
nobody trusted made.

The options are checked where they are given (`_config`), which also merges them once per
tool, crew and `configure()` into a `GateRules` (`_config.gate_rules`, with the rest of a
tool's settings); `GateRules.plan` decides at each call which gates apply, as a
`_plan.Plan`: the stage the ledger drives between the claim and the body.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import signing
from .._errors import (
    ApprovalDenied,
    ApprovalRequired,
    DecisionRefused,
    SigningConfigurationError,
    SpendCapExceeded,
)
from ..gates import _approvals, _plan
from ..gates._spend import Money, SpendCap, Where
from ._call import halting


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
    """The gates of one guarded call: what `_plan` checks, and how a wait is reported."""

    plan: _plan.Plan
    on_approval: str


@dataclass(frozen=True, slots=True)
class GateRules:
    """The gate options in force for one tool under one crew and `configure()`."""

    tool: str
    approval: bool | Callable[[dict[str, Any], Any], bool] | None
    spend: Callable[[dict[str, Any]], Any] | None
    caps: tuple[tuple[str, SpendCap], ...]
    on_approval: str
    approval_wait_s: float
    redact: tuple[str, ...]
    approvers: int | Callable[[dict[str, Any], Any], int] | None = None
    trusted_keys: signing.TrustedKeys | None = None
    accept_unsigned_grants_until: float | None = None

    def plan(
        self,
        key: str,
        fingerprint: str,
        arguments: dict[str, Any],
        ctx: GateContext,
        origin: dict[str, Any] | None = None,
    ) -> Gates | None:
        """The gates of one call, or None when none applies. A rule that cannot be
        evaluated refuses the call (TypeError): nothing was run. `origin`: the crew, task
        and agent that asked, by name, kept with an approval request."""
        tool_name = self.tool
        approval = self.approval
        needs_approval = False
        reason = ""
        if approval is True:
            needs_approval, reason = True, f"tool {tool_name!r} always requires approval"
        elif callable(approval):
            try:
                answer = approval(dict(arguments), ctx)
            except Exception as exc:
                raise TypeError(
                    f"tool {tool_name!r}: the approval rule raised {type(exc).__name__}: "
                    f"{exc}; nothing was run"
                ) from exc
            if not isinstance(answer, bool):
                raise TypeError(
                    f"tool {tool_name!r}: the approval rule returned {answer!r}, not True or "
                    "False; nothing was run"
                )
            needs_approval, reason = answer, f"the approval rule of tool {tool_name!r} matched"

        amount: Money | None = None
        caps = self.caps
        if self.spend is not None:
            try:
                amount = self.spend(dict(arguments))
            except Exception as exc:
                raise TypeError(
                    f"tool {tool_name!r}: the spend callable raised {type(exc).__name__}: "
                    f"{exc}; nothing was run"
                ) from exc
            if not isinstance(amount, Money):
                raise TypeError(
                    f"tool {tool_name!r}: spend must return a Money(amount_minor_units, "
                    f"currency), not {amount!r}; nothing was run"
                )
            if caps and not any(c.currency == amount.currency for _, c in caps):
                raise SpendCapExceeded(key, f"no cap in {amount.currency}", amount.amount,
                                       amount.currency, 0, 0, 0)  # fmt: skip
        if not needs_approval and (amount is None or not caps):
            return None
        approvers = self._approvers(arguments, ctx) if needs_approval else 1
        gated = _plan.Plan(
            tool=tool_name,
            fingerprint=fingerprint,
            amount=amount,
            caps=caps,
            where=Where(kickoff=ctx.kickoff, crew=ctx.crew, task=ctx.task),
            approval=needs_approval,
            approval_reason=reason,
            summary=_approvals.summarize(arguments, self.redact),
            approval_wait_s=self.approval_wait_s,
            approvers=approvers,
            origin=origin or {},
            trusted_keys=self.trusted_keys,
            accept_unsigned_grants_until=self.accept_unsigned_grants_until,
        )
        return Gates(gated, self.on_approval)

    def _approvers(self, arguments: dict[str, Any], ctx: GateContext) -> int:
        rule = self.approvers
        if rule is None:
            return 1
        if not callable(rule):
            return rule
        try:
            count = rule(dict(arguments), ctx)
        except Exception as exc:
            raise TypeError(
                f"tool {self.tool!r}: the approvers rule raised {type(exc).__name__}: {exc}; "
                "nothing was run"
            ) from exc
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise TypeError(
                f"tool {self.tool!r}: the approvers rule returned {count!r}, not a whole "
                "number of approvers (1 or more); nothing was run"
            )
        return count


def refused(gates: Gates | None, cause: Exception) -> BaseException:
    """What the guard raises for a body that did not start because a gate refused it:
    `ApprovalRequired` stops the kickoff (unless on_approval="report"), and so do a
    refused decision and trusted keys that no longer pass, always (no agent should talk
    its way past them); the others are tool errors the agent sees."""
    if isinstance(cause, DecisionRefused | SigningConfigurationError):
        return halting(cause)
    if gates is None or not isinstance(cause, ApprovalRequired):
        return cause
    return halting(cause) if gates.on_approval == "raise" else cause


__all__ = [
    "ApprovalDenied",
    "ApprovalRequired",
    "DecisionRefused",
    "GateContext",
    "GateRules",
    "Money",
    "SpendCap",
    "SpendCapExceeded",
]
