"""The guard every call of an idempotent tool passes through, sync and async.

It sits at the innermost callable (a `Tool`'s function, a class tool's `_run`/`_arun`),
so every crewai path reaches it: ReAct, native function calling (parallel calls too),
the step executor, LiteAgent, flow tool actions, adapters and direct `tool.run()`.

Loaded with the first flagged tool (see `_tools`), when crewai has finished importing:
the ledger, the gates, tracing and crewai's event bus load with it, never at activation.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NoReturn

from crewai.events.event_bus import crewai_event_bus
from crewai.utilities.crew.crew_context import get_crew_context

from .. import _otel
from .._errors import (
    BodyFailed,
    IdempotencyKeyConflict,
    LedgerConfigurationError,
    LedgerUnavailable,
    OperationInProgress,
    OutcomeUncertain,
    OutcomeUnknown,
)
from .._keys import validate_key
from .._ledger import current_claim
from .._record import Record, Status
from .._steps import Outcome
from ..backends._url import ledger_option
from . import _compat, _config, _gates, approval_events
from ._call import KEY_PARAMETER, Scope, config_of, crews, halting
from ._call import scope as _scope
from ._config import IdempotencyConfig, Settings, ToolOptions, resolve
from ._keying import KeyContext, derive_key
from .events import (
    IdempotencyClaimEvent,
    IdempotencyConflictEvent,
    IdempotencyEvent,
    IdempotencyReplayEvent,
    IdempotencyUncertainEvent,
)

log = logging.getLogger("crewai_idempotent")

_running: ContextVar[frozenset[str]] = ContextVar("crewai_idempotent_running", default=frozenset())


# -- one guarded callable --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """A callable the guard wraps: a Tool's function (`tool_name` known) or a class tool's
    `_run`/`_arun` (`method`: the first argument is the tool)."""

    signature: inspect.Signature
    method: bool
    takes_key: bool
    tool_name: str | None = None

    @classmethod
    def of(cls, fn: Callable[..., Any], *, method: bool, tool_name: str | None = None) -> Target:
        signature = inspect.signature(fn)
        return cls(signature, method, KEY_PARAMETER in signature.parameters, tool_name)

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """All arguments by name, defaults applied, without the tool itself or the key."""
        if self.takes_key and KEY_PARAMETER not in kwargs:
            kwargs = {**kwargs, KEY_PARAMETER: None}
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        params = self.signature.parameters
        found: dict[str, Any] = {}
        for index, (name, value) in enumerate(bound.arguments.items()):
            if (self.method and index == 0) or name == KEY_PARAMETER:
                continue
            kind = params[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                found.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                if value:
                    found[name] = list(value)
            else:
                found[name] = value
        return found


@dataclass(slots=True)
class _Call:
    tool: Any
    tool_name: str
    key: str
    fingerprint: str
    args: dict[str, Any]
    settings: Settings
    scope: Scope | None
    gates: _gates.Gates | None = None  # approval and spend caps, when the call has any


def _task_key(task: Any) -> str | None:
    if task is None:
        return None
    source = f"{task.description}|{task.expected_output}"
    return hashlib.md5(source.encode(), usedforsecurity=False).hexdigest()


def _crew_of(scope: Scope | None) -> Any:
    if scope is not None and scope.crew is not None and not isinstance(scope.crew, str):
        return scope.crew
    context = get_crew_context()
    return crews.get(str(context.id)) if context is not None else None


def _prepare(
    target: Target, options: ToolOptions, tool: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> _Call | None:
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
        settings = resolve(options, crew_config)
    except LedgerConfigurationError as exc:
        # Inside a kickoff crewai would turn it into text for the model: a Halt carries it
        # out to the kickoff instead, as it does an uncertain outcome (its cause kept).
        raise halting(exc)  # noqa: B904 - the error itself, or the Halt carrying it
    explicit = kwargs.get(KEY_PARAMETER) if target.takes_key else None
    if explicit is not None:
        key = validate_key(explicit)
    else:
        context = get_crew_context()
        ctx = KeyContext(
            tool=name,
            crew=crew.key if crew is not None else (context.key if context is not None else None),
            task=_task_key(scope.task if scope is not None else None),
            kickoff=_compat.execution_uuid(),
            fingerprint=digest,
        )
        key = derive_key(settings.idempotency_key, arguments, ctx)
    if key in _running.get():
        return None  # a guard inside the same operation (a subclass calling super()._run)
    gate_ctx = _gates.GateContext(
        name, key, crew.key if crew is not None else None,
        _task_key(scope.task if scope is not None else None), _compat.execution_uuid(),
    )  # fmt: skip
    process = _config.process_config()
    gates = _gates.plan(options, crew_config, process, name, key, digest, arguments, gate_ctx)
    if gates is not None:
        approval_events.listen()
    if target.takes_key:
        kwargs[KEY_PARAMETER] = key
    return _Call(tool, name, key, digest, arguments, settings, scope, gates)


# -- events ----------------------------------------------------------------------------


def _emit(
    event_type: type[IdempotencyEvent], call: _Call, record: Record | None, **fields: Any
) -> None:
    try:
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
            kickoff_id=_compat.execution_uuid(),
            task_id=str(task.id) if task is not None else None,
            task_name=(task.name or task.description) if task is not None else None,
            agent_id=str(getattr(agent, "id", None)) if getattr(agent, "id", None) else None,
            agent_role=getattr(agent, "role", None),
            **fields,
        )
        crewai_event_bus.emit(call.tool, event)
    except Exception:  # observers never change what the guard does
        log.exception("could not emit %s for %r", event_type.__name__, call.key)


def _claimed(call: _Call) -> None:
    record = current_claim()  # set by the ledger around the body it is about to run
    takeover = record is not None and record.token > 1
    _emit(IdempotencyClaimEvent, call, record, takeover=takeover)


def _replayed(call: _Call, outcome: Outcome[Any]) -> None:
    history = outcome.record.history
    reconciled = bool(history) and history[-1].kind == "reconcile"
    _emit(IdempotencyReplayEvent, call, outcome.record, reconciled=reconciled)


def _refused(call: _Call, exc: IdempotencyKeyConflict | OperationInProgress) -> None:
    reason = "in_progress" if isinstance(exc, OperationInProgress) else "fingerprint_mismatch"
    record = getattr(exc, "record", None)
    _emit(IdempotencyConflictEvent, call, record, reason=reason, message=str(exc))


def _uncertain(call: _Call, error: OutcomeUncertain) -> BaseException:
    """The exception to raise for an uncertain outcome: a Halt inside a kickoff."""
    halt = call.settings.on_uncertain == "raise"
    _emit(IdempotencyUncertainEvent, call, error.record, reason=error.reason, halted=halt)
    return halting(error) if halt else error


def _failed(call: _Call, exc: Exception) -> BaseException:
    """What a guarded call that did not return raises, with the matching event emitted."""
    if isinstance(exc, IdempotencyKeyConflict | OperationInProgress):
        _refused(call, exc)
        return exc
    if isinstance(exc, OutcomeUncertain):
        return _uncertain(call, exc)
    if isinstance(exc, BodyFailed):
        cause = exc.__cause__
        assert isinstance(cause, Exception)  # the ledger wraps only Exceptions
        if exc.status != Status.UNCERTAIN:
            return _gates.refused(call.gates, cause)
        # The body said (or showed) that its effect may have happened.
        uncertain = OutcomeUncertain(
            call.key, exc.record, exc.reason, ledger=ledger_option(call.settings.ledger.backend)
        )
        uncertain.__cause__ = cause
        return _uncertain(call, uncertain)
    return exc


class ToolReportedFailure(Exception):
    """A body returned crewai's `ToolFailure` (MCP `isError`, crewai >= 1.15.9): recorded
    as FAILED, so the next call runs again instead of replaying the failure for ever; the
    caller still gets the ToolFailure back, as crewai expects."""

    def __init__(self, failure: Any) -> None:
        super().__init__(getattr(failure, "message", str(failure)))
        self.failure = failure


def _checked(result: Any) -> Any:
    """`result` unless it is a returned ToolFailure, which is raised to the ledger: a
    failure saying the call timed out as an unknown outcome (UNCERTAIN), others FAILED."""
    failure = _compat.tool_failure(result)
    if failure is None:
        return result
    if _compat.failure_is_timeout(failure):
        raise OutcomeUnknown(f"the tool returned a ToolFailure reporting a timeout: {failure}")
    raise ToolReportedFailure(failure)


def _returned_failure(exc: Exception) -> Any:
    if (
        isinstance(exc, BodyFailed)
        and exc.status != Status.UNCERTAIN
        and isinstance(exc.__cause__, ToolReportedFailure)
    ):
        return exc.__cause__.failure
    return None


def _observed_error(observation: _otel.Observer, exc: Exception) -> None:
    if isinstance(exc, LedgerUnavailable):
        observation.ledger_error(exc)
        return
    outcome = _otel.outcome_of(exc)
    if isinstance(exc, BodyFailed) and exc.status == Status.UNCERTAIN:
        outcome = "uncertain"
    observation.finish(outcome, getattr(exc, "record", None), exc)


def _raise(call: _Call, exc: Exception) -> NoReturn:
    raised = _failed(call, exc)
    if raised is exc:
        raise exc
    if isinstance(exc, BodyFailed):
        if raised is exc.__cause__:
            raise raised  # the body's own exception, as the body raised it
        raise raised from exc.__cause__
    raise raised from exc


def _succeeded(call: _Call, observation: _otel.Observer, outcome: Outcome[Any]) -> Any:
    if outcome.replayed:
        _replayed(call, outcome)
    observation.finish("replay" if outcome.replayed else "claim", outcome.record)
    return outcome.value


def _unsucceeded(call: _Call, observation: _otel.Observer, exc: Exception) -> Any:
    """A returned ToolFailure goes back to crewai as returned; anything else is raised.
    Called outside the caller's except block, so nothing chains implicitly."""
    _observed_error(observation, exc)
    returned = _returned_failure(exc)
    if returned is not None:
        return returned
    _raise(call, exc)


