"""`idempotent(tool)`: a guarded copy of a tool someone else wrote.

crewai (and `_flag`, which imports it) is imported inside the function, deliberately:
`from crewai_idempotent import idempotent` must not import crewai.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._call import GUARD_MARK
from ._config import ToolOptions
from ._patch import install

if TYPE_CHECKING:
    from crewai.tools.base_tool import BaseTool


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
    reconcile_timeout_s: float | None = None,
    **gates: Any,
) -> BaseTool:
    """A guarded copy of `tool` (a crewai_tools or MCP tool, or any BaseTool).

    `key` (or `idempotency_key`) is the key template or callable; `wait_s`, `lease_s`,
    `ttl`, `reconcile`, `on_stale`, `fingerprint` and `reconcile_timeout_s` are those of
    `@tool(..., idempotent=True)`, and `gates` its approval gates and spend caps
    (`approval=`, `spend=`, `caps=`, ...). The original tool is left as it was.

    Raises `TypeError` for a `tool` that is not a crewai BaseTool, and
    `LedgerConfigurationError`, `TypeError` or `ValueError` for an option that cannot be
    used, naming it.
    """
    from crewai.tools.base_tool import BaseTool, Tool

    from ._flag import flag

    if not isinstance(tool, BaseTool):
        raise TypeError(f"idempotent() takes a crewai BaseTool, not {type(tool).__name__}")
    if key is not None and idempotency_key is not None:
        raise TypeError("idempotent() takes key= or idempotency_key=, not both")
    install()
    options = ToolOptions(
        idempotent=True,
        idempotency_key=key if key is not None else idempotency_key,
        wait_s=wait_s,
        lease_s=lease_s,
        ttl=ttl,
        reconcile=reconcile,
        on_stale=on_stale,  # type: ignore[arg-type]
        reconcile_timeout_s=reconcile_timeout_s,
        fingerprint=fingerprint,
        **gates,
    )
    guarded = tool.model_copy()
    if isinstance(guarded, Tool):
        guarded.func = getattr(guarded.func, GUARD_MARK, guarded.func)
    flag(guarded, options)
    return guarded
