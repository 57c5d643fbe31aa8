"""Every difference between the crewai releases the integration supports (1.10.0 to 1.15.x).

Each shim is chosen by looking at what the installed crewai has (an attribute, a module,
the source of one function), never by its version number, so a release that fixes or
moves something takes the right branch by itself. `install(set_attr)` runs last in
`_patch._install()` and sets every attribute through `set_attr`, which records what was
there: `uninstall()` undoes the shims with the rest.

The release-by-release findings behind each shim (file and line per release) are in
docs/compatibility.md.

crewai is imported inside functions, for the reason given in _guard's docstring.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import hashlib
import importlib
import inspect
import logging
import os
import re
import unicodedata
import uuid
from collections.abc import Callable
from typing import Any

log = logging.getLogger("crewai_idempotent")

SetAttr = Callable[[Any, str, Any], None]

# -- tools -----------------------------------------------------------------------------


def default_cache_function() -> Any:
    """crewai's default `cache_function`: a named function from 1.14.0, an inline lambda
    before. Whatever the field's default is, it is the one crewai put there."""
    from crewai.tools.base_tool import BaseTool

    field = BaseTool.model_fields.get("cache_function")
    return field.default if field is not None else None


def refresh_description(tool: Any) -> None:
    """Up to 1.15.2 crewai bakes the argument schema into `description` when the tool is
    built, so the ReAct prompt would still list `idempotency_key` after `flag()` removed it
    from the schema. Rebuild the description from the authored text; from 1.15.3 the
    prompt text is computed (`formatted_description`) and there is nothing to rebuild."""
    from crewai.tools.base_tool import BaseTool

    if hasattr(BaseTool, "formatted_description"):
        return
    marker = "\nTool Description: "
    text = tool.description
    regenerate = getattr(tool, "_generate_description", None)
    if isinstance(text, str) and text.startswith("Tool Name: ") and marker in text and regenerate:
        tool.description = text.split(marker, 1)[1]
        regenerate()


# crewai's sanitize_tool_name as of 1.10.1 (unchanged through 1.15.x). 1.10.0 cut long names
# without the hash suffix; keys use this one so that a tool derives the same key on every
# release, and an open record made under one release is found under the next.
_QUOTES = re.compile(r"[\'\"]+")
_CAMEL_UPPER_LOWER = re.compile(r"([A-Z]+)([A-Z][a-z])")
_CAMEL_LOWER_UPPER = re.compile(r"([a-z])([A-Z])")
_DISALLOWED = re.compile(r"[^a-zA-Z0-9]+")
_UNDERSCORES = re.compile(r"_+")
_MAX_TOOL_NAME = 64


@functools.lru_cache(maxsize=1024)
def tool_name(name: str) -> str:
    """The tool's name as the model calls it (crewai >= 1.10.1's `sanitize_tool_name`)."""
    name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode("ascii")
    name = _CAMEL_UPPER_LOWER.sub(r"\1_\2", name)
    name = _CAMEL_LOWER_UPPER.sub(r"\1_\2", name)
    name = _QUOTES.sub("", name.lower())
    name = _UNDERSCORES.sub("_", _DISALLOWED.sub("_", name)).strip("_")
    if len(name) > _MAX_TOOL_NAME:
        suffix = "_" + hashlib.sha256(name.encode()).hexdigest()[:8]
        name = name[: _MAX_TOOL_NAME - len(suffix)].rstrip("_") + suffix
    return name


def tool_failure(result: Any) -> Any:
    """The `ToolFailure` a tool body returned (crewai >= 1.15.9), else None."""
    cls = _tool_failure_class()
    return result if cls is not None and isinstance(result, cls) else None


@functools.cache
def _tool_failure_class() -> type | None:
    try:
        from crewai.tools.tool_failure import ToolFailure
    except ImportError:
        return None
    return ToolFailure


_TIMEOUT_WORDS = re.compile(r"time[\s_-]?out|timed[\s_-]?out|deadline", re.IGNORECASE)


