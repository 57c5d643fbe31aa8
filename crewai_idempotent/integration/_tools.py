"""Flagging tools: `@tool(..., idempotent=True)`, `MyTool(idempotent=True)`, class defaults,
and `idempotent(tool)` for tools someone else wrote."""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, create_model

from . import _compat, _guard
from ._config import OPTION_NAMES, ToolOptions
from ._keying import KEY_PARAMETER, check_template

if TYPE_CHECKING:
    from crewai.tools.base_tool import BaseTool

# crewai is imported inside functions, for the reason given in _guard's docstring.

GUARD_MARK = "__crewai_idempotent_guard__"  # on a guarded function: the function it guards
METHODS = ("_run", "_arun")


def ledger_owns_cache(_args: Any = None, _result: Any = None) -> bool:
    """`cache_function` of idempotent tools: crewai's result cache never stores them.

    Its read-then-add is not atomic and lives in one process; the ledger claims the key
    before the body runs and replays the receipt instead.
    """
    return False


def hide_key(signature: inspect.Signature) -> inspect.Signature:
    params = [p for p in signature.parameters.values() if p.name != KEY_PARAMETER]
    return signature.replace(parameters=params)


# -- guarded callables -----------------------------------------------------------------


def guard_function(fn: Callable[..., Any], tool_name: str, options: ToolOptions, tool: Any) -> Any:
    """A Tool's `func`, guarded. `Tool.run`, `Tool._run` (ReAct), `Tool._arun` and direct
    calls of `tool.func` all go through it."""
    fn = getattr(fn, GUARD_MARK, fn)
    target = _guard.Target.of(fn, method=False, tool_name=tool_name)
    source = _weak(tool)

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def guarded_async(*args: Any, **kwargs: Any) -> Any:
            return await _guard.acall(target, options, source(), fn, args, kwargs)

        guarded: Any = guarded_async
    else:

        @functools.wraps(fn)
        def guarded_sync(*args: Any, **kwargs: Any) -> Any:
            return _guard.call(target, options, source(), fn, args, kwargs)

        guarded = guarded_sync
    guarded.__signature__ = hide_key(target.signature)
    setattr(guarded, GUARD_MARK, fn)
    return guarded


def _weak(tool: Any) -> Callable[[], Any]:
    try:
        ref = weakref.ref(tool)
    except TypeError:
        return lambda: tool
    return ref


def guard_method(original: Callable[..., Any]) -> Any:
    """A class tool's `_run`/`_arun`, guarded for the instances flagged idempotent; others
    pass straight through."""
    target = _guard.Target.of(original, method=True)
    options_of = _options_for_call

    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def guarded_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            options = options_of(self)
            if options is None or not options.idempotent:
                return await original(self, *args, **kwargs)
            return await _guard.acall(target, options, self, original, (self, *args), kwargs)

        guarded: Any = guarded_async
    else:

        @functools.wraps(original)
        def guarded_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
            options = options_of(self)
            if options is None or not options.idempotent:
                return original(self, *args, **kwargs)
            return _guard.call(target, options, self, original, (self, *args), kwargs)

        guarded = guarded_sync
    guarded.__signature__ = hide_key(target.signature)
    setattr(guarded, GUARD_MARK, original)
    return guarded


def _options_for_call(tool: Any) -> ToolOptions | None:
    options = _guard.options_of(tool)
    if options is not None or "idempotent" not in type(tool).model_fields:
        return options
    # Declared idempotent but never through __init__: pydantic's model_validate (a
    # checkpoint restore, a tool built from config) skips it. Flag it now.
    options = options_from_instance(tool, {})
    if options is not None and options.idempotent:
        flag(tool, options)
        return options
    return None


def wants_method_guards(cls: type) -> bool:
    from crewai.tools.base_tool import BaseTool, Tool

    # A Tool's body is its `func`, guarded per instance; guarding its `_run` as well
    # would claim a second key for the same call.
    return issubclass(cls, BaseTool) and cls is not BaseTool and not issubclass(cls, Tool)


# -- flagging an instance --------------------------------------------------------------


def _argument_names(tool: BaseTool) -> set[str] | None:
    from crewai.tools.base_tool import Tool

    schema = tool.args_schema
    names = set(getattr(schema, "model_fields", {})) - {KEY_PARAMETER}
    if names:
        return names
    body = tool.func if isinstance(tool, Tool) else tool._run
    try:
        params = inspect.signature(getattr(body, GUARD_MARK, body)).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return names


