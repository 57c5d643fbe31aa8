"""Activate crewai-idempotent's crewai integration when crewai is imported, at almost no
start-up cost.

`crewai_idempotent_autoload.pth`, installed next to this module, imports it at interpreter
start-up and calls `install_import_hook("crewai_idempotent.integration:install")`. It is a
top-level module, outside the `crewai_idempotent` package, because importing anything
inside the package first runs the package's `__init__`; this module loads from its cached
bytecode and only puts a finder at the front of `sys.meta_path`. When `crewai` is first
imported, the finder lets the normal machinery load it and, once its module has executed,
calls the activation it was given: a callable, or an entry-point string
("module:attribute") it resolves with importlib then, so that this module imports nothing
of the package and the package imports this one, never the other way round.
`import crewai_idempotent` passes the integration's `install` itself. (An editable install
holds a copy of this file in site-packages: reinstall after editing it.)

wrapt's `register_post_import_hook` does the same job, but importing wrapt pulls in
asyncio, inspect and importlib.metadata (100+ ms measured here), far over the start-up
budget; this module imports only `os` and `sys`, which the interpreter has already loaded.
`when_imported` is the same finder for any module (the integration patches crewai's
LiteAgent only once `crewai.lite_agent` is imported, which `import crewai` does not do).

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
    "reconcile_timeout_s",
    "fingerprint",
    "approval",
    "spend",
    "caps",
    "on_approval",
    "approval_wait_s",
    "redact",
    "approvers",
)


def autoload_enabled() -> bool:
    value = os.environ.get("CREWAI_IDEMPOTENT_AUTOLOAD", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def _resolve(activation: object) -> object:
    """The callable an entry-point string ("module:attribute") names; a callable as is."""
    if not isinstance(activation, str):
        return activation
    module_name, _, attribute = activation.partition(":")
    import importlib

    return getattr(importlib.import_module(module_name), attribute)


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


class PostImportHook:
    """A meta-path finder that runs `then()` right after the module `name` has executed."""

    _crewai_idempotent_hook = True

    def __init__(self, name: str, then: object, explain_only: bool = False) -> None:
        self._searching = False
        self.name = name
        self.then = then
        self.explain_only = explain_only

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname != self.name or self._searching:
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
        name, then = self.name, self.then

        def exec_module(module: object) -> None:
            run_module(module)
            # The module has executed in full: `then` may import any part of it now. For
            # crewai, install() never raises outside the tested range (flagged tools refuse
            # at call time instead); inside it, a failure raises here rather than guard
            # nothing.
            remove_import_hook(name)
            _resolve(then)()  # type: ignore[operator]

        # A per-instance override: the loader keeps its class, so resource readers and
        # `isinstance` checks on the module's `__loader__` behave as before.
        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _loaded(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and not getattr(
        getattr(module, "__spec__", None), "_initializing", False
    )


def _hooks(name: str) -> list[object]:
    return [f for f in sys.meta_path if getattr(f, _MARK, False) and getattr(f, "name", 0) == name]


def when_imported(name: str, then: object) -> None:
    """Call `then()` now if the module `name` is loaded, else right after it is (once; a
    second call for the same module replaces the first)."""
    if _loaded(name):
        _resolve(then)()  # type: ignore[operator]
        return
    remove_import_hook(name)
    sys.meta_path.insert(0, PostImportHook(name, then))  # type: ignore[arg-type]


def install_import_hook(activation: object, force: bool = False) -> bool:
    """Call `activation` (a callable, or "module:attribute") now if crewai is loaded, else
    when it is. False if switched off (then the hook only explains, see the module
    docstring); `force` ignores the switch."""
    enabled = force or autoload_enabled()
    if _loaded(TARGET):
        if enabled:
            _resolve(activation)()  # type: ignore[operator]
        return enabled
    hooks = _hooks(TARGET)
    if enabled and any(getattr(hook, "explain_only", False) for hook in hooks):
        remove_import_hook(TARGET)
        hooks = []
    if not hooks:
        then = activation if enabled else _explain_inactive
        sys.meta_path.insert(0, PostImportHook(TARGET, then, explain_only=not enabled))  # type: ignore[arg-type]
    return enabled


def remove_import_hook(name: str = TARGET) -> None:
    """Take out the finder waiting for `name` (crewai by default), if any."""
    # By mark, not class: a copy of this module loaded under another name marks its own.
    sys.meta_path[:] = [
        f for f in sys.meta_path if not (getattr(f, _MARK, False) and getattr(f, "name", 0) == name)
    ]
