"""What `install()` puts around crewai's tools: `@tool` and `BaseTool.__init__` taking the
idempotency options, and a guard around every class tool's `_run`/`_arun`.

Light on purpose: `install()` runs inside `import crewai`, and every call of an unflagged
class tool passes through `guard_method`'s wrapper, which then costs one dict lookup. A
tool with an idempotency option loads `_flag` (its options, the ledger) and a flagged call
loads `_guard`; both are imported inside functions here, deliberately, so that neither
activation nor an unflagged tool pays for them (the activation budget, in the package's
docstring).

crewai is imported inside functions too: this module is loaded before crewai has
finished importing.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from _crewai_idempotent_autoload import OPTION_NAMES

from ._call import GUARD_MARK, fields_of, hide_key
from ._stash import TOOL_STASH, options_of

if TYPE_CHECKING:
    from ._config import ToolOptions
    from ._guard import Target


def make_tool_decorator(original: Callable[..., Any]) -> Callable[..., Any]:
    """crewai's `@tool`, also taking `idempotent=True` and the idempotency options."""

    @functools.wraps(original)
    def tool(*args: Any, **kwargs: Any) -> Any:
        given = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTION_NAMES}
        if not given:
            return original(*args, **kwargs)
        from crewai.tools.base_tool import BaseTool

        from . import _flag  # deliberately late, as every import of ours inside a function here
        from ._config import ToolOptions

        options = ToolOptions.from_kwargs("@tool", given)
        made = original(*args, **kwargs)
        if options is None:
            return made
        if isinstance(made, BaseTool):
            _flag.flag(made, options)
            return made

        def decorate(fn: Callable[..., Any]) -> Any:
            built = made(fn)
            _flag.flag(built, options)
            return built

        return decorate

    return tool


def init_taking_options(original: Callable[..., None]) -> Callable[..., None]:
    """`BaseTool.__init__` taking `MyTool(idempotent=True, ...)`, and honouring class
    defaults such as `idempotent: bool = True`."""

    @functools.wraps(original)
    def init(self: Any, /, **data: Any) -> None:
        fields = fields_of(type(self))
        given = {k: data.pop(k) for k in OPTION_NAMES if k in data and k not in fields}
        original(self, **data)
        if not given and not any(name in fields for name in OPTION_NAMES):
            return  # a plain tool: nothing to load
        from . import _flag

        options = _flag.options_from_instance(self, given)
        if options is not None and (options.idempotent or options_of(self) is not None):
            _flag.flag(self, options)

    # Tells pydantic this is still BaseModel's own __init__: validating a dict into a
    # tool model keeps bypassing __init__ exactly as before.
    init.__pydantic_base_init__ = True  # type: ignore[attr-defined]
    return init


def guard_method(original: Callable[..., Any]) -> Any:
    """A class tool's `_run`/`_arun`, guarded for the instances flagged idempotent; others
    pass straight through."""
    target: Target | None = None

    def target_of() -> Target:
        nonlocal target
        if target is None:
            from ._guard import Target

            target = Target.of(original, method=True)
        return target

    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def guarded_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            # Every call of every class tool asks, so the checks are inline: flagged (its
            # options stashed), certainly plain (nothing stashed, no `idempotent` field),
            # or declared idempotent and never flagged (_options_for_call flags it).
            private = getattr(self, "__pydantic_private__", None)
            options = private.get(TOOL_STASH) if private else None
            if options is None:
                if "idempotent" not in fields_of(type(self)):
                    return await original(self, *args, **kwargs)
                options = _options_for_call(self)
                if options is None:
                    return await original(self, *args, **kwargs)
            elif not options.idempotent:
                return await original(self, *args, **kwargs)
            guard = _guard_module or _load_guard()
            return await guard.acall(
                target or target_of(), options, self, original, (self, *args), kwargs
            )

        guarded: Any = guarded_async
    else:

        @functools.wraps(original)
        def guarded_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
            # Every call of every class tool asks, so the checks are inline: flagged (its
            # options stashed), certainly plain (nothing stashed, no `idempotent` field),
            # or declared idempotent and never flagged (_options_for_call flags it).
            private = getattr(self, "__pydantic_private__", None)
            options = private.get(TOOL_STASH) if private else None
            if options is None:
                if "idempotent" not in fields_of(type(self)):
                    return original(self, *args, **kwargs)
                options = _options_for_call(self)
                if options is None:
                    return original(self, *args, **kwargs)
            elif not options.idempotent:
                return original(self, *args, **kwargs)
            guard = _guard_module or _load_guard()
            return guard.call(target or target_of(), options, self, original, (self, *args), kwargs)

        guarded = guarded_sync
    guarded.__signature__ = hide_key(inspect.signature(original))
    setattr(guarded, GUARD_MARK, original)
    return guarded


_guard_module: Any = None


def _load_guard() -> Any:
    """The guard's module, imported with the first flagged call (not at activation) and
    kept: an import statement costs a microsecond on every call."""
    global _guard_module
    from . import _guard

    _guard_module = _guard
    return _guard


def _options_for_call(tool: Any) -> ToolOptions | None:
    """The options of a tool flagged idempotent, else None (on every class-tool call)."""
    options = options_of(tool)
    if options is not None:
        return options if options.idempotent else None
    if "idempotent" not in fields_of(type(tool)):
        return None
    # Declared idempotent but never through __init__: pydantic's model_validate (a
    # checkpoint restore, a tool built from config) skips it. Flag it now.
    from . import _flag

    options = _flag.options_from_instance(tool, {})
    if options is not None and options.idempotent:
        _flag.flag(tool, options)
        return options
    return None


def wants_method_guards(cls: type) -> bool:
    from crewai.tools.base_tool import BaseTool, Tool

    # A Tool's body is its `func`, guarded per instance; guarding its `_run` as well
    # would claim a second key for the same call.
    return issubclass(cls, BaseTool) and cls is not BaseTool and not issubclass(cls, Tool)
