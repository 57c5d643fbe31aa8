"""Flagging one tool: its options checked, its function guarded, the key hidden from the
model, crewai's result cache switched off for it.

Loaded with the first tool that has an idempotency option (see `_tools`), so the guard
and the ledger load with it, never at activation.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from crewai.tools.base_tool import Tool
from pydantic import BaseModel, create_model

from ..reconciliation._registry import remember_tool
from . import _compat, _guard
from ._call import GUARD_MARK, KEY_PARAMETER, fields_of, hide_key
from ._config import OPTION_NAMES, ToolOptions
from ._keying import check_template
from ._stash import stash_options

if TYPE_CHECKING:
    from crewai.tools.base_tool import BaseTool


def ledger_owns_cache(_args: Any = None, _result: Any = None) -> bool:
    """`cache_function` of idempotent tools: crewai's result cache never stores them.

    Its read-then-add is not atomic and lives in one process; the ledger claims the key
    before the body runs and replays the receipt instead.
    """
    return False


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


def _argument_names(tool: BaseTool) -> set[str] | None:
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
    name = _compat.tool_name(tool.name)
    if options.idempotent and isinstance(options.idempotency_key, str):
        check_template(options.idempotency_key, name, _argument_names(tool))
    stash_options(tool, options)
    if isinstance(tool, Tool):
        original = getattr(tool.func, GUARD_MARK, tool.func)
        tool.func = (
            guard_function(original, name, options, tool) if options.idempotent else original
        )
    if not options.idempotent:
        return
    remember_tool(name, options.reconcile)  # a sweeper in this process finds it by name
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


def options_from_instance(tool: BaseTool, given: Mapping[str, Any]) -> ToolOptions | None:
    """Options declared as fields on the tool's class, overridden by those given."""
    declared = {n: getattr(tool, n) for n in OPTION_NAMES if n in fields_of(type(tool))}
    merged = {**{k: v for k, v in declared.items() if v is not None}, **given}
    if not merged or ("idempotent" not in merged and not given):
        return None
    return ToolOptions.from_kwargs(type(tool).__name__, merged)
