"""The dispatcher: delivers one ledger's outbox to its channels.

A pass (`run_once`) reads the entries not yet delivered (a select of the outbox's prefix,
never the whole ledger) and, for each:

1. a waiting entry is looked up (`_outbox.confirmation`): its transition happened
   (now due), may still happen (looked at again later, less and less often) or never will
   (deleted: nothing to deliver);
2. a due entry with a channel whose next try has come is *claimed*: a compare-and-set of
   the entry writes this dispatcher's name and a lease, as a ledger claim does, so one
   dispatcher at a time sends an entry, across processes and hosts (a lease that lapsed,
   its dispatcher dead or frozen, is taken over; the next one sends again with the same
   delivery id). Each channel is tried in turn, never past the lease; the results go in
   the entry by another compare-and-set, which also releases the claim;
3. a failed try is tried again after a backoff (doubling from `backoff_s` to
   `backoff_max_s`, with jitter, or longer if the receiver's Retry-After asks for longer,
   up to `retry_after_max_s`): a dead receiver delays an entry, never drops it;
4. an entry delivered to every channel that wants it moves to `crewai-idempotent/delivered/`
   (kept `retain_s`, for `notifications ls`), so the outbox a pass reads stays small. A
   granted approval stays until its grant ends, when the dispatcher records whether it
   expired unused (`Approvals.expire`: an "approval.expired" entry).

Every try is in the entry's log (`notifications ls`/`show`) and, with OpenTelemetry, a
span and counters (`_telemetry`). The dispatcher runs in `crewai-idempotent notify
--watch`, in a process whose settings name channels (`notify=`), or in your own
(`Dispatcher(...).start()`); any number of them may serve one ledger.
"""

from __future__ import annotations

import logging
import math
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._errors import DeliveryFailed
from ..ledger._backend import CacheBackend
from ..ledger._hostclock import HostClock
from ..ledger._record import Record, Status
from ..ledger._results import encode
from . import _incidents, _telemetry
from ._channels import channels_from
from ._kinds import Channel
from ._message import Message
from ._outbox import (
    DELIVERED,
    DOCUMENT,
    HAPPENED,
    VOID,
    Entry,
    confirmation,
    delivered,
    pending,
    waits,
)

log = logging.getLogger("crewai_idempotent")

_LOG_KEPT = 50  # tries kept in an entry's log; `tries` counts them all
_MARGIN_S = 1.0  # a try starts only if it can end this long before the claim lapses
_RECHECK_MAX_S = 60.0  # a waiting entry is looked at again at least this often
#: The longest pause a receiver's Retry-After gets (a day): a longer one, or a date far
#: ahead, is taken as this, so a receiver cannot park an entry for good.
RETRY_AFTER_MAX_S = 86400.0
_SOON_S = 0.05  # after an entry written in this process, the pause before looking

Listener = Callable[[str, Entry], None]


class _Gone:
    """What `_deliver` says of an entry that left the outbox meanwhile."""


_GONE = _Gone()


@dataclass
class Pass:
    """What one pass did: entries confirmed and voided, tries that delivered and that
    failed, entries delivered to every channel, entries another dispatcher held, and
    entries still waiting for their transition."""

    confirmed: int = 0  # waiting entries whose transition was seen: now due
    voided: int = 0  # waiting entries whose transition never will be: deleted
    sent: int = 0  # tries that delivered
    failed: int = 0  # tries that failed
    delivered: int = 0  # entries delivered to every channel, moved to the delivered ones
    busy: int = 0  # entries another dispatcher held, or claimed first
    waiting: int = 0  # entries still waiting for their transition
    # Entries still to be delivered after the pass (`Entry.undelivered`: due, not yet
    # delivered to every channel), as `notifications ls --state pending` lists them.
    pending: int = 0


