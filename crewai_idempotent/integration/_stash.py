"""A tool's options and a crew's config, kept on the pydantic model that has them.

Flagging a tool (`_flag`) and building a crew (`_patch`) put them in the model's private
attributes; the patches (`_tools`, `_strict`) and the guard (`_guard`) read them back on
every call, so reading one is a dict lookup and nothing more. Loaded inside `import
crewai` (the activation budget): it imports nothing of ours at run time, and the options'
types only for the annotations (`_config` never imports this module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._config import IdempotencyConfig, ToolOptions

# Keys in a pydantic model's private-attribute dict: a tool's options, a crew's config.
TOOL_STASH = "_crewai_idempotency"
CREW_STASH = "_crewai_idempotency_crew"


def _stash(model: Any, name: str, value: Any) -> None:
    private = model.__pydantic_private__
    if private is None:
        object.__setattr__(model, "__pydantic_private__", {name: value})
    else:
        private[name] = value


def _stashed(model: Any, name: str) -> Any:
    private = getattr(model, "__pydantic_private__", None)
    return private.get(name) if private else None


def stash_options(tool: Any, options: ToolOptions) -> None:
    _stash(tool, TOOL_STASH, options)


def options_of(tool: Any) -> ToolOptions | None:
    """The options a tool was flagged with, or None: on every call of a class tool, so
    this is a dict lookup and nothing more."""
    return _stashed(tool, TOOL_STASH)


def stash_config(crew: Any, config: IdempotencyConfig) -> None:
    _stash(crew, CREW_STASH, config)


def config_of(crew: Any) -> IdempotencyConfig | None:
    return _stashed(crew, CREW_STASH)
