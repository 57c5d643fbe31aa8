"""The guard every call of an idempotent tool passes through, sync and async.

It sits at the innermost callable (a `Tool`'s function, a class tool's `_run`/`_arun`),
so every crewai path reaches it: ReAct, native function calling (parallel calls too),
the step executor, LiteAgent, flow tool actions, adapters and direct `tool.run()`.

One pass down and one back up: `_prepare` binds the arguments, fingerprints them, takes
the tool's resolved settings (`_config.settings_for`) and derives the key, once each;
the ledger then claims, drives this call's `Guarded` stage (the claim event, then the
gates) and runs the body; on the way back `_succeeded` or `_unsucceeded` turns what the
ledger says into what crewai gets, with its event. Events are built only when someone
listens (`_compat.bus_listens`).

Loaded with the first flagged tool (see `_tools`), when crewai has finished importing:
the ledger, the gates, tracing and crewai's event bus load with it, never at activation.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, NoReturn

from crewai.events.event_bus import crewai_event_bus
from crewai.utilities.crew.crew_context import get_crew_context

from .. import _otel
from .._errors import (
    IdempotencyKeyConflict,
    LedgerConfigurationError,
    LedgerUnavailable,
    OperationInProgress,
    OutcomeUncertain,
    OutcomeUnknown,
    ToolReportedFailure,
)
from ..ledger._backend import CacheBackend, ledger_option
from ..ledger._keys import validate_key
from ..ledger._record import Record, Status
from ..ledger._steps import Outcome, Settled, Step
from . import _compat, _gates, _release, approval_events
from ._call import KEY_PARAMETER, Scope, crews, halting
from ._call import scope as _scope
from ._config import IdempotencyConfig, Settings, ToolOptions, settings_for
from ._keying import KeyContext, Target, derive_key, flow_id
from ._stash import config_of
from .events import (
    IdempotencyClaimEvent,
    IdempotencyConflictEvent,
    IdempotencyEvent,
    IdempotencyReplayEvent,
    IdempotencyUncertainEvent,
)

log = logging.getLogger("crewai_idempotent")

_running: ContextVar[frozenset[str]] = ContextVar("crewai_idempotent_running", default=frozenset())

__all__ = ["Guarded", "Target", "acall", "call"]


# -- one guarded call ------------------------------------------------------------------


class Guarded:
    """One call of a guarded tool, and the `Stage` the ledger drives for it.

    At the claim (`enter`) it reports the claim and passes the call's gates; once the
    body's outcome is recorded (`settle`) it settles the gates and keeps that outcome,
    which is how the way back up knows whether a body's exception was recorded as an
    uncertain outcome without asking the ledger again.
    """

    __slots__ = (
        "_where", "args", "crew", "fingerprint", "gates", "key", "observation", "raised",
        "refusal", "scope", "settings", "settled", "tool", "tool_name",
    )  # fmt: skip

    def __init__(
        self,
        tool: Any,
        tool_name: str,
        key: str,
        fingerprint: str,
        args: dict[str, Any],
        settings: Settings,
        scope: Scope | None,
        crew: Any,
        where: tuple[str | None, str | None, str | None] | None,
    ) -> None:
        self.tool = tool
        self.tool_name = tool_name
        self.key = key
        self.fingerprint = fingerprint
        self.args = args
        self.settings = settings
        self.scope = scope
        self.crew = crew
        self._where = where
        self.gates: _gates.Gates | None = None
        self.observation: _otel.Observer = _otel.NOTHING
        self.settled: Settled | None = None  # how the body ended, as recorded
        self.raised: BaseException | None = None  # what the body raised, if it did
        self.refusal: BaseException | None = None  # what the gates raised, if they did

    def where(self) -> tuple[str | None, str | None, str | None]:
        """(crew key, task key, kickoff id), worked out once and only if asked."""
        where = self._where
        if where is None:
            where = self._where = _where(self.scope, self.crew)
        return where

    # -- the stage ---------------------------------------------------------------------

    def enter(
        self, claim: Record, backend: CacheBackend, monotonic: Callable[[], float]
    ) -> Step[Any] | None:
        if _compat.bus_listens(IdempotencyClaimEvent):
            _emit(IdempotencyClaimEvent, self, claim, takeover=claim.token > 1)
        self.observation.claimed()
        gates = self.gates
        return None if gates is None else self._gated(gates, claim, backend, monotonic)

    def _gated(
        self,
        gates: _gates.Gates,
        claim: Record,
        backend: CacheBackend,
        monotonic: Callable[[], float],
    ) -> Step[Any]:
        try:
            return (yield from gates.plan.enter(claim, backend, monotonic))
        except BaseException as exc:
            self.refusal = exc
            self.observation.returned()  # no body will: the span's context ends here
            raise

    def settle(self, entered: Any, settled: Settled, backend: CacheBackend) -> Step[None] | None:
        self.settled = settled
        gates = self.gates
        return None if gates is None else gates.plan.settle(entered, settled, backend)


def _task_key(task: Any) -> str | None:
    if task is None:
        return None
    source = f"{task.description}|{task.expected_output}"
    return hashlib.md5(source.encode(), usedforsecurity=False).hexdigest()


def _crew_of(scope: Scope | None) -> Any:
    if scope is not None and scope.crew is not None and not isinstance(scope.crew, str):
        return scope.crew
    if not crews:
        return None  # no crew has idempotency settings: none of them can apply here
    context = get_crew_context()
    return crews.get(str(context.id)) if context is not None else None


def _where(scope: Scope | None, crew: Any) -> tuple[str | None, str | None, str | None]:
    if crew is not None:
        crew_key = crew.key
    else:
        context = get_crew_context()
        crew_key = context.key if context is not None else None
    task = _task_key(scope.task if scope is not None else None)
    return crew_key, task, _compat.execution_uuid()


def _origin(scope: Scope | None, crew: Any) -> dict[str, Any]:
    """The crew, task and agent of a gated call as people name them, for its request."""
    task = scope.task if scope is not None else None
    agent = scope.agent if scope is not None else None

    def text(value: Any) -> str | None:
        return value if isinstance(value, str) and value else None

    return {
        "crew": text(getattr(crew, "name", None)),
        "task": text(getattr(task, "name", None)) or text(getattr(task, "description", None)),
        "agent": text(getattr(agent, "role", None)),
    }


def _prepare(
    target: Target, options: ToolOptions, tool: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Guarded | None:
    name = target.tool_name or _compat.tool_name(tool.name)
    try:
        arguments = target.arguments(args, kwargs)
    except TypeError as exc:
        raise TypeError(f"tool {name!r}: {exc}; nothing was run") from exc
    try:
        digest = options.args_fingerprint(name, arguments)
    except TypeError as exc:
        raise TypeError(
            f"tool {name!r}: cannot fingerprint its arguments ({exc}); nothing was run"
        ) from exc
    scope = _scope.get()
    crew = _crew_of(scope)
    crew_config = config_of(crew) if crew is not None else None
    if not isinstance(crew_config, IdempotencyConfig):
        crew_config = None
    try:
        settings = settings_for(name, options, crew_config)
    except LedgerConfigurationError as exc:
        # Inside a kickoff crewai would turn it into text for the model: a Halt carries it
        # out to the kickoff instead, as it does an uncertain outcome (its cause kept).
        raise halting(exc)  # noqa: B904 - the error itself, or the Halt carrying it
    where = None
    explicit = kwargs.get(KEY_PARAMETER) if target.takes_key else None
    if explicit is not None:
        key = validate_key(explicit)
    elif settings.idempotency_key is None:
        key = validate_key(f"{name}:{digest}")
    else:
        where = _where(scope, crew)
        ctx = KeyContext(tool=name, crew=where[0], task=where[1], kickoff=where[2],
                         fingerprint=digest, flow=flow_id())  # fmt: skip
        key = derive_key(settings.idempotency_key, arguments, ctx)
    if key in _running.get():
        return None  # a guard inside the same operation (a subclass calling super()._run)
    call = Guarded(tool, name, key, digest, arguments, settings, scope, crew, where)
    rules = settings.gates
    if rules is not None:
        crew_key, task, kickoff = call.where()
        gate_ctx = _gates.GateContext(name, key, crew_key, task, kickoff)
        call.gates = rules.plan(key, digest, arguments, gate_ctx, _origin(scope, crew))
        if call.gates is not None:
            approval_events.listen()
    if target.takes_key:
        kwargs[KEY_PARAMETER] = key
    call.observation = _otel.observe(name, key, settings.ledger.backend)
    return call


# -- events ----------------------------------------------------------------------------


def _emit(
    event_type: type[IdempotencyEvent], call: Guarded, record: Record | None, **fields: Any
) -> None:
    try:
        if not _compat.bus_listens(event_type):
            return
        scope = call.scope
        task = scope.task if scope is not None else None
        agent = scope.agent if scope is not None else None
        event = event_type(
            key=call.key,
            tool_name=call.tool_name,
            status=record.status.value if record is not None else None,
            token=record.token if record is not None else None,
            attempts=record.attempts if record is not None else None,
            fingerprint=call.fingerprint,
            owner=record.owner.label if record is not None and record.owner else None,
            backend=repr(call.settings.ledger.backend),
            kickoff_id=call.where()[2],
            task_id=str(task.id) if task is not None else None,
            task_name=(task.name or task.description) if task is not None else None,
            agent_id=str(getattr(agent, "id", None)) if getattr(agent, "id", None) else None,
            agent_role=getattr(agent, "role", None),
            **fields,
        )
        crewai_event_bus.emit(call.tool, event)
    except Exception:  # observers never change what the guard does
        log.exception("could not emit %s for %r", event_type.__name__, call.key)


def _uncertain(call: Guarded, error: OutcomeUncertain) -> BaseException:
    """The exception to raise for an uncertain outcome: a Halt inside a kickoff."""
    halt = call.settings.on_uncertain == "raise"
    _emit(IdempotencyUncertainEvent, call, error.record, reason=error.reason, halted=halt)
    return halting(error) if halt else error


def _checked(result: Any) -> Any:
    """`result` unless it is a returned ToolFailure, which is raised to the ledger: a
    failure saying the call timed out as an unknown outcome (UNCERTAIN), others FAILED."""
    failure = _compat.tool_failure(result)
    if failure is None:
        return result
    if _compat.failure_is_timeout(failure):
        raise OutcomeUnknown(f"the tool returned a ToolFailure reporting a timeout: {failure}")
    raise ToolReportedFailure(failure)


# -- the way back up -------------------------------------------------------------------


def _succeeded(call: Guarded, outcome: Outcome[Any]) -> Any:
    observation = call.observation
    if outcome.replayed:
        if _compat.bus_listens(IdempotencyReplayEvent):
            record = outcome.record
            history = record.history
            reconciled = bool(history) and history[-1].kind == "reconcile"
            _emit(IdempotencyReplayEvent, call, record, reconciled=reconciled)
        if observation is not _otel.NOTHING:
            observation.finish("replay", outcome.record)
    elif observation is not _otel.NOTHING:
        observation.finish("claim", outcome.record)
    return outcome.value


def _unsucceeded(call: Guarded, exc: Exception) -> Any:
    """What a guarded call that did not return gives crewai: a returned ToolFailure as it
    was returned, anything else raised with its event. Called outside the caller's except
    block, so nothing chains implicitly."""
    if exc is call.raised:  # the body's own exception, recorded as `call.settled` says
        settled = call.settled
        if settled is not None and settled.status is Status.UNCERTAIN:
            ledger = ledger_option(call.settings.ledger.backend)
            uncertain = OutcomeUncertain(
                call.key, settled.record, settled.reason or "", ledger=ledger
            )
            uncertain.__cause__ = exc
            call.observation.finish("uncertain", settled.record, uncertain)
            raise _uncertain(call, uncertain) from exc
        recorded = settled.record if settled is not None else None
        call.observation.finish(_otel.outcome_of(exc), recorded, exc)
        if isinstance(exc, ToolReportedFailure):
            return exc.failure
        raise exc
    if exc is call.refusal:  # a gate stopped the call before its body
        call.observation.finish(_otel.outcome_of(exc), None, exc)
        _refused_by_gates(call, exc)
    if isinstance(exc, LedgerUnavailable):
        call.observation.ledger_error(exc)
        raise exc
    record = getattr(exc, "record", None)
    call.observation.finish(_otel.outcome_of(exc), record, exc)
    if isinstance(exc, IdempotencyKeyConflict | OperationInProgress):
        reason = "in_progress" if isinstance(exc, OperationInProgress) else "fingerprint_mismatch"
        _emit(IdempotencyConflictEvent, call, record, reason=reason, message=str(exc))
        raise exc
    if isinstance(exc, OutcomeUncertain):
        raise _uncertain(call, exc) from exc
    raise exc


def _refused_by_gates(call: Guarded, exc: Exception) -> NoReturn:
    raised = _gates.refused(call.gates, exc)
    if raised is exc:
        raise exc
    raise raised from exc


# -- the guard -------------------------------------------------------------------------


def call(
    target: Target,
    options: ToolOptions,
    tool: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    _release.refuse_if_untested()
    kwargs = dict(kwargs)
    guarded = _prepare(target, options, tool, args, kwargs)
    if guarded is None:
        return fn(*args, **kwargs)

    def body() -> Any:
        token = _running.set(_running.get() | {guarded.key})
        try:
            return _checked(fn(*args, **kwargs))
        except BaseException as exc:
            guarded.raised = exc
            raise
        finally:
            _running.reset(token)
            guarded.observation.returned()

    settings = guarded.settings
    options_of_call = settings.options.of_call(guarded.fingerprint, guarded.args)
    try:
        outcome = settings.ledger._execute(guarded.key, body, options_of_call, guarded)
    except Exception as exc:  # noqa: BLE001 - each kind is sorted out in _unsucceeded
        error: Exception = exc
    else:
        return _succeeded(guarded, outcome)
    return _unsucceeded(guarded, error)


async def acall(
    target: Target,
    options: ToolOptions,
    tool: Any,
    fn: Callable[..., Awaitable[Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    _release.refuse_if_untested()
    kwargs = dict(kwargs)
    guarded = _prepare(target, options, tool, args, kwargs)
    if guarded is None:
        return await fn(*args, **kwargs)

    async def body() -> Any:
        token = _running.set(_running.get() | {guarded.key})
        try:
            return _checked(await fn(*args, **kwargs))
        except BaseException as exc:
            guarded.raised = exc
            raise
        finally:
            _running.reset(token)
            guarded.observation.returned()

    settings = guarded.settings
    options_of_call = settings.options.of_call(guarded.fingerprint, guarded.args)
    try:
        outcome = await settings.ledger._aexecute(guarded.key, body, options_of_call, guarded)
    except Exception as exc:  # noqa: BLE001 - each kind is sorted out in _unsucceeded
        error: Exception = exc
    else:
        return _succeeded(guarded, outcome)
    return _unsucceeded(guarded, error)
