"""Leases: a claim this process holds, and the thread that keeps it alive.

A claim's lease says "its owner is still running the body". One daemon thread per ledger
renews the leases of the claims this process runs (every `lease_s / 3`), each renewal a
compare-and-set, so a claim that was taken over is noticed and never renewed again. A
forked child forgets its parent's claims: renewing them would keep a dead parent's claim
alive for as long as the child lives.

The keeper keeps its schedule on the ledger's clock (`_policy.Clock`), the one the
ledger's waits use: a test that moves that clock makes renewals fall due at once, and
no test waits for one in real time.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from . import _fork
from ._backend import CacheBackend
from ._fork import LockedAcrossFork
from ._policy import Clock, _Options
from ._record import Record, _whoami

log = logging.getLogger("crewai_idempotent")


class _Claim:
    """A claim this process holds; the lease keeper renews it until `done`."""

    __slots__ = ("by", "done", "due", "lease_s", "lock", "lost", "pid", "record", "ttl")

    def __init__(self, record: Record, options: _Options, by: str | None = None) -> None:
        self.record = record
        # Who the history names for the outcome: the owner, labelled once per claim.
        self.by = by or (record.owner.label if record.owner else _whoami())
        self.lease_s = options.lease_s
        self.ttl = options.ttl
        self.lock = threading.Lock()
        self.done = False
        self.lost = False
        self.due = 0.0
        # A forked child inherits the object, not the claim. The owner was made for this
        # claim in this process a moment ago, so its pid spares a system call per claim.
        self.pid = record.owner.pid if record.owner else os.getpid()


class _LeaseKeeper(LockedAcrossFork):
    """One daemon thread per ledger that renews the leases of the claims this process runs.

    Across fork() the child starts with an empty table: the claims are the parent's, and
    renewing them from the child would keep a dead parent's claim alive as long as the
    child lives. The child's own claims start the child's own thread.
    """

    def __init__(self, backend: CacheBackend, clock: Clock | None = None) -> None:
        self._backend = backend
        self._host = backend.host_clock
        self._monotonic = time.monotonic if clock is None else clock.monotonic
        # A clock the test moves must be able to end the keeper's pause: it waits through
        # the clock when the clock can wait (`Clock.wait`), in real time otherwise.
        waits = getattr(clock, "wait", None)
        self._wait = _wait_for_event if waits is None else waits
        self._claims: dict[int, _Claim] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        _fork.register(self)

    def add(self, claim: _Claim) -> None:
        claim.due = self._monotonic() + claim.lease_s / 3
        with self._lock:
            self._claims[id(claim)] = claim
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="crewai-idempotent-leases", daemon=True
                )
                self._thread.start()
            elif claim.lease_s < 3.0:
                self._wake.set()

    def remove(self, claim: _Claim) -> None:
        with self._lock:
            self._claims.pop(id(claim), None)

    def claims(self) -> list[Record]:
        """The claims whose leases this process renews."""
        with self._lock:
            return [claim.record for claim in self._claims.values()]

    def _forget_in_child(self) -> None:
        self._claims = {}
        self._wake = threading.Event()
        self._thread = None

    def _loop(self) -> None:
        monotonic = self._monotonic
        idle_since = monotonic()
        me = threading.current_thread()
        while True:
            with self._lock:
                if self._thread is not me:  # a fork() child's copy of the table
                    return
                claims = list(self._claims.values())
                now = monotonic()
                if not claims and now - idle_since > 5.0:
                    self._thread = None
                    return
            if claims:
                idle_since = now
            due = min((c.due for c in claims), default=now + 1.0)
            if due > now:
                self._wait(self._wake, min(due - now, 1.0))
                self._wake.clear()
                continue
            for claim in claims:
                if claim.due <= monotonic():
                    self._renew(claim)

    def _renew(self, claim: _Claim) -> None:
        with claim.lock:
            if claim.done or claim.lost:
                claim.due = float("inf")
                return
            current = claim.record
            # The next renewal is due a third of a lease after the moment this one's
            # deadline is measured from, not after its write returns: a slow write then
            # never pushes the schedule back.
            started = self._monotonic()
            try:
                now = self._backend.now()
                host = self._host
                new = current.evolve(
                    None,
                    lease_expires_at=now + claim.lease_s,
                    host_lease=None
                    if host is None
                    else (host.boot, host.running() + claim.lease_s),
                    updated_at=now,
                )
                stored = self._backend.replace(current, new)
            except Exception:
                log.warning("could not renew the lease on %r", current.key, exc_info=True)
                claim.due = self._monotonic() + min(1.0, claim.lease_s / 10)
                return
            if stored:
                claim.record = new
                claim.due = started + claim.lease_s / 3
            else:
                claim.lost = True
                claim.due = float("inf")
                log.warning("lease on %r was taken over by another worker", current.key)


def _wait_for_event(event: threading.Event, seconds: float) -> bool:
    return event.wait(seconds)