def _schema_without_key(schema: type[BaseModel]) -> type[BaseModel]:
    """The same fields and config without `idempotency_key` (validators are not carried
    over: crewai builds these schemas from signatures, which have none)."""
    fields = {
        name: (info.annotation, info)
        for name, info in schema.model_fields.items()
        if name != KEY_PARAMETER
    }
    slim: type[BaseModel] = create_model(  # type: ignore[call-overload]
        schema.__name__, __config__=schema.model_config, __doc__=schema.__doc__, **fields
    )
    return slim


def flag(tool: BaseTool, options: ToolOptions) -> None:
    """Make `tool` (in place) idempotent with `options`, or plain again with idempotent=False."""
    from crewai.tools.base_tool import Tool

    name = _compat.tool_name(tool.name)
    if options.idempotent and isinstance(options.idempotency_key, str):
        check_template(options.idempotency_key, name, _argument_names(tool))
    _guard.stash(tool, options)
    if isinstance(tool, Tool):
        original = getattr(tool.func, GUARD_MARK, tool.func)
        tool.func = (
            guard_function(original, name, options, tool) if options.idempotent else original
        )
    if not options.idempotent:
        return
    schema = tool.args_schema
    if KEY_PARAMETER in getattr(schema, "model_fields", {}):
        # The model must never choose the key; the guard passes the derived one in.
        tool.args_schema = _schema_without_key(schema)
        _compat.refresh_description(tool)
    if tool.cache_function not in (_compat.default_cache_function(), ledger_owns_cache):
        warnings.warn(
            f"tool {name!r} is idempotent: its cache_function is replaced, because crewai's "
            "result cache is bypassed for idempotent tools and the ledger replays them",
            stacklevel=3,
        )
    tool.cache_function = ledger_owns_cache


def options_from_instance(tool: BaseTool, given: dict[str, Any]) -> ToolOptions | None:
    """Options declared as fields on the tool's class, overridden by those given."""
    declared = {n: getattr(tool, n) for n in OPTION_NAMES if n in type(tool).model_fields}
    merged = {**{k: v for k, v in declared.items() if v is not None}, **given}
    if not merged or ("idempotent" not in merged and not given):
        return None
    return ToolOptions.from_kwargs(type(tool).__name__, merged)


def idempotent(
    tool: BaseTool,
    key: Any = None,
    *,
    idempotency_key: Any = None,
    wait_s: float | None = None,
    lease_s: float | None = None,
    ttl: float | None = None,
    reconcile: Callable[[str, Any], Any] | None = None,
    on_stale: str | None = None,
    fingerprint: Callable[[dict[str, Any]], Any] | None = None,
    **gates: Any,
) -> BaseTool:
    """A guarded copy of `tool` (a crewai_tools or MCP tool, or any BaseTool).

    `key` (or `idempotency_key`) is the key template or callable; the other options are
    those of `@tool(..., idempotent=True)`, approval gates and spend caps included
    (`approval=`, `spend=`, `caps=`, ...). The original tool is left as it was.
    """
    from crewai.tools.base_tool import BaseTool, Tool

    from ._patch import install

    if not isinstance(tool, BaseTool):
        raise TypeError(f"idempotent() takes a crewai BaseTool, not {type(tool).__name__}")
    if key is not None and idempotency_key is not None:
        raise TypeError("idempotent(): give key= or idempotency_key=, not both")
    install()
    options = ToolOptions(
        idempotent=True,
        idempotency_key=key if key is not None else idempotency_key,
        wait_s=wait_s,
        lease_s=lease_s,
        ttl=ttl,
        reconcile=reconcile,
        on_stale=on_stale,  # type: ignore[arg-type]
        fingerprint=fingerprint,
        **gates,
    )
    guarded = tool.model_copy()
    if isinstance(guarded, Tool):
        guarded.func = getattr(guarded.func, GUARD_MARK, guarded.func)
    flag(guarded, options)
    return guarded


def make_tool_decorator(original: Callable[..., Any]) -> Callable[..., Any]:
    """crewai's `@tool`, also taking `idempotent=True` and the idempotency options."""

    @functools.wraps(original)
    def tool(*args: Any, **kwargs: Any) -> Any:
        given = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTION_NAMES}
        options = ToolOptions.from_kwargs("@tool", given)
        from crewai.tools.base_tool import BaseTool

        made = original(*args, **kwargs)
        if options is None:
            return made
        if isinstance(made, BaseTool):
            flag(made, options)
            return made

        def decorate(fn: Callable[..., Any]) -> Any:
            built = made(fn)
            flag(built, options)
            return built

        return decorate

    return tool
