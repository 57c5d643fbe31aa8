"""Finding a record's reconciler in a process that never ran its tool.

A sweeper reads a record and must ask the reconciler of the tool that made it. It looks,
in order:

1. by tool name (the record's `call["tool"]`, which every claim of a crewAI tool records;
   for a claim that does not, as older releases' claims of a tool without a reconciler,
   the key's prefix before the first `:`, which the default keys and most templates
   start with) among what this process was
   told: `reconcilers=` given to the sweeper, `register()` / `@reconciles(...)` in a
   module it imported, the entry point group `crewai_idempotent.reconcilers` (name: the
   tool, value: `module:attribute`), and the tools built in this process;
2. `reconcilers["*"]`, for records that name neither a tool with one nor a path;
3. the import path the record names (`call["reconciler"]`: the tool's `reconcile=
   "myapp.payments:find_charge"`, or its module-level function), but only under a module
   the sweeper trusts: one it was told to import (`--import myapp`), or named with
   `trust=`. A ledger's contents never choose what code a sweeper imports and calls: a
   record naming `builtins:exec` is left alone, with the reason.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..ledger._reconcile import NamedReconciler, named
from ..ledger._record import Record

log = logging.getLogger("crewai_idempotent.reconciliation")

#: The entry point group whose names are tool names and whose values are reconcilers'
#: import paths: `[project.entry-points."crewai_idempotent.reconcilers"] charge = "m:f"`.
GROUP = "crewai_idempotent.reconcilers"

Reconciler = Callable[[str, Any], Any]

#: In `reconcilers=`, the reconciler for the records no other entry and no recorded path
#: is for (a ledger used without the crewAI integration, whose keys name no tool).
ANY = "*"

_lock = threading.Lock()
_registered: dict[str, Reconciler] = {}  # register() and @reconciles
_from_tools: dict[str, Reconciler] = {}  # the tools built in this process


def register(tool: str, reconciler: Reconciler | str) -> None:
    """Make `reconciler` (a callable, or its import path) the one a sweeper in this
    process asks for the records of the tool named `tool`. Raises `ValueError` for a blank
    `tool` or an import path that is malformed or names no module (`named`), and
    `TypeError` for a `reconciler` that is neither callable nor a str."""
    if not isinstance(tool, str) or not tool.strip():
        raise ValueError(f"register(): a tool name is a non-empty string, not {tool!r}")
    with _lock:
        _registered[tool] = _callable(reconciler, f"register({tool!r}, ...)")


def reconciles(*tools: str) -> Callable[[Reconciler], Reconciler]:
    """`@reconciles("charge_card")`: register the decorated function for the tools named
    `tools`. Raises `TypeError` without a tool; decorating raises what `register` raises
    (`ValueError` for a blank name)."""
    if not tools:
        raise TypeError("@reconciles(...) names at least one tool")

    def decorate(fn: Reconciler) -> Reconciler:
        for tool in tools:
            register(tool, fn)
        return fn

    return decorate


def remember_tool(tool: str, reconciler: Reconciler | str | None) -> None:
    """A tool with a reconciler was built in this process (the crewAI integration calls
    this): a sweeper here finds it by the tool's name."""
    if reconciler is not None:
        found = _callable(reconciler, f"tool {tool!r}")
        with _lock:
            _from_tools[tool] = found


def unregister(tool: str) -> None:
    """Forget what `register` (or a tool built here) set for `tool`. Raises nothing, for a
    `tool` with nothing set too."""
    with _lock:
        _registered.pop(tool, None)
        _from_tools.pop(tool, None)


def _callable(reconciler: Any, where: str) -> Reconciler:
    if isinstance(reconciler, str):
        return named(reconciler)
    if not callable(reconciler):
        raise TypeError(
            f"{where}: a reconciler is a callable (key, args) -> Found | Absent | Unknown, "
            f"or its import path, not {type(reconciler).__name__}"
        )
    return reconciler


def tool_of(record: Record) -> str | None:
    """The name of the tool whose call made `record`: as its claim recorded it, else
    the key's prefix before the first `:` (the default keys are `tool:fingerprint`)."""
    return recorded_tool(record) or key_prefix(record)


def recorded_tool(record: Record) -> str | None:
    """The tool's name as the claim recorded it. A claim of this release's crewAI tools
    records it always; an older release's recorded it only for a tool with a reconciler
    of its own, and a claim made without crewAI (`Ledger.run`) never does."""
    tool = (record.call or {}).get("tool")
    return tool if isinstance(tool, str) and tool else None


def key_prefix(record: Record) -> str | None:
    """The key's prefix before its first `:`, which the default keys (`tool:fingerprint`)
    and most templates start with; None for a key without one."""
    prefix, colon, _ = record.key.partition(":")
    return prefix if colon and prefix else None


def path_in(record: Record) -> str | None:
    path = (record.call or {}).get("reconciler")
    return path if isinstance(path, str) and path else None


