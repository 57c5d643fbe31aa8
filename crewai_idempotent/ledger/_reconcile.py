"""What a reconciler answers when asked whether an operation happened, and asking it.

A reconciler is the tool's own lookup at the provider. Whatever it does (raises, returns
something else, is async where only sync can wait, does not answer within
`reconcile_timeout_s`) becomes `Unknown`: the record then stays UNCERTAIN, never a guess.

With a timeout, a sync reconciler runs on a thread of its own and the caller waits for it
that long; if it has not answered, it is left to finish there and whatever it says later
is ignored (a thread cannot be stopped, and a provider call in flight should not be cut
off mid-way). An async one is cancelled. While it runs, `reconciling()` is the record it
is asked about (a verifier reads the claim's time from it).

A reconciler may be named by import path (`"myapp.payments:find_charge"`, `named`), so
that a process that never built the tool can find it; such a claim records the path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import importlib
import importlib.util
import inspect
import logging
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._record import Record

log = logging.getLogger("crewai_idempotent")

_reconciling: contextvars.ContextVar[Record | None] = contextvars.ContextVar(
    "crewai_idempotent_reconciling", default=None
)


def reconciling() -> Record | None:
    """The record a reconciler is being asked about, while it runs (None elsewhere): its
    history says when the claim was made, its `call` what was recorded of the call.
    Raises nothing."""
    return _reconciling.get()


# How a sync caller waits for a reconciler's thread: (event, seconds) -> set in time.
Wait = Callable[[threading.Event, float], bool]


@dataclass(frozen=True, slots=True)
class Found:
    """The operation happened; `result` is its receipt and will be replayed."""

    result: Any


@dataclass(frozen=True, slots=True)
class Absent:
    """The operation did not happen; the next attempt may run it."""


@dataclass(frozen=True, slots=True)
class Unknown:
    """The outside system cannot tell; the record stays UNCERTAIN."""

    reason: str = "reconciler could not tell"


@dataclass(frozen=True, slots=True)
class Unanswered(Unknown):
    """The reconciler did not answer within `reconcile_timeout_s`: Unknown, and the other
    callers of the key waiting in this process for that answer are given it too."""


Verdict = Found | Absent | Unknown


def ask(
    reconcile: Callable[[str, Any], Any],
    key: str,
    args: Any,
    timeout: float | None = None,
    wait: Wait | None = None,
    record: Record | None = None,
) -> Verdict:
    """Call a reconciler from the sync path and normalise what it says: in this thread
    without a timeout, else on a thread of its own, waited for `timeout` seconds (through
    `wait`, the ledger's clock; `Event.wait` by default). `record`: what `reconciling()`
    says meanwhile."""
    if timeout is None:
        marked = _reconciling.set(record)
        try:
            return _sync_answer(reconcile, key, args)
        finally:
            _reconciling.reset(marked)
    future: concurrent.futures.Future[Verdict] = concurrent.futures.Future()
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    _start(future, lambda: _about(record, _sync_answer, reconcile, key, args))
    if not (wait or _wait_for_event)(done, timeout) and future.cancel():
        return _unanswered(key, timeout)
    return future.result()


async def aask(
    reconcile: Callable[[str, Any], Any],
    key: str,
    args: Any,
    timeout: float | None = None,
    record: Record | None = None,
) -> Verdict:
    """Await an async reconciler on the loop (cancelled after `timeout` seconds); run a
    sync one on a thread of its own, waited for on the loop."""
    scope = asyncio.timeout(timeout)
    marked = _reconciling.set(record)
    try:
        async with scope:
            if inspect.iscoroutinefunction(reconcile):
                answer = await reconcile(key, args)
            else:
                future: concurrent.futures.Future[Any] = concurrent.futures.Future()
                _start(future, lambda: reconcile(key, args))
                answer = await asyncio.wrap_future(future)
                if inspect.isawaitable(answer):
                    answer = await answer
    except TimeoutError as exc:
        if scope.expired():
            assert timeout is not None
            return _unanswered(key, timeout)
        return Unknown(f"reconciler raised {type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001
        return Unknown(f"reconciler raised {type(exc).__name__}: {exc}")
    finally:
        _reconciling.reset(marked)
    return _verdict(answer)


def _about(record: Record | None, work: Callable[..., Verdict], *args: Any) -> Verdict:
    marked = _reconciling.set(record)
    try:
        return work(*args)
    finally:
        _reconciling.reset(marked)


def _sync_answer(reconcile: Callable[[str, Any], Any], key: str, args: Any) -> Verdict:
    try:
        answer = reconcile(key, args)
        if inspect.isawaitable(answer):
            close = getattr(answer, "close", None)
            if close:
                close()
            return Unknown("an async reconciler cannot be used from the sync run()")
    except Exception as exc:  # noqa: BLE001
        return Unknown(f"reconciler raised {type(exc).__name__}: {exc}")
    return _verdict(answer)


def _start(future: concurrent.futures.Future[Any], work: Callable[[], Any]) -> None:
    """Run `work` on a daemon thread of its own (in a copy of the caller's context) and
    put its outcome in `future`, unless the caller has given up on it (cancelled)."""
    context = contextvars.copy_context()

    def run() -> None:
        try:
            outcome = context.run(work)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller, if any
            if future.set_running_or_notify_cancel():
                future.set_exception(exc)
            return
        if future.set_running_or_notify_cancel():
            future.set_result(outcome)
        else:
            log.info("a reconciler answered after its caller stopped waiting; ignored")

    threading.Thread(target=run, name="crewai-idempotent-reconcile", daemon=True).start()


def _unanswered(key: str, timeout: float) -> Unanswered:
    log.warning(
        "the reconciler of %r did not answer within reconcile_timeout_s=%s; the outcome "
        "stays unknown and a later answer is ignored",
        key,
        timeout,
    )
    return Unanswered(
        f"the reconciler did not answer within reconcile_timeout_s={timeout:g} s "
        "(a later answer is ignored)"
    )


def _wait_for_event(event: threading.Event, seconds: float) -> bool:
    return event.wait(seconds)


def _verdict(answer: Any) -> Verdict:
    if answer is Absent:
        return Absent()
    if answer is Unknown:
        return Unknown()
    if isinstance(answer, Found | Absent | Unknown):
        return answer
    return Unknown(f"reconciler returned {answer!r}, not Found(result), Absent or Unknown")


# -- reconcilers named by import path ------------------------------------------------

_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_named: dict[str, NamedReconciler] = {}
_named_lock = threading.Lock()


class NamedReconciler:
    """A reconciler named by its import path, `"package.module:attribute"`, imported the
    first time it is asked (so that a tool module and its reconciler's module may import
    each other). An async function named so is awaited on the async path, as any is.
    `path` is the import path (`named` checks it and makes the object); nothing is raised
    here, where the path is only kept: it is imported when the reconciler is first asked."""

    __slots__ = ("_target", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self._target: Callable[[str, Any], Any] | None = None

    def resolve(self) -> Callable[[str, Any], Any]:
        """The callable the path names (imported now if it was not yet). Raises
        `ImportError` or `AttributeError` saying what is missing, `TypeError` if it is not
        callable."""
        target = self._target
        if target is None:
            module_name, _, attribute = self.path.partition(":")
            found: Any = importlib.import_module(module_name)
            for part in attribute.split("."):
                try:
                    found = getattr(found, part)
                except AttributeError:
                    raise AttributeError(
                        f"reconcile={self.path!r}: {module_name} has no {attribute!r}"
                    ) from None
            if not callable(found):
                raise TypeError(
                    f"reconcile={self.path!r} names a {type(found).__name__}, not a callable "
                    "(key, args) -> Found | Absent | Unknown"
                )
            target = self._target = found
        return target

    def __call__(self, key: str, args: Any) -> Any:
        return self.resolve()(key, args)

    def __repr__(self) -> str:
        return f"NamedReconciler({self.path!r})"


def named(path: str) -> NamedReconciler:
    """The reconciler `path` names (`"package.module:attribute"`), one object per path.

    The path must be well formed and its module must exist: raises `ValueError`
    otherwise, here, where the path is given; the module is imported when the reconciler
    is first asked, or now if it already has been (then a missing attribute is an error
    here too)."""
    if not isinstance(path, str) or not _PATH.fullmatch(path.strip()):
        raise ValueError(
            f"reconcile={path!r}: an import path is 'package.module:function' "
            "(or 'package.module:object.method')"
        )
    path = path.strip()
    module_name = path.partition(":")[0]
    with _named_lock:
        reconciler = _named.get(path)
    if reconciler is None:
        try:
            spec = importlib.util.find_spec(module_name)
        except (ImportError, ValueError) as exc:
            raise ValueError(
                f"reconcile={path!r}: cannot find module {module_name!r}: {exc}"
            ) from exc
        if spec is None:
            raise ValueError(f"reconcile={path!r}: no module named {module_name!r}")
        with _named_lock:
            reconciler = _named.setdefault(path, NamedReconciler(path))
    module = sys.modules.get(module_name)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", 0):
        try:
            reconciler.resolve()  # once imported, a name it lacks is said here
        except (AttributeError, TypeError) as exc:
            raise ValueError(str(exc)) from exc
    return reconciler


def path_of(reconcile: Any) -> str | None:
    """The import path another process can find `reconcile` by: a named reconciler's own,
    or a module-level function's `module:name`; None for anything else (a lambda, a
    closure, a method, an object)."""
    if isinstance(reconcile, NamedReconciler):
        return reconcile.path
    if not inspect.isfunction(reconcile):
        return None
    module, name = getattr(reconcile, "__module__", None), reconcile.__qualname__
    if not module or module == "__main__" or "<" in name or "." in name:
        return None
    return f"{module}:{name}"