def failure_is_timeout(failure: Any) -> bool:
    """Whether a returned ToolFailure says the call timed out (its effect may then have
    happened): a `code` naming a timeout, or `details["timeout"]` set."""
    code = getattr(failure, "code", None)
    details = getattr(failure, "details", None) or {}
    return bool((isinstance(code, str) and _TIMEOUT_WORDS.search(code)) or details.get("timeout"))


# -- the event bus ---------------------------------------------------------------------


def bus_listens(event_type: type) -> bool:
    """Whether an event of `event_type` emitted now would reach anyone: a handler for the
    type, the run's recorded state (crewai >= 1.14, inside a kickoff), or a stream sink
    (crewai >= 1.15). Built only then, since a guarded replay would otherwise spend most
    of its time building an event nobody reads. Anything unexpected says yes."""
    try:
        bus = _bus or _load_bus()
        if bus._sync_handlers.get(event_type) or bus._async_handlers.get(event_type):
            return True
        if getattr(bus, "runtime_state", None) is not None:
            return True
        sinks = _sinks[0]
        return sinks is not None and bool(sinks.get())
    except Exception:  # noqa: BLE001 - a bus we do not know: emit, as before
        return True


_bus: Any = None
_sinks: list[contextvars.ContextVar[Any] | None] = [None]  # crewai's stream sinks, if any


def _load_bus() -> Any:
    global _bus
    from crewai.events.event_bus import crewai_event_bus

    try:
        from crewai.events import stream_context

        sinks = getattr(stream_context, "_stream_sinks", None)
    except ImportError:  # crewai < 1.15: no streams of events
        sinks = None
    _sinks[0] = sinks if isinstance(sinks, contextvars.ContextVar) else None
    _bus = crewai_event_bus
    return crewai_event_bus


# -- paths -----------------------------------------------------------------------------


def db_storage_path() -> str:
    """crewai's storage folder: `crewai_core.paths` from 1.14.5 (where the old module
    warns on import), `crewai.utilities.paths` before. The same folder in every release."""
    try:
        from crewai_core.paths import db_storage_path as storage
    except ImportError:
        from crewai.utilities.paths import db_storage_path as storage
    return str(storage())


# -- the kickoff id --------------------------------------------------------------------

_kickoff_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "crewai_idempotent_kickoff", default=None
)


@functools.cache
def _crewai_execution_uuid() -> Callable[[], str | None] | None:
    try:
        from crewai.execution import get_execution_uuid
    except ImportError:
        return None
    return get_execution_uuid


def execution_uuid() -> str | None:
    """The id of the kickoff a call runs in: crewai's (crewai.execution, 1.15.16+), else
    the one our own kickoff wrappers set."""
    upstream = _crewai_execution_uuid()
    return upstream() if upstream is not None else _kickoff_id.get()