class Finder:
    """Where one sweeper looks for a record's reconciler (see the module docstring)."""

    def __init__(
        self,
        reconcilers: Mapping[str, Reconciler | str] | None = None,
        *,
        imports: Iterable[str] = (),
        trust: Iterable[str] = (),
        entry_points: bool = True,
    ) -> None:
        self.imports = tuple(imports)
        for module in self.imports:
            try:
                importlib.import_module(module)  # its register() calls and tools count
            except ImportError:
                raise
            except Exception as exc:  # a module that fails as it runs: said as the import
                raise ImportError(
                    f"importing {module!r} failed: {type(exc).__name__}: {exc}", name=module
                ) from exc
        self.trusted = tuple(dict.fromkeys([*self.imports, *trust]))
        self.given = {
            tool: _callable(r, f"reconcilers[{tool!r}]") for tool, r in (reconcilers or {}).items()
        }
        self.entry_points = _entry_points() if entry_points else {}
        self._resolved: dict[str, Reconciler] = {}

    def find(self, record: Record) -> tuple[Reconciler | None, str]:
        """(the reconciler, what it is for messages), or (None, why there is none)."""
        tool = tool_of(record)
        if tool is not None:
            for label, table in (
                ("given to the sweeper", self.given),
                ("registered", _registered),
                ("entry point", self.entry_points),
                ("a tool built here", _from_tools),
            ):
                found = table.get(tool)
                if found is not None:
                    return _sync_or_async(found), _describe(found, label)
        path = path_in(record)
        if path is None and ANY in self.given:
            found = self.given[ANY]
            return _sync_or_async(found), _describe(found, "given to the sweeper for any tool")
        if path is None:
            return None, _none_for(record, tool)
        if not self._trusts(path):
            return None, (
                f"its tool names the reconciler {path}, which this sweeper does not import: "
                f"run it with --import {path.partition(':')[0]} (the sweeper imports and "
                "calls only code under the modules it is given)"
            )
        found = self._resolved.get(path)
        if found is None:
            try:
                target = named(path).resolve()
            except Exception as exc:  # noqa: BLE001 - a bad path leaves the record as it is
                return None, f"cannot import the reconciler {path}: {type(exc).__name__}: {exc}"
            found = self._resolved[path] = _sync_or_async(target)
        return found, path

    def _trusts(self, path: str) -> bool:
        module = path.partition(":")[0]
        return any(module == root or module.startswith(root + ".") for root in self.trusted)


def _none_for(record: Record, tool: str | None) -> str:
    """Why a record has no reconciler here, and what to add."""
    where = f"(--import MODULE, the {GROUP!r} entry points) or name it by import path on the tool"
    if tool is None:
        return (
            "no reconciler for this key in this sweeper: its claim does not record the tool's "
            "name (a claim by an older release, or made without crewAI) and the key has no "
            f"'tool:' prefix: give the sweeper reconcilers={{{ANY!r}: ...}}, or resolve it by hand"
        )
    if recorded_tool(record) is None:
        return (
            f"no reconciler for tool {tool!r} in this sweeper: its claim does not record the "
            f"tool's name (a claim by an older release, or made without crewAI), so {tool!r} is "
            f"its key's prefix: register one for {tool!r} {where}"
        )
    return f"no reconciler for tool {tool!r} in this sweeper: register one for the tool {where}"


def _describe(reconciler: Any, label: str) -> str:
    if isinstance(reconciler, NamedReconciler):
        return f"{reconciler.path} ({label})"
    name = getattr(reconciler, "__qualname__", None) or type(reconciler).__name__
    return f"{name} ({label})"


def _sync_or_async(reconciler: Reconciler) -> Reconciler:
    """A reconciler a sweeper can ask from either driver: an async function is run to
    its end on the thread the sync driver asks it on (the async driver awaits it)."""
    target = reconciler.resolve() if isinstance(reconciler, NamedReconciler) else reconciler
    if not inspect.iscoroutinefunction(target):
        return reconciler
    return _Blocking(target)


class _Blocking:
    """An async reconciler asked from the sync driver: run with `asyncio.run` on the
    reconciler's own thread. The sweeper's async pass asks `coroutine` itself instead,
    which the async driver awaits on the loop."""

    def __init__(self, coroutine: Callable[[str, Any], Any]) -> None:
        self.coroutine = coroutine
        self.__qualname__ = getattr(coroutine, "__qualname__", "reconciler")

    def __call__(self, key: str, args: Any) -> Any:
        import asyncio

        return asyncio.run(self.coroutine(key, args))


def _entry_points() -> dict[str, Reconciler]:
    found: dict[str, Reconciler] = {}
    for point in importlib.metadata.entry_points(group=GROUP):
        try:
            found[point.name] = named(point.value)
        except ValueError as exc:
            log.warning("entry point %s = %r is not a reconciler: %s", point.name, point.value, exc)
    return found
