"""Installing the integration into crewai, and taking it out again exactly.

Every change is an attribute set on a crewai class or module (or on a tool class
created while installed); each is recorded with what was there before, and
`uninstall()` puts that back in reverse order.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any

from ._config import OPTION_NAMES, check_crew_ledger, merge_crew_settings

SUPPORTED = ((1, 15, 30), (1, 16, 0))  # crewai >= 1.15.30, < 1.16: the range the tests cover
_ABSENT: Any = object()


class UnsupportedCrewAIVersion(RuntimeError):
    """The installed crewai is outside the range this integration was written and tested for."""


_lock = threading.RLock()
_patches: list[tuple[Any, str, Any]] = []  # (owner, attribute, previous value or _ABSENT)
_installed = False


def _version_tuple(version: str) -> tuple[int, ...] | None:
    match = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(part) for part in match.groups()) if match else None


def check_version(version: str) -> None:
    parsed = _version_tuple(version)
    low, high = SUPPORTED
    if parsed is None or not (low <= parsed < high):
        raise UnsupportedCrewAIVersion(
            f"crewai-idempotent supports crewai >=1.15.30,<1.16; crewai {version} is installed. "
            "The guard relies on crewai internals that this version may not have, so it refuses "
            "to run rather than guard tools partially. Install a supported crewai, or set "
            "CREWAI_IDEMPOTENT_AUTOLOAD=0 and do not call crewai_idempotent.install()."
        )


def _set(owner: Any, name: str, value: Any) -> None:
    _patches.append((owner, name, owner.__dict__.get(name, _ABSENT)))
    setattr(owner, name, value)


def is_installed() -> bool:
    return _installed


def install() -> None:
    """Patch crewai so that tools flagged idempotent are guarded. Safe to call twice."""
    global _installed
    with _lock:
        if _installed:
            return
        import crewai

        if _natively_guarded():
            # A crewai with the upstream patch (patches/) guards these tools itself; a second
            # guard would claim every call twice, in two ledgers.
            warnings.warn(
                "crewai guards idempotent tools natively (crewai.tools.idempotency); "
                "crewai-idempotent's integration stands down",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        check_version(crewai.__version__)
        try:
            _install()
        except BaseException:
            _undo()
            raise
        _installed = True
    from .._autoload import remove_import_hook

    remove_import_hook()  # crewai is loaded: a hook waiting for it has nothing left to do


def _natively_guarded() -> bool:
    from crewai.tools.base_tool import BaseTool

    fields = BaseTool.__pydantic_fields__
    return "idempotent" in fields and not _installed


def uninstall() -> None:
    """Restore every attribute `install()` changed. Tools flagged while installed keep
    their guarded function (they were declared idempotent); classes do not."""
    global _installed
    with _lock:
        _undo()
        _installed = False


def _undo() -> None:
    while _patches:
        owner, name, previous = _patches.pop()
        if previous is _ABSENT:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)
        else:
            setattr(owner, name, previous)


def _install() -> None:
    import crewai.tools as tools_module
    import crewai.tools.base_tool as base_tool_module
    from crewai.agent.core import Agent
    from crewai.crew import Crew
    from crewai.lite_agent import LiteAgent
    from crewai.task import Task
    from crewai.tools.base_tool import BaseTool

    from . import _guard, _tools

    # @tool(..., idempotent=True, idempotency_key=...)
    original_tool = base_tool_module.tool
    decorator = _tools.make_tool_decorator(original_tool)
    _set(base_tool_module, "tool", decorator)
    if tools_module.tool is original_tool:
        _set(tools_module, "tool", decorator)

    # MyTool(idempotent=True, ...) and class defaults `idempotent: bool = True`
    _set(BaseTool, "__init__", _tool_init(BaseTool.__init__))

    # class tools: guard _run/_arun of every subclass, now and when defined later
    def guard_class(cls: type) -> None:
        if not _tools.wants_method_guards(cls):
            return
        for name in _tools.METHODS:
            method = cls.__dict__.get(name)
            # Plain functions only: a staticmethod or other descriptor is left alone.
            if inspect.isfunction(method) and not hasattr(method, _tools.GUARD_MARK):
                _set(cls, name, _tools.guard_method(method))

    def walk(cls: type) -> None:
        sub: type
        for sub in cls.__subclasses__():
            guard_class(sub)
            walk(sub)

    walk(BaseTool)
    original_init_subclass = BaseTool.__dict__["__init_subclass__"]

    def init_subclass(cls: type, **kwargs: Any) -> None:
        original_init_subclass.__get__(None, cls)(**kwargs)
        guard_class(cls)

    _set(BaseTool, "__init_subclass__", classmethod(init_subclass))

    # Crew(idempotency=IdempotencyConfig(...)) and Crew(cache_backend=...)
    _set(Crew, "__init__", _crew_init(Crew.__init__))
    _set(Crew, "copy", _crew_copy(Crew.copy))

    # Where an uncertain outcome stops a kickoff, and what a tool call runs inside.
    def task_scope(task: Any, agent: Any = None, *_: Any, **kw: Any) -> _guard.Scope:
        agent = agent or kw.get("agent") or task.agent
        return _guard.Scope(task=task, agent=agent, crew=getattr(agent, "crew", None))

    def agent_scope(agent: Any, *_: Any, **__: Any) -> _guard.Scope:
        return _guard.Scope(agent=agent, crew=getattr(agent, "crew", None))

    _set(Task, "_execute_core", _boundary(Task._execute_core, task_scope))
    _set(Task, "_aexecute_core", _aboundary(Task._aexecute_core, task_scope))
    _set(Agent, "kickoff", _boundary(Agent.kickoff, agent_scope))
    _set(Agent, "kickoff_async", _aboundary(Agent.kickoff_async, agent_scope))
    _set(LiteAgent, "kickoff", _boundary(LiteAgent.kickoff, agent_scope))


def _tool_init(original: Callable[..., None]) -> Callable[..., None]:
    from . import _guard, _tools

    @functools.wraps(original)
    def init(self: Any, /, **data: Any) -> None:
        fields = type(self).model_fields
        given = {k: data.pop(k) for k in OPTION_NAMES if k in data and k not in fields}
        original(self, **data)
        options = _tools.options_from_instance(self, given)
        if options is not None and (options.idempotent or _guard.options_of(self) is not None):
            _tools.flag(self, options)

    # Tells pydantic this is still BaseModel's own __init__: validating a dict into a
    # tool model keeps bypassing __init__ exactly as before.
    init.__pydantic_base_init__ = True  # type: ignore[attr-defined]
    return init


def _crew_init(original: Callable[..., None]) -> Callable[..., None]:
    from . import _guard

    @functools.wraps(original)
    def init(self: Any, /, **data: Any) -> None:
        fields = type(self).model_fields
        idempotency = data.pop("idempotency", None) if "idempotency" not in fields else None
        cache_backend = data.pop("cache_backend", None) if "cache_backend" not in fields else None
        config = merge_crew_settings(idempotency, cache_backend, type(self).__name__)
        check_crew_ledger(config)
        original(self, **data)
        if config is not None:
            _guard.stash(self, config)
            _guard.crews[str(self.id)] = self

    init.__pydantic_base_init__ = True  # type: ignore[attr-defined]
    return init


def _crew_copy(original: Callable[..., Any]) -> Callable[..., Any]:
    from . import _guard

    @functools.wraps(original)
    def copy(self: Any) -> Any:
        duplicate = original(self)
        config = _guard.stashed(self)
        if config is not None:
            _guard.stash(duplicate, config)
            _guard.crews[str(duplicate.id)] = duplicate
        return duplicate

    return copy


def _boundary(original: Callable[..., Any], scope: Callable[..., Any]) -> Callable[..., Any]:
    from . import _guard

    @functools.wraps(original)
    def at_boundary(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _guard.boundary(original, scope(self, *args, **kwargs), (self, *args), kwargs)

    return at_boundary


def _aboundary(original: Callable[..., Any], scope: Callable[..., Any]) -> Callable[..., Any]:
    from . import _guard

    @functools.wraps(original)
    async def at_boundary(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await _guard.aboundary(original, scope(self, *args, **kwargs), (self, *args), kwargs)

    return at_boundary
