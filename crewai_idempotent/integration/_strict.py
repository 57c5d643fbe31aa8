"""Tools that refuse to run unguarded: `IdempotentTool` and `@idempotent_tool`.

`idempotent: bool = True` on a plain `BaseTool`, or `@tool(..., idempotent=True)`, needs
the integration to be active: with `CREWAI_IDEMPOTENT_AUTOLOAD=0` and no
`import crewai_idempotent`, or in an environment without the package, such a class tool
runs unguarded. These forms come from this package, so using them activates the
integration, and they check at every call that the guard is really in front of them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Literal

from crewai.tools.base_tool import BaseTool

from .._errors import GuardInactive
from ._call import GUARD_MARK, METHODS
from ._patch import install, is_installed
from ._stash import options_of

_CHECKED = "__crewai_idempotent_checked__"

install()  # outside the tested crewAI range, guarded tools refuse to run at call time


def _inactive(what: str) -> GuardInactive:
    return GuardInactive(
        f"{what} must only run guarded, and crewai-idempotent's integration is not installed "
        "(uninstall() was called, or crewai guards tools natively); nothing was run. "
        "Call crewai_idempotent.install()"
    )


def _refuse_unguarded(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def check(self: Any) -> None:
        options = options_of(self)
        guarded = hasattr(getattr(type(self), name, None), GUARD_MARK)
        if not (is_installed() and guarded and options is not None and options.idempotent):
            raise _inactive(f"tool {getattr(self, 'name', type(self).__name__)!r}")

    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def checked_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            check(self)
            return await method(self, *args, **kwargs)

        checked: Any = checked_async
    else:

        @functools.wraps(method)
        def checked_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
            check(self)
            return method(self, *args, **kwargs)

        checked = checked_sync
    setattr(checked, _CHECKED, True)
    return checked


class IdempotentTool(BaseTool):
    """A `BaseTool` that is always guarded and refuses to run otherwise.

    Subclass it instead of `BaseTool`; the idempotency options may be class fields or
    keywords as usual (`idempotency_key: str = "charge:{invoice}"`). `idempotent` cannot
    be switched off.
    """

    idempotent: Literal[True] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Wrapped before BaseTool's hook guards the class, so the guard sits outside the
        # check and the check sees it.
        for name in METHODS:
            method = cls.__dict__.get(name)
            if inspect.isfunction(method) and not hasattr(method, _CHECKED):
                setattr(cls, name, _refuse_unguarded(name, method))
        super().__init_subclass__(**kwargs)


def idempotent_tool(*args: Any, **options: Any) -> Any:
    """crewai's `@tool`, always idempotent: `@idempotent_tool("charge", idempotency_key=...)`.

    Takes the same `args` and idempotency `options` as `@tool(..., idempotent=True)`;
    `idempotent=False` is refused (`ValueError`), and an option that cannot be used
    raises where `@tool` would (`LedgerConfigurationError`, `TypeError`, `ValueError`).
    The tool it makes carries its guard wherever it goes.
    """
    if options.get("idempotent", True) is not True:
        raise ValueError("idempotent_tool() makes idempotent tools; drop idempotent=False")
    options["idempotent"] = True
    install()
    if not is_installed():
        raise _inactive("@idempotent_tool")
    import crewai.tools.base_tool as base_tool

    return base_tool.tool(*args, **options)
