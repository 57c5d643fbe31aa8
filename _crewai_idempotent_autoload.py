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

`CREWAI_IDEMPOTENT_AUTOLOAD=0` (or false/no/off) switches both automatic activations
off: this start-up hook and the one `import crewai_idempotent` registers. An explicit
`crewai_idempotent.install()` always works.
"""

import os
import sys

# Start-up cost matters here: no `typing` and no `from __future__` (each is an import the
# interpreter has not done yet); annotations use builtins only.

TARGET = "crewai"
_MARK = "_crewai_idempotent_hook"


def autoload_enabled() -> bool:
    value = os.environ.get("CREWAI_IDEMPOTENT_AUTOLOAD", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def _activate() -> None:
    from crewai_idempotent.integration import install

    install()


class CrewAIImportHook:
    """A meta-path finder that calls `_activate` right after `crewai` has executed."""

    _crewai_idempotent_hook = True

    def __init__(self) -> None:
        self._searching = False

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
        run_module = loader.exec_module

        def exec_module(module: object) -> None:
            run_module(module)
            # crewai has executed in full: install() may import any part of it now. If it
            # refuses (an unsupported crewai version), `import crewai` fails with its error.
            remove_import_hook()
            _activate()

        # A per-instance override: the loader keeps its class, so resource readers and
        # `isinstance` checks on `crewai.__loader__` behave as before.
        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install_import_hook() -> bool:
    """Activate now if crewai is loaded, else when it is. False if switched off."""
    if not autoload_enabled():
        return False
    module = sys.modules.get(TARGET)
    if module is not None and not getattr(
        getattr(module, "__spec__", None), "_initializing", False
    ):
        _activate()
        return True
    if not any(getattr(finder, _MARK, False) for finder in sys.meta_path):
        sys.meta_path.insert(0, CrewAIImportHook())  # type: ignore[arg-type]
    return True


def remove_import_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, _MARK, False)]
