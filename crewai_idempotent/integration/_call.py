"""What a guarded call runs inside, shared by the patches, the guard and the gates.

- The kickoff boundary (`boundary`/`aboundary`, installed around tasks and agent
  kickoffs): how deep the call is (`depth`) and what crewai is running (`scope`).
- `Halt`, which carries an error through crewai out to the outermost boundary.
- The marks of a guarded callable, and the key parameter its signature hides.

Light on purpose: `install()` loads this module inside `import crewai` (the activation
budget), so it imports nothing of ours that reaches the ledger; nor, for its types, the
options (`_config` reaches this module through the gates: a tool's options and a crew's
config are kept on their models by `_stash`). crewai is
imported inside functions: this module is loaded before crewai has finished importing.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from typing import Any

KEY_PARAMETER = "idempotency_key"  # a body may take its derived key under this name
GUARD_MARK = "__crewai_idempotent_guard__"  # on a guarded function: the function it guards
METHODS = ("_run", "_arun")  # the bodies of a class tool


class Scope:
    """What crewai is running around a tool call (crewai keeps no ContextVar for these).

    A plain class rather than a dataclass: building one costs a few hundred microseconds
    of the activation budget."""

    __slots__ = ("agent", "crew", "task")

    def __init__(self, task: Any = None, agent: Any = None, crew: Any = None) -> None:
        self.task = task
        self.agent = agent
        self.crew = crew


scope: ContextVar[Scope | None] = ContextVar("crewai_idempotent_scope", default=None)
depth: ContextVar[int] = ContextVar("crewai_idempotent_boundaries", default=0)

# Crews by id, for calls whose scope does not name the crew (crewai's own crew context
# carries only the id and key).
crews: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


class Halt(BaseException):
    """Carries an error (an `OutcomeUncertain`, a pending approval, a bad ledger setting)
    through crewai to the kickoff.

    crewai turns every `Exception` a tool raises into an observation for the model (and
    the ReAct path retries it), so an uncertain outcome raised as itself would only
    become text the model can talk its way past. A `BaseException` passes those
    `except Exception` layers, skips the agent and guardrail retries, and is turned back
    into the error at the outermost task or kickoff (`boundary`).
    """

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def halting(error: Exception) -> BaseException:
    """`error` wrapped in a Halt inside a kickoff, so it stops the kickoff; else itself."""
    return Halt(error) if depth.get() > 0 else error


def hide_key(signature: inspect.Signature) -> inspect.Signature:
    """A guarded body's signature as crewai and the model see it: without the key."""
    params = [p for p in signature.parameters.values() if p.name != KEY_PARAMETER]
    return signature.replace(parameters=params)


# -- pydantic models ----------------------------------------------------------------


def fields_of(cls: Any) -> Any:
    """A model class's fields. pydantic >= 2.10 keeps them in `__pydantic_fields__` (its
    `model_fields` became a computed property, several times slower on every call);
    earlier releases in `model_fields` itself."""
    return getattr(cls, "__pydantic_fields__", None) or cls.model_fields


# -- kickoff boundaries ----------------------------------------------------------------


@contextlib.contextmanager
def _entered(where: Scope | None) -> Iterator[None]:
    """One level deeper into crewai (a task, an agent's kickoff); at the outermost level, a
    Halt raised inside comes out as the error it carries."""
    from crewai.events.event_context import get_current_parent_id

    level = depth.get()
    depth_token = depth.set(level + 1)
    scope_token = scope.set(where) if where is not None else None
    open_scope = get_current_parent_id()
    try:
        yield
    except Halt as halt:
        if level == 0:
            _abandon_event_scopes(open_scope)
            raise _unwrap(halt) from halt.error.__cause__
        raise
    finally:
        if scope_token is not None:
            scope.reset(scope_token)
        depth.reset(depth_token)


def boundary(fn: Callable[..., Any], where: Scope | None, args: Any, kwargs: Any) -> Any:
    with _entered(where):
        return fn(*args, **kwargs)


async def aboundary(
    fn: Callable[..., Awaitable[Any]], where: Scope | None, args: Any, kwargs: Any
) -> Any:
    with _entered(where):
        return await fn(*args, **kwargs)


def _unwrap(halt: Halt) -> Exception:
    error = halt.error.with_traceback(halt.__traceback__)  # from the tool up to here
    error.__suppress_context__ = True
    return error


def _abandon_event_scopes(open_scope: str | None) -> None:
    """Drop the event scopes (task, agent, tool started...) the Halt left open, so that
    the crew's own failure event closes the crew's scope instead of warning about a
    mismatch. No events are invented; the uncertain event says what happened."""
    from crewai.events.event_context import get_current_parent_id, pop_event_scope

    while get_current_parent_id() not in (None, open_scope):
        pop_event_scope()


# -- the flow a call runs in -----------------------------------------------------------

# The crewAI Flow whose method is running, set around each method (`in_flow`, installed
# on Flow._execute_method), so a key can name the flow's persisted state (`{flow}`).
# crewai's own `current_flow_id` is set before a resumed flow's state id is restored from
# `kickoff(inputs={"id": ...})`, so it names a fresh id on every resume; the state's id,
# read when the key is derived, is the one `@persist` saves under.
flow: ContextVar[Any] = ContextVar("crewai_idempotent_flow", default=None)


def in_flow(execute: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """`Flow._execute_method` (async on every supported release) with the flow set as
    the one its method runs in; a sync method's thread copies the context after this.

    The outermost flow of the user's is the one: a resume of it runs the flows inside it
    again under new ids. crewai's own flows (its flow-based agent executor, memory
    recall) are machinery inside a crew, never the flow a key means."""

    async def execute_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if flow.get() is not None or type(self).__module__.partition(".")[0] == "crewai":
            return await execute(self, *args, **kwargs)
        token = flow.set(self)
        try:
            return await execute(self, *args, **kwargs)
        finally:
            flow.reset(token)

    execute_method.__wrapped__ = execute  # type: ignore[attr-defined]
    return execute_method
