"""Activate crewai-idempotent's crewai integration when crewai is imported, at almost no
start-up cost.

`crewai_idempotent_autoload.pth`, installed next to this module, imports it at interpreter
start-up. It is a top-level module, outside the `crewai_idempotent` package, because
importing anything inside the package first runs the package's `__init__` (the whole
ledger, asyncio included); this module loads from its cached bytecode and only puts a
finder at the front of `sys.meta_path`. When `crewai` is first imported, the finder lets
the normal machinery load it and, once its module has executed, imports
`crewai_idempotent.integration` and calls `install()`. `crewai_idempotent._autoload`
re-exports these functions for the package. (An editable install holds a copy of this
file in site-packages: reinstall after editing it.)

wrapt's `register_post_import_hook` does the same job, but importing wrapt pulls in
asyncio, inspect and importlib.metadata (100+ ms measured here), far over the start-up
budget; this module imports only `os` and `sys`, which the interpreter has already loaded.

`CREWAI_IDEMPOTENT_AUTOLOAD=0` (or false/no/off) switches this start-up hook off, and
only it: `import crewai_idempotent` and `crewai_idempotent.install()` still activate the
integration. While it is off the hook still waits for crewai, but only to make
`@tool(..., idempotent=True)` fail with an explanation instead of crewai's bare
"unexpected keyword argument" (nothing else of crewai is touched).
"""

import os
import sys

# Start-up cost matters here: no `typing` and no `from __future__` (each is an import the
# interpreter has not done yet); annotations use builtins only.

TARGET = "crewai"
_MARK = "_crewai_idempotent_hook"
_HINT = "_crewai_idempotent_hint"
# The integration's tool options (integration._config.ToolOptions; a test keeps them equal).
OPTION_NAMES = (
    "idempotent",
    "idempotency_key",
    "wait_s",
    "lease_s",
    "ttl",
    "reconcile",
    "on_stale",
    "fingerprint",
    "approval",
    "spend",
    "caps",
    "on_approval",
    "approval_wait_s",
    "redact",
)


def autoload_enabled() -> bool:
    value = os.environ.get("CREWAI_IDEMPOTENT_AUTOLOAD", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def _activate() -> None:
    from crewai_idempotent.integration import install

    install()


def _explain_inactive() -> None:
    """Make crewai's `@tool` say why it refuses the idempotency options while the
    integration is switched off (install() later wraps this one and takes them first)."""
    from typing import Any

    import crewai.tools as tools_module
    import crewai.tools.base_tool as base_tool_module

    original: Any = base_tool_module.tool
    if getattr(original, _HINT, False) or "crewai_idempotent" in sys.modules:
        return

    def tool(*args: object, **kwargs: object) -> object:
        given = sorted(k for k in kwargs if k in OPTION_NAMES)
        current: Any = base_tool_module.tool
        if given and current is not tool:
            # Installed since this was imported by name: the integration's decorator takes
            # the options (and calls this one without them).
            return current(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        except TypeError as exc:
            if not given:
                raise
            # Only when crewai itself refuses them: a crewai that guards natively takes them.
            raise TypeError(
                f"@tool() got the crewai-idempotent option(s) {', '.join(given)}, but the "
                "integration is not active: CREWAI_IDEMPOTENT_AUTOLOAD switched its start-up "
                "hook off. Add `import crewai_idempotent` before defining the tool (or call "
                "crewai_idempotent.install())"
            ) from exc

    tool.__doc__ = original.__doc__
    tool.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(tool, _HINT, True)
    if tools_module.tool is original:
        setattr(tools_module, "tool", tool)  # noqa: B010 - crewai's overloads do not fit
    setattr(base_tool_module, "tool", tool)  # noqa: B010


class CrewAIImportHook:
    """A meta-path finder that calls `_activate` right after `crewai` has executed."""

    _crewai_idempotent_hook = True

    def __init__(self, explain_only: bool = False) -> None:
        self._searching = False
        self.explain_only = explain_only

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname != TARGET or self._searching:
            return None
        self._searching = True
        try:
            from importlib.util import find_spec

            spec = find_spec(fullname)  # asks the other finders; this one steps aside
        finally:
            self._searching = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        run_module = getattr(loader, "exec_module")  # noqa: B009 - untyped on purpose

        explain_only = self.explain_only

        def exec_module(module: object) -> None:
            run_module(module)
            # crewai has executed in full: install() may import any part of it now. On a
            # crewai outside the tested range it never raises (flagged tools refuse at call
            # time instead); inside it, a failure raises here rather than guard nothing.
            remove_import_hook()
            if explain_only:
                _explain_inactive()
            else:
                _activate()

        # A per-instance override: the loader keeps its class, so resource readers and
        # `isinstance` checks on `crewai.__loader__` behave as before.
        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install_import_hook(force: bool = False) -> bool:
    """Activate now if crewai is loaded, else when it is. False if switched off (then the
    hook only explains, see the module docstring); `force` ignores the switch."""
    enabled = force or autoload_enabled()
    module = sys.modules.get(TARGET)
    if module is not None and not getattr(
        getattr(module, "__spec__", None), "_initializing", False
    ):
        if enabled:
            _activate()
        return enabled
    hooks = [finder for finder in sys.meta_path if getattr(finder, _MARK, False)]
    if enabled and any(getattr(finder, "explain_only", False) for finder in hooks):
        remove_import_hook()
        hooks = []
    if not hooks:
        sys.meta_path.insert(0, CrewAIImportHook(explain_only=not enabled))  # type: ignore[arg-type]
    return enabled


def remove_import_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, _MARK, False)]
