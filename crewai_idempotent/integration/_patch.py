"""Installing the integration into crewai, and taking it out again exactly.

Every change is an attribute set on a crewai class or module (or on a tool class
created while installed); each is recorded with what was there before, and
`uninstall()` puts that back in reverse order.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any

from _crewai_idempotent_autoload import remove_import_hook, when_imported

from .._errors import UnsupportedCrewAIVersion
from . import _call, _compat, _release, _stash, _tools

# The supported minor releases (docs/compatibility.md): crewai >=1.10.0, <1.16. The matrix in
# noxfile.py runs every release up to NEWEST_TESTED; a newer one inside the range verifies
# itself on first use (_verify), and one outside it is refused.
SUPPORTED = ((1, 10, 0), (1, 16, 0))
NEWEST_TESTED = (1, 15, 30)
_ABSENT: Any = object()

log = logging.getLogger("crewai_idempotent")

_lock = threading.RLock()
_patches: list[tuple[Any, str, Any]] = []  # (owner, attribute, previous value or _ABSENT)
_installed = False
_warned: set[str] = set()


def _version_tuple(version: str) -> tuple[int, ...] | None:
    match = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(part) for part in match.groups()) if match else None


def supported_range() -> str:
    low, high = (".".join(map(str, bound)) for bound in SUPPORTED)
    return f">={low},<{high}"


def is_supported(version: str) -> bool:
    parsed = _version_tuple(version)
    low, high = SUPPORTED
    return parsed is not None and low <= parsed < high


def is_tested(version: str) -> bool:
    """Whether `version` is one the matrix ran (a release up to NEWEST_TESTED)."""
    parsed = _version_tuple(version)
    return parsed is not None and SUPPORTED[0] <= parsed <= NEWEST_TESTED


def newest_tested() -> str:
    return ".".join(map(str, NEWEST_TESTED))


def check_version(version: str) -> None:
    """Raise UnsupportedCrewAIVersion unless `version` is in the tested range."""
    if not is_supported(version):
        raise UnsupportedCrewAIVersion(_release.untested_message(version, supported_range()))


def _set(owner: Any, name: str, value: Any) -> None:
    _patches.append((owner, name, owner.__dict__.get(name, _ABSENT)))
    setattr(owner, name, value)


def is_installed() -> bool:
    """Whether `install()` has patched crewai (and `uninstall()` has not undone it since).
    Raises nothing."""
    return _installed


def install() -> None:
    """Patch crewai so that tools flagged idempotent are guarded. Safe to call twice.

    On a crewai outside the supported range it never raises (it runs inside `import
    crewai`): it warns once and installs only what makes flagged tools refuse to run,
    unless CREWAI_IDEMPOTENT_ALLOW_UNTESTED=1 (then the full guard, after the user ran
    `crewai-idempotent doctor --self-test`). A release inside the range but newer than the
    newest tested one gets the full guard, and flagged tools wait for its self-test's
    verdict (`_verify`), unless that variable forces the question either way.
    Raises nothing: a crewai it cannot patch is reported by a warning.
    """
    global _installed
    with _lock:
        if _installed:
            return
        import crewai

        if _natively_guarded():
            # A crewai with the upstream patch (patches/) guards these tools itself; a second
            # guard would claim every call twice, in two ledgers.
            warnings.warn(
                "crewai guards idempotent tools natively (crewai.tools.idempotency); "
                "crewai-idempotent's integration stands down",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        version = str(getattr(crewai, "__version__", "unknown"))
        _release.set_pending(None)
        if is_tested(version):
            _release.set_refusal(None)
            try:
                _install()
            except BaseException:
                _undo()
                raise
        elif is_supported(version) and _compat.untested_choice() is None:
            _install_unverified(version)
        else:
            _install_untested(version)
        _installed = True
    remove_import_hook()  # crewai is loaded: a hook waiting for it has nothing left to do


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _install_unverified(version: str) -> None:
    """A release newer than the newest tested, inside the supported minor: the full guard,
    and every flagged tool refuses until the release's self-test has passed on this
    machine (`_verify.Gate`, loaded with the first guarded call)."""
    # The gate first: a guarded call in another thread never meets the guard without it.
    _release.set_pending(_release.Verification(version, newest_tested()))
    _release.set_refusal(None)
    try:
        _install()
    except Exception as exc:  # noqa: BLE001 - never break `import crewai`
        _undo()
        log.warning("crewai-idempotent could not install on crewai %s: %r", version, exc)
        message = _release.untested_message(version, supported_range())
        _warn_once(version, message)
        _release.set_refusal(message)
        _release.set_pending(None)
        _install_fail_closed()


def _install_untested(version: str) -> None:
    if _compat.untested_allowed():
        _warn_once(
            f"allowed:{version}",
            f"crewai {version} is outside the range crewai-idempotent is tested with "
            f"({supported_range()}); {_compat.ALLOW_UNTESTED_ENV} is set, so the guard runs "
            "in full. `crewai-idempotent doctor --self-test` checks it against this crewai.",
        )
        _release.set_refusal(None)
        try:
            _install()
            return
        except Exception as exc:  # noqa: BLE001 - never break `import crewai`
            _undo()
            log.warning("crewai-idempotent could not install on crewai %s: %r", version, exc)
    if is_supported(version) and not _compat.untested_allowed():
        # CREWAI_IDEMPOTENT_ALLOW_UNTESTED=0: no self-verification.
        message = _release.unverified_off_message(version, newest_tested())
    else:
        message = _release.untested_message(version, supported_range())
    _warn_once(version, message)
    _release.set_refusal(message)
    _install_fail_closed()


def _install_fail_closed() -> None:
    """Only what takes the idempotency options and makes flagged tools refuse at call
    time; each piece on its own, so that one crewai has moved leaves the others working.
    Unflagged tools and crews run through crewai as if nothing were installed."""
    for step in (_patch_tool_options, _patch_tool_classes, _patch_crew_options):
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - an untested crewai: never break its import
            log.warning("crewai-idempotent: %s skipped on this crewai: %r", step.__name__, exc)


def _natively_guarded() -> bool:
    try:
        from crewai.tools.base_tool import BaseTool

        fields = BaseTool.__pydantic_fields__
    except Exception:  # noqa: BLE001 - an untested crewai without them: not native either
        return False
    return "idempotent" in fields and not _installed


def uninstall() -> None:
    """Restore every attribute `install()` changed, and drop a pending activation (the
    start-up hook or `import crewai_idempotent` waiting for crewai), so that a later
    `import crewai` leaves crewai alone. Tools flagged while installed keep their guarded
    function (they were declared idempotent); classes do not. Raises nothing."""
    global _installed
    with _lock:
        _undo()
        _installed = False
        remove_import_hook()


def _undo() -> None:
    remove_import_hook(_LITE_AGENT)
    while _patches:
        owner, name, previous = _patches.pop()
        if previous is _ABSENT:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)
        else:
            setattr(owner, name, previous)


# Where an uncertain outcome stops a kickoff, and what a tool call runs inside.
def _task_scope(task: Any, agent: Any = None, *_: Any, **kw: Any) -> _call.Scope:
    agent = agent or kw.get("agent") or task.agent
    return _call.Scope(task=task, agent=agent, crew=getattr(agent, "crew", None))


def _agent_scope(agent: Any, *_: Any, **__: Any) -> _call.Scope:
    return _call.Scope(agent=agent, crew=getattr(agent, "crew", None))


# `import crewai` does not import LiteAgent's module (deprecated, tens of ms): its kickoff
# is patched when something imports it, so activation does not pay for it.
_LITE_AGENT = "crewai.lite_agent"


def _install() -> None:
    from crewai.agent.core import Agent
    from crewai.task import Task

    _patch_tool_options()
    _patch_tool_classes()
    _patch_crew_options()
    _patch_crew_copy()

    _set(Task, "_execute_core", _boundary(Task._execute_core, _task_scope))
    _set(Task, "_aexecute_core", _aboundary(Task._aexecute_core, _task_scope))
    _set(Agent, "kickoff", _boundary(Agent.kickoff, _agent_scope))
    _set(Agent, "kickoff_async", _aboundary(Agent.kickoff_async, _agent_scope))
    when_imported(_LITE_AGENT, _patch_lite_agent)

    # The flow a tool call runs in, for `{flow}` keys. `_execute_method` is where every
    # supported release runs a flow's method; Flow moved to a runtime base in 1.14.7. A
    # release without it leaves `{flow}` unset: such keys refuse to run, nothing guesses.
    from crewai.flow.flow import Flow

    flows = next((c for c in Flow.__mro__ if "_execute_method" in c.__dict__), None)
    if flows is not None:
        _set(flows, "_execute_method", _call.in_flow(flows.__dict__["_execute_method"]))

    # What differs between the supported releases (kickoff ids, context in threads...).
    _compat.install(_set)


def _patch_lite_agent() -> None:
    from crewai.lite_agent import LiteAgent

    with _lock:
        if _installed or _patches:  # installed, or installing now: not after uninstall()
            _set(LiteAgent, "kickoff", _boundary(LiteAgent.kickoff, _agent_scope))


def _patch_tool_options() -> None:
    import crewai.tools as tools_module
    import crewai.tools.base_tool as base_tool_module
    from crewai.tools.base_tool import BaseTool

    # @tool(..., idempotent=True, idempotency_key=...)
    original_tool = base_tool_module.tool
    decorator = _tools.make_tool_decorator(original_tool)
    _set(base_tool_module, "tool", decorator)
    if tools_module.tool is original_tool:
        _set(tools_module, "tool", decorator)

    # MyTool(idempotent=True, ...) and class defaults `idempotent: bool = True`
    _set(BaseTool, "__init__", _tools.init_taking_options(BaseTool.__init__))


def _patch_tool_classes() -> None:
    """Guard `_run`/`_arun` of every class tool, now and when defined later."""
    from crewai.tools.base_tool import BaseTool

    def guard_class(cls: type) -> None:
        if not _tools.wants_method_guards(cls):
            return
        for name in _call.METHODS:
            method = cls.__dict__.get(name)
            # Plain functions only: a staticmethod or other descriptor is left alone.
            if inspect.isfunction(method) and not hasattr(method, _call.GUARD_MARK):
                _set(cls, name, _tools.guard_method(method))

    def walk(cls: type) -> None:
        sub: type
        for sub in cls.__subclasses__():
            guard_class(sub)
            walk(sub)

    walk(BaseTool)
    _set(BaseTool, "__init_subclass__", _compat.init_subclass_of(BaseTool, guard_class))


def _patch_crew_options() -> None:
    from crewai.crew import Crew

    # Crew(idempotency=IdempotencyConfig(...)) and Crew(cache_backend=...)
    _set(Crew, "__init__", _crew_init(Crew.__init__))


def _patch_crew_copy() -> None:
    from crewai.crew import Crew

    _set(Crew, "copy", _crew_copy(Crew.copy))


def _crew_init(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def init(self: Any, /, **data: Any) -> None:
        # Deliberately late: the options and the ledgers load with the first crew, not
        # inside `import crewai` (the activation budget).
        from ._config import check_crew_ledger, merge_crew_settings

        fields = _call.fields_of(type(self))
        idempotency = data.pop("idempotency", None) if "idempotency" not in fields else None
        cache_backend = data.pop("cache_backend", None) if "cache_backend" not in fields else None
        config = merge_crew_settings(idempotency, cache_backend, type(self).__name__)
        check_crew_ledger(config)
        original(self, **data)
        if config is not None:
            _stash.stash_config(self, config)
            _call.crews[str(self.id)] = self

    init.__pydantic_base_init__ = True  # type: ignore[attr-defined]
    return init


def _crew_copy(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def copy(self: Any) -> Any:
        duplicate = original(self)
        config = _stash.config_of(self)
        if config is not None:
            _stash.stash_config(duplicate, config)
            _call.crews[str(duplicate.id)] = duplicate
        return duplicate

    return copy


def _boundary(original: Callable[..., Any], scope: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def at_boundary(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _call.boundary(original, scope(self, *args, **kwargs), (self, *args), kwargs)

    return at_boundary


def _aboundary(original: Callable[..., Any], scope: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def at_boundary(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await _call.aboundary(original, scope(self, *args, **kwargs), (self, *args), kwargs)

    return at_boundary