# -- the guard -------------------------------------------------------------------------


def call(
    target: Target,
    options: ToolOptions,
    tool: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    _compat.refuse_if_untested()
    kwargs = dict(kwargs)
    prepared = _prepare(target, options, tool, args, kwargs)
    if prepared is None:
        return fn(*args, **kwargs)
    ledger = prepared.settings.ledger
    observation = _otel.observe(prepared.tool_name, prepared.key, ledger.backend)

    def body() -> Any:
        _claimed(prepared)
        observation.claimed()
        token = _running.set(_running.get() | {prepared.key})
        try:
            return _gates.run(prepared.gates, ledger.backend, lambda: _checked(fn(*args, **kwargs)))
        finally:
            _running.reset(token)
            observation.returned()

    try:
        outcome = ledger.execute(
            prepared.key,
            body,
            fingerprint=prepared.fingerprint,
            args=prepared.args,
            wrap_errors=True,
            **prepared.settings.ledger_options(),
        )
    except Exception as exc:  # noqa: BLE001 - each kind is sorted out in _failed
        error: Exception = exc
    else:
        return _succeeded(prepared, observation, outcome)
    return _unsucceeded(prepared, observation, error)


async def acall(
    target: Target,
    options: ToolOptions,
    tool: Any,
    fn: Callable[..., Awaitable[Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    _compat.refuse_if_untested()
    kwargs = dict(kwargs)
    prepared = _prepare(target, options, tool, args, kwargs)
    if prepared is None:
        return await fn(*args, **kwargs)
    ledger = prepared.settings.ledger
    observation = _otel.observe(prepared.tool_name, prepared.key, ledger.backend)

    async def body() -> Any:
        _claimed(prepared)
        observation.claimed()
        token = _running.set(_running.get() | {prepared.key})
        try:

            async def checked() -> Any:  # a returned ToolFailure counts as failed at the gates
                return _checked(await fn(*args, **kwargs))

            return await _gates.arun(prepared.gates, ledger.backend, checked)
        finally:
            _running.reset(token)
            observation.returned()

    try:
        outcome = await ledger.aexecute(
            prepared.key,
            body,
            fingerprint=prepared.fingerprint,
            args=prepared.args,
            wrap_errors=True,
            **prepared.settings.ledger_options(),
        )
    except Exception as exc:  # noqa: BLE001 - each kind is sorted out in _failed
        error: Exception = exc
    else:
        return _succeeded(prepared, observation, outcome)
    return _unsucceeded(prepared, observation, error)