def kickoff_scope(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` (a kickoff) with a fresh kickoff id, unless one is already running."""
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def akickoff(*args: Any, **kwargs: Any) -> Any:
            if _kickoff_id.get() is not None:
                return await original(*args, **kwargs)
            token = _kickoff_id.set(str(uuid.uuid4()))
            try:
                return await original(*args, **kwargs)
            finally:
                _kickoff_id.reset(token)

        return akickoff

    @functools.wraps(original)
    def kickoff(*args: Any, **kwargs: Any) -> Any:
        if _kickoff_id.get() is not None:
            return original(*args, **kwargs)
        token = _kickoff_id.set(str(uuid.uuid4()))
        try:
            return original(*args, **kwargs)
        finally:
            _kickoff_id.reset(token)

    return kickoff


def _install_kickoff_ids(set_attr: SetAttr) -> None:
    from crewai.agent.core import Agent
    from crewai.crew import Crew
    from crewai.flow.flow import Flow
    from crewai.lite_agent import LiteAgent

    entry_points = (
        (Crew, ("kickoff", "kickoff_async", "akickoff")),
        (Agent, ("kickoff", "kickoff_async")),
        (LiteAgent, ("kickoff",)),
        (Flow, ("kickoff", "kickoff_async")),
    )
    for cls, names in entry_points:
        for name in names:
            # The class that defines it: Flow's kickoff moved to a runtime base in 1.14.7.
            owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
            if owner is not None:
                set_attr(owner, name, kickoff_scope(getattr(owner, name)))


# -- context in worker threads ---------------------------------------------------------


class ContextCopyingThreadPoolExecutor(concurrent.futures.ThreadPoolExecutor):
    """A ThreadPoolExecutor whose tasks run in a copy of the submitter's context, as
    crewai's own code does from 1.11.0 (parallel native tool calls)."""

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)


# The executors that run parallel native tool calls (the experimental one until 1.15.28).
_EXECUTOR_MODULES = (
    "crewai.agents.crew_agent_executor",
    "crewai.experimental.agent_executor",
    "crewai.agents.agent_executor",
)


def _source(obj: Any) -> str | None:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return None


def _install_thread_context(set_attr: SetAttr) -> None:
    """1.10.x submits parallel native tool calls to a pool with no copy of the context:
    the call would run with no crew, no ledger and no kickoff boundary."""
    for name in _EXECUTOR_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        pool = module.__dict__.get("ThreadPoolExecutor")
        if pool is not None and "copy_context" not in _defined_names(module, name):
            set_attr(module, "ThreadPoolExecutor", ContextCopyingThreadPoolExecutor)


def _defined_names(module: Any, name: str) -> set[str]:
    """The names used by the functions and methods defined in the module called `name`.

    Not the module's source: in 1.14.5 and 1.15.x (at least) `import crewai` copies
    base_agent's namespace, `__file__` included, into the executor's module, so
    `inspect.getsource` read base_agent.py, found no `copy_context`, and the executor's own
    pool (which copies the context already) was replaced. The code objects stay the
    module's own.
    """
    names: set[str] = set()
    for obj in list(vars(module).values()):
        if getattr(obj, "__module__", None) != name:
            continue
        members = vars(obj).values() if isinstance(obj, type) else (obj,)
        for member in members:
            # Methods, also behind a classmethod or a decorator (crewAI's flow routers).
            function = getattr(member, "__func__", member)
            for _ in range(16):  # a chain of decorators ends; a cycle is cut here
                inner = getattr(function, "__wrapped__", None)
                if inner is None:
                    break
                function = inner
            names |= _names(function)
    return names


def execute_with_timeout(self: Any, task_prompt: str, task: Any, timeout: int) -> Any:
    """crewai 1.11.0's `Agent._execute_with_timeout` (agent/core.py:533-576): 1.10.x ran
    the agent in a worker thread without the caller's context. Errors map as in 1.10.x."""
    ctx = contextvars.copy_context()
    with concurrent.futures.ThreadPoolExecutor() as executor:
        future = executor.submit(
            ctx.run, self._execute_without_timeout, task_prompt=task_prompt, task=task
        )
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError as e:
            future.cancel()
            raise TimeoutError(
                f"Task '{task.description}' execution timed out after {timeout} seconds. "
                "Consider increasing max_execution_time or optimizing the task."
            ) from e
        except Exception as e:
            future.cancel()
            raise RuntimeError(f"Task execution failed: {e!s}") from e


def _names(fn: Any) -> set[str]:
    """The global and attribute names a function's code (nested code included) uses: a
    cheap first look, before reading its source costs a tokenizer run inside `import
    crewai` (the activation budget: see the integration package's docstring)."""
    names: set[str] = set()
    codes = [getattr(fn, "__code__", None)]
    while codes:
        code = codes.pop()
        if code is not None and hasattr(code, "co_names"):
            names.update(code.co_names)
            codes.extend(c for c in code.co_consts if hasattr(c, "co_names"))
    return names


def _install_timeout_context(set_attr: SetAttr) -> None:
    from crewai.agent.core import Agent

    method = Agent.__dict__.get("_execute_with_timeout")
    if method is not None and "copy_context" in _names(method):
        return  # 1.11.0 and later run the agent in a copy of the context
    source = _source(method) if method is not None else None
    if source is not None and "copy_context" not in source and "ctx.run" not in source:
        set_attr(Agent, "_execute_with_timeout", execute_with_timeout)


async def ainvoke(self: Any, input: Any, config: Any = None, **kwargs: Any) -> Any:
    """crewai's `CrewStructuredTool.ainvoke` (the same in every release 1.10.0 to 1.15.30),
    running a sync tool in the caller's context as `asyncio.to_thread` does: crewai's
    `run_in_executor` drops it, so the async ReAct path of CrewAgentExecutor would call
    the tool with no crew, no ledger and no kickoff boundary."""
    from crewai.tools.structured_tool import ToolUsageLimitExceededError

    parsed_args = self._parse_args(input)
    if self.has_reached_max_usage_count():
        name = tool_name(self.name)
        raise ToolUsageLimitExceededError(
            f"Tool '{name}' has reached its maximum usage limit of {self.max_usage_count}. "
            f"You should not use the {name} tool again."
        )
    self._increment_usage_count()
    if inspect.iscoroutinefunction(self.func):
        return await self.func(**parsed_args, **kwargs)
    import asyncio  # loaded already (this runs on its loop); `import crewai_idempotent` is not

    ctx = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(
        None, functools.partial(ctx.run, self.func, **parsed_args, **kwargs)
    )


def _install_ainvoke_context(set_attr: SetAttr) -> None:
    from crewai.tools.structured_tool import CrewStructuredTool

    names = _names(CrewStructuredTool.__dict__.get("ainvoke"))
    if "copy_context" in names or "to_thread" in names:
        return  # fixed upstream
    # What the method is made of, read from its code: its source would cost a tokenizer
    # run inside `import crewai` (about a millisecond of the activation budget).
    if not {"run_in_executor", "_increment_usage_count", "_parse_args", "func"} <= names:
        log.warning(
            "crewai's CrewStructuredTool.ainvoke is not the one crewai-idempotent knows; "
            "left as it is (async ReAct calls may not carry the crew's ledger)"
        )
        return
    set_attr(CrewStructuredTool, "ainvoke", ainvoke)


# -- installing ------------------------------------------------------------------------


def install(set_attr: SetAttr) -> None:
    """Every shim the installed crewai needs, each through `set_attr`."""
    if _crewai_execution_uuid() is None:
        _install_kickoff_ids(set_attr)
    _install_thread_context(set_attr)
    _install_timeout_context(set_attr)
    _install_ainvoke_context(set_attr)


def init_subclass_of(base: type, hook: Callable[[type], None]) -> classmethod[Any, Any, Any]:
    """`base.__init_subclass__` followed by `hook(cls)`. crewai defines one on BaseTool
    from 1.14.0 (its checkpoint registry); before, the next class up has it."""
    original = base.__dict__.get("__init_subclass__")

    def init_subclass(cls: type, **kwargs: Any) -> None:
        if original is not None:
            original.__get__(None, cls)(**kwargs)
        else:
            parent: Any = super(base, cls)
            parent.__init_subclass__(**kwargs)
        hook(cls)

    return classmethod(init_subclass)


# -- releases outside the tested range: what the user says -------------------------------
# What a guarded call does about such a release (refuse it, or wait for its verdict) is the
# release gate's (`_release`), beside this layer: the gate reads this choice, this layer
# never reads the gate.

ALLOW_UNTESTED_ENV = "CREWAI_IDEMPOTENT_ALLOW_UNTESTED"
_YES = ("1", "true", "yes", "on")
_NO = ("0", "false", "no", "off")


def untested_choice() -> bool | None:
    """What CREWAI_IDEMPOTENT_ALLOW_UNTESTED says: True (run the full guard on an untested
    release), False (refuse it, and never verify one), None (unset: a release inside the
    supported minor verifies itself). A value that is neither is False: fail closed."""
    value = os.environ.get(ALLOW_UNTESTED_ENV, "").strip().lower()
    if not value:
        return None
    return value in _YES


def untested_allowed() -> bool:
    return untested_choice() is True