class Dispatcher:
    """Delivers the outbox of the ledger kept in `backend` to `channels` (URLs or
    `Channel`s): at least once each, with backoff, one dispatcher per entry at a time.

    `poll_s` is the pause between passes when nothing wakes it; a failed try is tried
    again after `backoff_s`, doubling up to `backoff_max_s`, or after the receiver's
    Retry-After when it asks for longer (up to `retry_after_max_s`, a day); delivered
    entries are kept `retain_s` (30 days) for `notifications ls`.
    `name` identifies this dispatcher in claims and logs (host:pid:random by default);
    `lease_s` is how long a claim holds an entry (longer than a try: the longest channel
    `timeout_s` plus 2 s); `clock` (`monotonic()`, `wait(event, s)`) is for tests.
    `listener(event, entry)` hears "confirmed", "void", "sent", "failed" and "delivered",
    in the dispatcher's thread (the console's live view listens here); for "sent" and
    "failed" (one event per try), `entry.log[-1]` is the try the event is about.

    Raises `TypeError` for a `backend` that is not a `CacheBackend`, what `channels_from`
    raises for `channels`, and `ValueError` for no channel, a duration that is not a
    positive number or a `lease_s` shorter than a try may take.
    """

    def __init__(
        self,
        backend: CacheBackend,
        channels: Any,
        *,
        poll_s: float = 1.0,
        lease_s: float = 60.0,
        backoff_s: float = 2.0,
        backoff_max_s: float = 3600.0,
        retry_after_max_s: float = RETRY_AFTER_MAX_S,
        retain_s: float = 30 * 86400.0,
        name: str | None = None,
        clock: Any = None,
        listener: Listener | None = None,
    ) -> None:
        if not isinstance(backend, CacheBackend):
            raise TypeError(f"backend must be a CacheBackend, not {type(backend).__name__}")
        self.channels: tuple[Channel, ...] = channels_from(channels, "Dispatcher")
        if not self.channels:
            raise ValueError("a dispatcher needs at least one channel to deliver to")
        for label, value in (
            ("poll_s", poll_s), ("lease_s", lease_s), ("backoff_s", backoff_s),
            ("backoff_max_s", backoff_max_s), ("retry_after_max_s", retry_after_max_s),
            ("retain_s", retain_s),
        ):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{label} must be a positive number of seconds, not {value!r}")
        longest = max(c.timeout_s for c in self.channels) + 2 * _MARGIN_S
        if lease_s < longest:
            raise ValueError(
                f"lease_s={lease_s} is shorter than a try may take ({longest} s: the longest "
                "channel timeout_s and a margin): another dispatcher could send it meanwhile"
            )
        self.backend = backend
        self.poll_s, self.lease_s = float(poll_s), float(lease_s)
        self.backoff_s, self.backoff_max_s = float(backoff_s), float(backoff_max_s)
        self.retry_after_max_s = float(retry_after_max_s)
        self.retain_s = float(retain_s)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.listener = listener
        self._monotonic: Callable[[], float] = time.monotonic if clock is None else clock.monotonic
        self._clock = clock
        self._host: HostClock | None = backend.host_clock
        self._lock = threading.Lock()  # one pass at a time
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._recheck: dict[str, tuple[float, float]] = {}  # id: (next look, pause)
        self._pruned_at = float("-inf")
        self._soon = False
        self.last: Pass = Pass()
        _telemetry.watch(self)

    def __repr__(self) -> str:
        return f"<Dispatcher {self.name} of {self.backend!r} to {[c.name for c in self.channels]}>"

    # -- running -----------------------------------------------------------------------

    def start(self) -> None:
        """Run passes on a daemon thread until `stop()`; a dispatcher already running is
        left as it is. Raises nothing."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(
                target=self.run, name=f"crewai-idempotent-dispatcher-{self.name}", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End `run` (on `start`'s thread or the caller's) after the pass in progress, and
        wait up to `timeout` seconds for `start`'s thread to end (not when called from it).
        Raises nothing."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def wake(self, soon: bool = False) -> None:
        """Run the next pass now; `soon`: in a moment, for an entry just written in this
        process, whose transition is written right after it. Raises nothing."""
        if soon:
            self._soon = True
        self._wake.set()

    def forked(self) -> None:
        """In a forked child: the parent's thread and locks are the parent's, so this one
        gets its own and is not running (`start` it again). Raises nothing."""
        self._lock = threading.Lock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = None

    def run(self, stop: threading.Event | None = None) -> None:
        """Run passes every `poll_s` until `stop` (or `stop()`) is set. Raises nothing: a
        pass that fails (the ledger does not answer) is logged and the next one waits
        longer."""
        stop = stop or self._stop
        pause = self.poll_s
        while not stop.is_set() and not self._stop.is_set():
            try:
                self.run_once()
                pause = self.poll_s
            except Exception:
                log.exception("the outbox dispatcher %s could not finish a pass", self.name)
                pause = min(pause * 2, 60.0)
            self._wait(pause)
            self._wake.clear()
            if self._soon:  # written here a moment ago: look once its transition is too
                self._soon = False
                self._stop.wait(_SOON_S)
                self._recheck.clear()

    def _wait(self, seconds: float) -> None:
        if self._clock is not None and hasattr(self._clock, "wait"):
            self._clock.wait(self._wake, seconds)
        else:
            self._wake.wait(seconds)

    # -- one pass ----------------------------------------------------------------------

    def run_once(self) -> Pass:
        """One pass over the outbox; what it did. Raises `LedgerUnavailable` when the
        ledger does not answer (nothing is lost: the next pass starts over)."""
        with self._lock:
            done = Pass()
            self._prune()
            # Oldest first: a person reads "asked" before "approved" (a failed try of one
            # entry never holds back the next: each has its own schedule).
            entries = sorted(pending(self.backend), key=lambda e: _order(e[1]))
            for record, doc in entries:
                if self._one(record, doc, done) == "due":
                    done.pending += 1
            self.last = done
            return done

    def _one(self, record: Record, doc: dict[str, Any], done: Pass) -> str | None:
        """One entry's turn in a pass; where it stands after it ("waiting", "due",
        "delivered"), or None when it left the outbox."""
        if waits(doc):
            if not self._look_again(doc["id"]):
                done.waiting += 1
                return "waiting"
            verdict = confirmation(self.backend, doc)
            if verdict == VOID:
                if self.backend.delete(record):
                    done.voided += 1
                    self._tell("void", doc)
                self._recheck.pop(doc["id"], None)
                return None
            if verdict != HAPPENED:
                self._later(doc["id"])
                done.waiting += 1
                return "waiting"
            self._recheck.pop(doc["id"], None)
            confirmed = {**doc, "state": "due", "confirmed_at": self.backend.now()}
            written = self._write(record, confirmed)
            if written is None:
                return "due"  # changed meanwhile (another dispatcher): the next pass sees it
            record, doc = written, confirmed
            done.confirmed += 1
            self._tell("confirmed", doc)
        if doc["state"] == "due":
            found = self._deliver(record, doc, done)
            if isinstance(found, _Gone):
                return None
            if found is None:
                return "due"  # not sent now: not its time yet, or another dispatcher's
            record, doc = found
        if doc["state"] == "delivered":
            return self._finish(record, doc, done)
        return str(doc["state"])

    def _deliver(
        self, record: Record, doc: dict[str, Any], done: Pass
    ) -> tuple[Record, dict[str, Any]] | _Gone | None:
        """The entry after its tries; None when nothing was tried (it stays as it is),
        `_GONE` when it left the outbox meanwhile."""
        backend = self.backend
        if backend.get(DELIVERED + doc["id"]) is not None:
            backend.delete(record)  # delivered already: this copy was put again since
            return _GONE
        now = backend.now()
        wanted = [c for c in self.channels if c.wants(doc["type"])]
        deliveries: dict[str, Any] = doc.get("deliveries") or {}
        left = [c for c in wanted if deliveries.get(c.name, {}).get("state") != "delivered"]
        if not left:
            finished = {**doc, "state": "delivered", "delivered_at": now}
            written = self._write(record, finished)
            return None if written is None else (written, finished)
        todo = [c for c in left if (deliveries.get(c.name, {}).get("next_at") or 0) <= now]
        if not todo:
            return None
        if _held(doc.get("claim"), now, self._host) and doc["claim"].get("by") != self.name:
            done.busy += 1
            return None
        claim: dict[str, Any] = {"by": self.name, "until": now + self.lease_s, "host": None}
        if self._host is not None:
            claim["host"] = [self._host.boot, self._host.running() + self.lease_s]
        claimed_doc = {**doc, "claim": claim}
        claimed = self._write(record, claimed_doc)
        if claimed is None:
            done.busy += 1  # another dispatcher claimed it first
            return None
        started = self._monotonic()
        message = Message.of(Entry.of(doc), backend)
        tries: list[dict[str, Any]] = []
        for channel in todo:
            if self._monotonic() - started + channel.timeout_s > self.lease_s - _MARGIN_S:
                break  # it could outlast the claim: the next pass claims again
            attempt = int(deliveries.get(channel.name, {}).get("attempts", 0)) + 1
            tries.append(self._try(channel, message, attempt))
        result = self._record(claimed, claimed_doc, tries, wanted, done)
        return _GONE if result is None else result

    def _try(self, channel: Channel, message: Message, attempt: int) -> dict[str, Any]:
        began = self._monotonic()
        try_: dict[str, Any] = {"channel": channel.name, "attempt": attempt, "by": self.name}
        with _telemetry.attempt(channel.name, message, attempt) as span:
            try:
                channel.send(message)
                try_.update(ok=True, error=None, status=None, retry_after=None)
            except DeliveryFailed as failed:
                try_.update(
                    ok=False, error=failed.reason, status=failed.status,
                    retry_after=failed.retry_after,
                )  # fmt: skip
            except Exception as exc:  # a channel's own bug is a failed try, never a stop
                log.exception("channel %s failed to send %s", channel.name, message.id)
                try_.update(
                    ok=False, error=f"{type(exc).__name__}: {exc}", status=None, retry_after=None
                )
            try_["took_s"] = round(self._monotonic() - began, 6)
            span.done(try_)
        try_["at"] = self.backend.now()
        return try_

    def _record(
        self,
        record: Record,
        doc: dict[str, Any],
        tries: list[dict[str, Any]],
        wanted: list[Channel],
        done: Pass,
    ) -> tuple[Record, dict[str, Any]] | None:
        """The tries go in the entry, and the claim is released; if another dispatcher
        took the entry over meanwhile (this one outlived its claim), they are merged into
        what it wrote, its claim left alone."""
        mine = True
        while True:
            new = self._with_tries(doc, tries, wanted, release=mine)
            written = self._write(record, new)
            if written is not None:
                break
            current = self.backend.get(record.key)
            if current is None:
                return None  # moved on by another dispatcher: every channel had it
            record, doc = current, _outbox_doc(current)
            mine = (doc.get("claim") or {}).get("by") == self.name
        # One event per try, each with the entry as it stood after that try: its log
        # ends with the try the event is about.
        kept = list(new.get("log") or ())
        for n, one in enumerate(tries):
            log_then = kept[: len(kept) - (len(tries) - 1 - n)]
            if one["ok"]:
                done.sent += 1
                self._tell("sent", {**new, "log": log_then})
            else:
                done.failed += 1
                self._tell("failed", {**new, "log": log_then})
        return written, new

    def _with_tries(
        self, doc: dict[str, Any], tries: list[dict[str, Any]], wanted: list[Channel], release: bool
    ) -> dict[str, Any]:
        deliveries = {name: dict(d) for name, d in (doc.get("deliveries") or {}).items()}
        now = self.backend.now()
        for one in tries:
            d = deliveries.setdefault(one["channel"], {"state": "pending", "attempts": 0})
            if d.get("state") == "delivered":
                continue
            d["attempts"] = max(int(d.get("attempts", 0)), one["attempt"])
            if one["ok"]:
                d.update(state="delivered", delivered_at=one["at"], next_at=None)
            else:
                d.update(last_error=one["error"], next_at=now + self._backoff(one))
        new = {
            **doc, "deliveries": deliveries, "log": [*doc.get("log", ()), *tries][-_LOG_KEPT:],
            "tries": int(doc.get("tries", 0)) + len(tries),
        }  # fmt: skip
        if release:
            new["claim"] = None
        if all(deliveries.get(c.name, {}).get("state") == "delivered" for c in wanted):
            new.update(state="delivered", delivered_at=now)
        return new

    def _backoff(self, one: dict[str, Any]) -> float:
        delay = min(self.backoff_s * 2 ** (one["attempt"] - 1), self.backoff_max_s)
        delay *= random.uniform(0.75, 1.0)  # dispatchers retrying alike spread out
        asked = one.get("retry_after")
        if asked is not None and not math.isnan(asked):
            # The receiver knows when it will take deliveries again: never sooner than
            # that, whatever `backoff_max_s` says, up to a bound of its own.
            delay = max(delay, min(float(asked), self.retry_after_max_s))
        return delay

    def _finish(self, record: Record, doc: dict[str, Any], done: Pass) -> str | None:
        """Delivered everywhere: a granted approval waits for its grant to end; the rest
        moves to the delivered entries (copied first, so nothing is ever in neither)."""
        watch = doc.get("watch")
        if watch:
            if watch["at"] > self.backend.now():
                return "delivered"  # delivered everywhere; kept until the grant ends
            from ..gates._approvals import Approvals

            Approvals(self.backend).expire(watch["id"], watch["round"])
        final = {**doc, "claim": None, "watch": None}
        final.setdefault("delivered_at", self.backend.now())
        now = self.backend.now()
        copy = Record(
            DELIVERED + doc["id"], Status.COMMITTED, DOCUMENT, 1, 1, None, 0, now, now,
            result=encode(final),
        )  # fmt: skip
        self.backend.insert(copy)
        if self.backend.delete(record):
            done.delivered += 1
            self._tell("delivered", final)
        return None

    def _prune(self) -> None:
        """Once an hour (and at the first pass): delivered entries older than `retain_s`
        go, and what processes of this host that died during an outage of this ledger
        left in their spool comes in (`_incidents`)."""
        if self._monotonic() - self._pruned_at < 3600.0:
            return
        self._pruned_at = self._monotonic()
        _incidents.flush_spools(self.backend)
        cutoff = self.backend.now() - self.retain_s
        # Only those moved before the cutoff are read (an entry is moved once delivered,
        # so it was delivered before it moved): the store's index of them by time.
        for record, doc in delivered(self.backend, before=cutoff):
            if float(doc.get("delivered_at") or doc["at"]) < cutoff:
                self.backend.delete(record)

    # -- helpers -----------------------------------------------------------------------

    def _write(self, record: Record, doc: dict[str, Any]) -> Record | None:
        now = self.backend.now()
        new = record.evolve(None, result=encode(doc), updated_at=now)
        return new if self.backend.replace(record, new) else None

    def _look_again(self, entry_id: str) -> bool:
        due = self._recheck.get(entry_id)
        return due is None or due[0] <= self._monotonic()

    def _later(self, entry_id: str) -> None:
        """An entry whose transition may still happen is looked at less and less often
        (its writer may be frozen, or dead, leaving it to whoever writes the source next)."""
        pause = min(self._recheck.get(entry_id, (0.0, self.poll_s / 2))[1] * 2, _RECHECK_MAX_S)
        self._recheck[entry_id] = (self._monotonic() + pause, pause)

    def _tell(self, event: str, doc: dict[str, Any]) -> None:
        if self.listener is None:
            return
        try:
            self.listener(event, Entry.of(doc))
        except Exception:
            log.exception("outbox listener failed on %s of %s", event, doc.get("id"))

    def close(self) -> None:
        self.stop()
        for channel in self.channels:
            channel.close()


def _held(claim: Any, now: float, host: HostClock | None) -> bool:
    """Whether a dispatcher's claim on an entry is still live: by the host's clock when it
    was read on this boot (no wall-clock step moves it), else by the store's clock."""
    if not isinstance(claim, dict):
        return False
    stamp = claim.get("host")
    if host is not None and isinstance(stamp, list) and len(stamp) == 2 and stamp[0] == host.boot:
        return bool(stamp[1] > host.running())
    return bool(float(claim.get("until") or 0) > now)


def _order(doc: dict[str, Any]) -> tuple[float, int, str]:
    return (float(doc["at"]), int(doc.get("seq") or 0), str(doc["id"]))


def _outbox_doc(record: Record) -> dict[str, Any]:
    from ._outbox import doc_of

    return doc_of(record)
