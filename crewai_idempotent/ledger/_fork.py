"""What every open handle must do around fork(), so that a child never uses its parent's.

Celery's prefork pool, `gunicorn --preload` and multiprocessing's `fork` start method all
fork a process that may already have used a ledger. Whatever the parent held (SQLite
connections and SQLite's per-process lock bookkeeping, the lease keeper's table of
claims, server connections, file locks) must not be used, renewed or closed by the
child. Objects that hold such handles register here and get three calls, in the order
`os.register_at_fork` gives: `before_fork` in the parent (quiesce: finish or block
in-flight work, drop what cannot cross), then `after_fork_in_parent` (resume) or
`after_fork_in_child` (forget everything inherited, without closing it: closing a shared
socket or SQLite handle in the child would break the parent).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Protocol


class ForkAware(Protocol):
    def before_fork(self) -> None: ...

    def after_fork_in_parent(self) -> None: ...

    def after_fork_in_child(self) -> None: ...


log = logging.getLogger("crewai_idempotent")

# MADV_WIPEONFORK (Linux 4.14) by its number where Python does not name it: 18 on every
# architecture that takes its madvise numbers from asm-generic (alpha, mips and parisc
# have their own, and go without).
_WIPEONFORK_ARCHES = ("x86_64", "i686", "aarch64", "armv7l", "riscv64", "ppc64le", "s390x")


def _fork_marker() -> mmap.mmap | bytearray:
    """One byte that reads 1 until this process forks: the kernel hands every child,
    however it was forked, a zeroed copy of the page (MADV_WIPEONFORK).

    A store asks it on every operation instead of `os.getpid()`, a system call: only a
    0 (a fork happened) sends it on to compare pids. A fork through `os.fork()` re-arms
    the page once every object's hooks have run; one that bypassed them leaves it 0, so
    that process keeps comparing pids, as every process did before. Without the advice
    (another OS, an older kernel, an unlisted architecture) the byte is always 0.
    """
    advice = getattr(mmap, "MADV_WIPEONFORK", None)
    if advice is None and os.uname().sysname == "Linux":
        advice = 18 if os.uname().machine in _WIPEONFORK_ARCHES else None
    if advice is None:
        return bytearray(1)
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        page.madvise(advice)
    except (AttributeError, OSError, ValueError):
        return bytearray(1)
    page[0] = 1
    return page


unforked = _fork_marker()

_objects: weakref.WeakSet[ForkAware] = weakref.WeakSet()
_objects_lock = threading.Lock()
# The objects quiesced by the current fork, held strongly until the fork is over so that
# the same set that was paused is resumed.
_in_fork: list[ForkAware] = []


def register(obj: ForkAware) -> None:
    """Call `obj`'s fork hooks on every later fork() of this process."""
    with _objects_lock:
        _objects.add(obj)


def unregister(obj: ForkAware) -> None:
    with _objects_lock:
        _objects.discard(obj)


def _before() -> None:
    # The lock stays held across fork() so that no registration races the snapshot;
    # both sides release it afterwards.
    _objects_lock.acquire()
    _in_fork[:] = list(_objects)
    for obj in _in_fork:
        _call(obj.before_fork)


def _after_in_parent() -> None:
    try:
        for obj in reversed(_in_fork):
            _call(obj.after_fork_in_parent)
    finally:
        _in_fork.clear()
        _objects_lock.release()


def _after_in_child() -> None:
    # The forking thread is the child's only thread, and a Lock has no owner: releasing
    # the lock taken in `_before` is safe here too.
    noted = False
    try:
        noted = all([_call(obj.after_fork_in_child) for obj in reversed(_in_fork)])
    finally:
        _in_fork.clear()
        _objects_lock.release()
        # Every object has taken note of the new pid: the marker may say "unforked" again.
        # If one hook failed, that object still holds its parent's state: the marker stays
        # 0, so every operation keeps comparing pids and it finds out for itself.
        if noted and isinstance(unforked, mmap.mmap):
            unforked[0] = 1


def _call(hook: Callable[[], None]) -> bool:
    # One object's failing hook must not deprive the others of theirs: each object that
    # missed its before_fork must find out in its after hooks (see the backends), and
    # os.register_at_fork would otherwise skip every object after the failing one.
    try:
        hook()
    except Exception:
        log.exception("fork hook %r failed", hook)
        return False
    return True


os.register_at_fork(
    before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child
)


class LockedAcrossFork:
    """Fork hooks for an object whose state `_lock` guards: the lock is held across fork(),
    so the child copies that state whole, never mid-change. The child gets a new lock and
    forgets what belongs to the parent's threads (`_forget_in_child`)."""

    _lock: threading.Lock

    def before_fork(self) -> None:
        self._lock.acquire()

    def after_fork_in_parent(self) -> None:
        self._lock.release()

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._forget_in_child()

    def _forget_in_child(self) -> None:
        raise NotImplementedError
