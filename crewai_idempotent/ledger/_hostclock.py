"""The host's clocks, which no wall-clock step moves, for the ledgers kept on one host.

Every process that opens an embedded ledger (SQLite, the file lock) runs on the host that
holds the file, so they can share a clock that NTP steps, `date -s`, a VM resumed with a
stale clock or a container's skewed clock never move. On Linux two readings, both since
the kernel booted:

* `running()`, CLOCK_MONOTONIC: the time the host has run. Leases are measured on it. A
  lease says "my owner has had its chance to renew"; a suspended host stops the owner and
  every waiter alike, and the keeper's own pauses are monotonic, so a lease measured with
  the time suspended (CLOCK_BOOTTIME) would read as lapsed the moment the host resumes,
  before its keeper had its turn, and a waiter would take over a live claim.
* `elapsed()`, CLOCK_BOOTTIME: the same plus the time suspended, i.e. the seconds a
  calendar counts, for what promises a span of time (an approval grant, a receipt's TTL).

A reading means something only on the boot it was taken in, so every stored deadline
carries the boot id (/proc/sys/kernel/random/boot_id, one per kernel boot, the same in
every container of the kernel). A time namespace (a container's, a CRIU restore) offsets
both clocks; its offsets (/proc/self/timens_offsets) are taken off, so processes in
different time namespaces of one kernel read the same clock. The boot id and the offsets
are read once per process, and the offsets again in a forked child (a child may live in
a time namespace its parent made).

macOS: CLOCK_UPTIME_RAW (running, stops in sleep) and CLOCK_MONOTONIC (elapsed, counts
sleep), with the boot session's UUID (sysctl kern.bootsessionuuid). Elsewhere (Windows,
the BSDs), or where these cannot be read, `this_host()` is None and the ledger judges
leases by the wall clock, as it always did (docs/backends.md, "Clocks").
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

log = logging.getLogger("crewai_idempotent")


class HostClock:
    """This host's step-free clocks, and the boot they count from.

    `boot` names the boot (a deadline read under another one cannot be compared), `name`
    the host as owners record it. `running()` and `elapsed()` are seconds on the host's
    clocks, the same in every process of this kernel whatever its time namespace.
    """

    __slots__ = ("_elapsed_id", "_elapsed_offset", "_running_id", "_running_offset", "boot", "name")

    def __init__(
        self,
        boot: str,
        name: str,
        *,
        running_id: int,
        elapsed_id: int,
        running_offset: float = 0.0,
        elapsed_offset: float = 0.0,
    ) -> None:
        self.boot = boot
        self.name = name
        self._running_id, self._elapsed_id = running_id, elapsed_id
        self._running_offset, self._elapsed_offset = running_offset, elapsed_offset

    def __repr__(self) -> str:
        return f"HostClock(boot={self.boot!r}, name={self.name!r})"

    def running(self) -> float:
        """Seconds the host has run since it booted (leases)."""
        return time.clock_gettime(self._running_id) - self._running_offset

    def elapsed(self) -> float:
        """Seconds since the host booted, the time suspended included (grants, TTLs)."""
        return time.clock_gettime(self._elapsed_id) - self._elapsed_offset

    def booted_at(self) -> float:
        """When this boot began, by this process's wall clock (epoch seconds)."""
        return time.time() - self.elapsed()


_lock = threading.Lock()
_loaded = False
_host: HostClock | None = None


def this_host() -> HostClock | None:
    """This host's clock, or None where there is none to be had (see the module docstring).

    One object per process, read once; the embedded backends hand it to their ledgers.
    """
    global _loaded, _host
    if not _loaded:
        with _lock:
            if not _loaded:
                _host = _load()
                _loaded = True
    return _host


def _load() -> HostClock | None:
    name = socket.gethostname()
    try:
        if sys.platform.startswith("linux"):
            running, elapsed = _time_namespace_offsets()
            return HostClock(
                _linux_boot_id(), name,
                running_id=time.CLOCK_MONOTONIC, elapsed_id=time.CLOCK_BOOTTIME,
                running_offset=running, elapsed_offset=elapsed,
            )  # fmt: skip
        if sys.platform == "darwin":
            return HostClock(
                _darwin_boot_id(), name,
                running_id=time.CLOCK_UPTIME_RAW, elapsed_id=time.CLOCK_MONOTONIC,
            )  # fmt: skip
    except (OSError, ValueError, AttributeError) as exc:
        log.warning(
            "no step-free host clock (%s: %s): embedded ledgers judge leases by the wall "
            "clock, which a clock step can fool (docs/backends.md, 'Clocks')",
            type(exc).__name__,
            exc,
        )
        return None
    return None


def _linux_boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        boot = f.read().strip()
    if not boot:
        raise ValueError("/proc/sys/kernel/random/boot_id is empty")
    return boot


def _time_namespace_offsets() -> tuple[float, float]:
    """The (monotonic, boottime) offsets of this process's time namespace, in seconds.

    /proc/self/timens_offsets shows the namespace this process's children are born in; it
    is this process's own unless this process called unshare(CLONE_NEWTIME), and then its
    own offsets cannot be read at all (ValueError: no host clock in that process).
    """
    try:
        mine = os.readlink("/proc/self/ns/time")
        children = os.readlink("/proc/self/ns/time_for_children")
    except OSError:
        return 0.0, 0.0  # a kernel without time namespaces: no offsets
    if mine != children:
        raise ValueError(
            "this process made a time namespace for its children; its own offsets are unknown"
        )
    try:
        with open("/proc/self/timens_offsets", encoding="ascii") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return 0.0, 0.0
    offsets = {"monotonic": 0.0, "boottime": 0.0}
    for line in lines:
        parts = line.split()
        if len(parts) == 3 and parts[0] in offsets:
            offsets[parts[0]] = int(parts[1]) + int(parts[2]) / 1e9
    return offsets["monotonic"], offsets["boottime"]


def _darwin_boot_id() -> str:
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = ctypes.c_size_t(64)
    buffer = ctypes.create_string_buffer(size.value)
    if libc.sysctlbyname(b"kern.bootsessionuuid", buffer, ctypes.byref(size), None, 0) != 0:
        raise OSError(ctypes.get_errno(), "sysctl kern.bootsessionuuid failed")
    boot = buffer.value.decode("ascii").strip()
    if not boot:
        raise ValueError("sysctl kern.bootsessionuuid is empty")
    return boot


def _after_fork_in_child() -> None:
    # A child may be born in a time namespace its parent made (unshare(CLONE_NEWTIME)
    # moves only the children): its offsets are read again, in place, so that every
    # backend holding the object reads the child's clock.
    host = _host
    if host is None or not sys.platform.startswith("linux"):
        return
    try:
        host._running_offset, host._elapsed_offset = _time_namespace_offsets()
    except (OSError, ValueError):
        log.warning("could not read this child's time namespace offsets; keeping its parent's")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
