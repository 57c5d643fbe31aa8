"""The sweeper: settles UNCERTAIN records and stale claims by asking their reconcilers.

A pass reads the ledger's UNCERTAIN records and its PENDING ones whose lease lapsed, oldest
update first, streamed from the store's index of each status (a few dozen at a time,
however many there are), and hands each to the ledger's own decision, `_Machine._sweep`,
driven by the ledger's own drivers: the rules of who may settle a record, how it is
fenced and what each answer writes live there, beside the transitions they race with.
What this module decides is policy: which reconciler a record's tool has
(`_registry.Finder`), how long to wait between asks once a reconciler answered Unknown
(doubling from `backoff_s` to `max_backoff_s`, counted from the record's own history, so
every sweeper on the ledger backs off alike), and when to
raise an alarm (`_alerts`).

Many sweepers may run on one ledger, on many hosts: a sweeper marks a record before it
asks (a compare-and-set; the others leave a marked record alone until the mark lapses),
and settles it with another compare-and-set, so each record is settled once, and an
owner that renews its lease or commits meanwhile wins.

`sweep()` is one pass; `watch()` repeats it until stopped; `start()` runs `watch()` on a
thread of its own (inside another process: a web console, a worker); `asweep()` and
`awatch()` are the same on an event loop, on the ledger's async driver and lanes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import heapq
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from .._errors import IdempotencyError, LedgerUnavailable
from ..ledger._backend import CacheBackend, url_of
from ..ledger._hostclock import HostClock
from ..ledger._ledger import Ledger
from ..ledger._policy import check_seconds
from ..ledger._record import Record, Status, _whoami
from ..ledger._results import decode
from ..ledger._select import Order, Select
from ..ledger._steps import Step, Swept, _Ask, _Call
from ..notifications import _incidents
from ._alerts import Alert, AlertChannel, count_swept, default_channels, report_open, send_all
from ._registry import Finder, Reconciler, _Blocking, key_prefix, tool_of

if TYPE_CHECKING:
    from ..signing._keyfile import Signer

log = logging.getLogger("crewai_idempotent.reconciliation")

T = TypeVar("T")

OUTCOMES = ("found", "absent", "unknown", "left", "due", "skipped", "overtaken", "error")
# Kinds of history event that keep a record open: it has been uncertain since the first of
# a trailing run of them.
_STILL_OPEN = ("uncertain", "unknown", "fenced", "late")


@dataclass(frozen=True)
class Result:
    """What came of one record in a pass. `outcome` is one of `OUTCOMES` (see `Swept`;
    "error": the ledger failed while the sweeper worked on it)."""

    key: str  # the record's idempotency key
    outcome: str  # one of `OUTCOMES`
    reason: str  # what came of it, as a person reads it
    tool: str | None = None  # the tool whose call made the record, if known
    reconciler: str | None = None  # the reconciler asked, as messages name it
    # The record as the pass last wrote or read it.
    record: Record | None = field(default=None, repr=False, compare=False)


@dataclass
class Report:
    """One pass: a result per record looked at, the alerts raised, and `error` when the
    ledger could not be read at all."""

    ledger: str  # the ledger's URL (a password as `***`)
    dry_run: bool  # whether the pass only said what it would ask
    started: float  # when the pass began (this host's clock)
    finished: float = 0.0  # when it ended (0 while it runs)
    results: list[Result] = field(default_factory=list)  # one per record looked at
    alerts: list[Alert] = field(default_factory=list)  # the alerts it raised
    error: str | None = None  # why the ledger could not be read, if it could not
    open_uncertain: int | None = None  # UNCERTAIN records left in the ledger after the pass

    def counts(self) -> dict[str, int]:
        """How many results had each of `OUTCOMES` (every outcome, 0 included). Raises
        nothing."""
        counts = dict.fromkeys(OUTCOMES, 0)
        for result in self.results:
            counts[result.outcome] += 1
        return counts

    @property
    def settled(self) -> int:
        counts = self.counts()
        return counts["found"] + counts["absent"]

    def summary(self) -> str:
        """The pass in one line: the ledger, how many records, the outcomes that occurred
        (or why the ledger was not swept). Raises nothing."""
        if self.error is not None:
            return f"{self.ledger}: not swept: {self.error}"
        counts = {k: v for k, v in self.counts().items() if v}
        said = ", ".join(f"{n} {k}" for k, n in counts.items()) or "nothing to settle"
        verb = "would ask about" if self.dry_run else "looked at"
        return f"{self.ledger}: {verb} {len(self.results)} record(s): {said}"


class Progress:
    """What a pass reports as it goes (the CLI draws a progress bar from it): override
    `started` and `done`, which do nothing here. Raises nothing."""

    def started(self, total: int) -> None:
        """The pass is about to look at `total` records. Raises nothing here; what an
        override raises ends the pass (`sweep` lets it through)."""

    def done(self, result: Result) -> None:
        """The pass is done with one record: `result`. Raises nothing here; what an
        override raises is logged, and the pass goes on."""


class Sweeper:
    """Settles a ledger's UNCERTAIN records and stale claims through their reconcilers.

    `ledger`: a `Ledger`, a `CacheBackend` or a ledger URL. Reconcilers are found by tool
    name in `reconcilers`, in what `imports` register and, unless `entry_points` is False,
    in the entry points, else by the import path a record names when it is under `imports`
    or `trust` (`_registry`). Each is asked for at most `timeout_s` (default: the ledger's
    `reconcile_timeout_s`, else 30 s); an Unknown answer is asked again after `backoff_s`,
    doubling up to `max_backoff_s`. Alerts (`_alerts`) go to `channels` (default: the log,
    OpenTelemetry and the ledger's own notification outbox): a record open for
    `alert_after_s`, a reconciler that answered Unknown `alert_unknowns` times in a row,
    an unreachable ledger; the same condition is said again after `alert_every_s` (the
    outbox keeps one entry per condition however often it is said). `tools` and `keys`
    narrow a pass; `dry_run` asks nothing and writes nothing, and says what it would ask.
    `concurrency`: how many records one pass works on at once.

    `signer` (`signing.Signer`): the sweeper signs each settlement (found or absent, via
    "sweeper") with its key, and the decision is kept on the record; workers whose ledger
    has trusted keys obey it only if that key is trusted for the `sweeper` role. Without
    one, a worker with trusted keys obeys none of its absent settlements, so a sweeper
    whose own ledger has trusted keys does not write them: the record stays UNCERTAIN and
    its history says why (settle it with a signed `resolve`).

    Raises `LedgerConfigurationError` for a ledger URL that cannot be opened (and what its
    backend raises), `ImportError` for one of `imports` that cannot be imported,
    `TypeError` for a `ledger` of another kind, a `signer` that is not a `Signer`, a
    reconciler that is neither callable nor a str, a duration that is not a number or an
    `alert_unknowns` that is not a whole number, and `ValueError` for a reconciler's
    import path that is malformed or names no module, a duration out of range, or a
    `concurrency` that is not a whole number, 1 or more.
    """

    def __init__(
        self,
        ledger: Ledger | CacheBackend | str,
        *,
        reconcilers: Mapping[str, Reconciler | str] | None = None,
        imports: Iterable[str] = (),
        trust: Iterable[str] = (),
        entry_points: bool = True,
        timeout_s: float | None = None,
        backoff_s: float = 60.0,
        max_backoff_s: float = 3600.0,
        alert_after_s: float = 3600.0,
        alert_unknowns: int = 3,
        alert_every_s: float = 3600.0,
        channels: Iterable[AlertChannel] | None = None,
        concurrency: int = 4,
        tools: Iterable[str] | None = None,
        keys: Iterable[str] | None = None,
        dry_run: bool = False,
        signer: Signer | None = None,
    ) -> None:
        if signer is not None:
            from ..signing._keyfile import Signer

            if not isinstance(signer, Signer):
                raise TypeError(
                    f"signer must be a signing.Signer (Signer.from_file(PATH)), not "
                    f"{type(signer).__name__}"
                )
        self.signer = signer
        self._owns = not isinstance(ledger, Ledger)
        if isinstance(ledger, str):
            from ..backends._url import backend_from_url

            ledger = backend_from_url(ledger)
        self.ledger = ledger if isinstance(ledger, Ledger) else Ledger(ledger)
        self.finder = Finder(reconcilers, imports=imports, trust=trust, entry_points=entry_points)
        timeout = timeout_s if timeout_s is not None else self.ledger.reconcile_timeout_s
        self.timeout_s = 30.0 if timeout is None else float(timeout)
        for name, value in (
            ("timeout_s", self.timeout_s),
            ("backoff_s", backoff_s),
            ("max_backoff_s", max_backoff_s),
            ("alert_after_s", alert_after_s),
            ("alert_every_s", alert_every_s),
        ):
            check_seconds(name, value, positive=name == "timeout_s")
        if isinstance(alert_unknowns, bool) or not isinstance(alert_unknowns, int):
            raise TypeError(f"alert_unknowns must be a whole number, not {alert_unknowns!r}")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be 1 or more (a whole number), not {concurrency!r}")
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self.alert_after_s, self.alert_unknowns = float(alert_after_s), alert_unknowns
        self.alert_every_s = float(alert_every_s)
        if channels is None:
            channels = default_channels(self.ledger.backend)
        self.channels = list(channels)
        self.concurrency = concurrency
        self.tools = None if tools is None else frozenset(tools)
        self.keys = None if keys is None else frozenset(keys)
        self.dry_run = dry_run
        # How long another sweeper leaves a record alone once this one marked it: long
        # enough for the answer, short enough that a sweeper that died is soon replaced.
        self.hold_s = self.timeout_s + 60.0
        self._alerted: dict[str, float] = {}
        self._alert_lock = threading.Lock()
        self._name: tuple[int, str] | None = None

    def __repr__(self) -> str:
        return f"Sweeper({url_of(self.ledger.backend)})"

    @property
    def url(self) -> str:
        return url_of(self.ledger.backend)

    @property
    def by(self) -> str:
        """Who this sweeper is in the records' history (and in the marks it writes)."""
        pid = os.getpid()
        if self._name is None or self._name[0] != pid:  # a forked child is another sweeper
            self._name = (pid, f"sweeper {_whoami()}:{pid}:{secrets.token_hex(3)}")
        return self._name[1]

    def close(self) -> None:
        """Close the ledger, if the sweeper opened it."""
        if self._owns:
            self.ledger.close()

    def __enter__(self) -> Sweeper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one pass ------------------------------------------------------------------------

    def sweep(self, progress: Progress | None = None) -> Report:
        """One pass over the ledger; the report says what came of every record. `progress`
        hears of it as it goes (its total is counted first, by reading the candidates once
        more). A ledger that cannot be read is the report's `error` and an alert, never an
        exception; what `progress.started` raises goes through."""
        report = Report(self.url, self.dry_run, time.time())
        ledger = self.ledger
        try:
            now = ledger._drive(_read(ledger.backend.now))
            if progress is not None:
                progress.started(ledger._drive(_read(self._count, now)))
            hooks = progress or Progress()
            candidates = self._candidates(now)
            by = self.by
            pool = (
                concurrent.futures.ThreadPoolExecutor(
                    self.concurrency, thread_name_prefix="crewai-idempotent-sweep"
                )
                if self.concurrency > 1
                else None
            )
            try:
                while chunk := ledger._drive(_read(_next, candidates)):
                    if pool is None:
                        for record in chunk:
                            result = self._one(record, by)
                            self._send(self._record(report, hooks, result, self._now()))
                        continue
                    futures = [pool.submit(self._one, record, by) for record in chunk]
                    for future in concurrent.futures.as_completed(futures):
                        raised = self._record(report, hooks, future.result(), self._now())
                        self._send(raised)
            finally:
                if pool is not None:
                    pool.shutdown()
            open_now = ledger._drive(_read(self._open_now))
        except IdempotencyError as exc:
            self._send(self._unreachable(report, exc))
            return report
        return self._finish(report, open_now)

    async def asweep(self, progress: Progress | None = None) -> Report:
        """`sweep` on the event loop: the ledger's async driver, its lanes, the same
        decisions. Up to `concurrency` records at once, as tasks. `progress` and what it
        raises as for `sweep`."""
        report = Report(self.url, self.dry_run, time.time())
        ledger = self.ledger
        io = ledger._lanes.io
        by = self.by
        limit = asyncio.Semaphore(self.concurrency)
        hooks = progress or Progress()

        async def one(record: Record) -> None:
            async with limit:
                result = await self._aone(record, by)
            await self._asend(self._record(report, hooks, result, await self._anow()))

        try:
            now = await self._anow()
            if progress is not None:
                progress.started(await ledger._adrive(_read(self._count, now), io))
            candidates = self._candidates(now)
            while chunk := await ledger._adrive(_read(_next, candidates), io):
                await asyncio.gather(*(one(record) for record in chunk))
            open_now = await ledger._adrive(_read(self._open_now), io)
        except IdempotencyError as exc:
            await self._asend(self._unreachable(report, exc))
            return report
        return self._finish(report, open_now)

    def _now(self) -> float:
        try:
            return self.ledger.backend.now()
        except Exception:  # noqa: BLE001 - the store's clock, when it cannot be read
            return time.time()

    async def _anow(self) -> float:
        """The store's clock without a round trip on the loop (a server clock is read on
        one of the ledger's lanes when a reading is due)."""
        if not self.ledger.backend.now_blocks():
            return self._now()
        return await asyncio.wrap_future(self.ledger._lanes.io().submit(self._now))

    def _candidates(self, now: float) -> Iterator[Record]:
        """The records a pass looks at, oldest update first, streamed: UNCERTAIN ones and
        PENDING ones whose lease lapsed (a live owner's are not even looked at), each read
        from the store's index of its status (or, with `keys`, those keys alone), narrowed
        by `tools`. Only records last written before the pass began (`now`): one the pass
        writes (or anyone writes meanwhile) moves past the end of the order and is left
        for the next pass, so a record is looked at once per pass."""
        backend = self.ledger.backend
        records: Iterable[Record]
        if self.keys is not None:
            found = (backend.get(key) for key in sorted(self.keys))
            records = sorted(
                (r for r in found if r is not None and r.status in _OPEN),
                key=_oldest,
            )
        else:
            records = heapq.merge(
                *(
                    backend.select(Select(status=status, order=Order.OLDEST, updated_before=now))
                    for status in _OPEN
                ),
                key=_oldest,
            )
        host = backend.host_clock
        seen: set[str] = set()  # keys only: a store's stream may yield a record twice
        for record in records:
            if record.key in seen:
                continue
            seen.add(record.key)
            if self._wanted(record, now, host):
                yield record

    def _wanted(self, record: Record, now: float, host: HostClock | None) -> bool:
        if self.keys is not None and record.key not in self.keys:
            return False
        # A tool by its recorded name or by the key's prefix, which is what the filter
        # matched before every claim recorded its tool's name (`ls --tool` matches it).
        if self.tools is not None and not (
            tool_of(record) in self.tools or key_prefix(record) in self.tools
        ):
            return False
        if record.status is Status.PENDING:
            try:
                return not record.lease_live(now, host)
            except LedgerUnavailable:
                return False  # a live lease another host holds: not this host's to judge
        return record.status is Status.UNCERTAIN

    def _count(self, now: float) -> int:
        """How many records a pass begun at `now` looks at (for a progress display)."""
        return sum(1 for _ in self._candidates(now))

    def _open_now(self) -> int:
        """The UNCERTAIN records in the ledger, counted from the store's index of them."""
        return sum(1 for _ in self.ledger.backend.select(Select(status=Status.UNCERTAIN)))

    def _one(self, record: Record, by: str) -> Result:
        pick, chosen = self._picker(on_loop=False)
        try:
            swept = self.ledger._drive(
                self.ledger._sweep(record.key, pick, by, self.hold_s, self.dry_run, self.signer)
            )
        except IdempotencyError as exc:
            return Result(record.key, "error", str(exc), tool_of(record), chosen[0], record)
        return self._result(record, swept, chosen[0])

    async def _aone(self, record: Record, by: str) -> Result:
        pick, chosen = self._picker(on_loop=True)
        ledger = self.ledger
        try:
            steps = ledger._sweep(record.key, pick, by, self.hold_s, self.dry_run, self.signer)
            swept = await ledger._adrive(steps, ledger._lanes.settle)
        except IdempotencyError as exc:
            return Result(record.key, "error", str(exc), tool_of(record), chosen[0], record)
        return self._result(record, swept, chosen[0])

    def _picker(self, on_loop: bool) -> tuple[Callable[[Record], _Ask | str], list[str | None]]:
        """The sweeper's half of the decision: which reconciler, with what, and whether
        now. `chosen[0]` says afterwards which reconciler it was. `on_loop`: for the async
        driver, which awaits an async reconciler on the loop."""
        chosen: list[str | None] = [None]

        def pick(record: Record) -> _Ask | str:
            reconciler, what = self.finder.find(record)
            if reconciler is None:
                return what
            chosen[0] = what
            unknowns, last = unknown_answers(record)
            if unknowns:
                wait = min(self.backoff_s * 2 ** (unknowns - 1), self.max_backoff_s)
                left = last + wait - self.ledger.backend.now()
                if left > 0:
                    return (
                        f"backing off: its reconciler answered Unknown {unknowns} time(s) in "
                        f"a row; asked again in {left:.0f} s"
                    )
            try:
                args = arguments(record)
            except Exception as exc:  # noqa: BLE001 - what cannot be decoded is not guessed
                return f"its recorded arguments cannot be read here: {type(exc).__name__}: {exc}"
            if on_loop and isinstance(reconciler, _Blocking):
                reconciler = reconciler.coroutine
            return _Ask(reconciler, record.key, args, self.timeout_s, record)

        return pick, chosen

    def _result(self, record: Record, swept: Swept, reconciler: str | None) -> Result:
        return Result(
            record.key, swept.outcome, swept.reason, tool_of(record), reconciler,
            swept.record if swept.record is not None else record,
        )  # fmt: skip

    def _record(
        self, report: Report, progress: Progress, result: Result, now: float
    ) -> list[Alert]:
        """Note `result` in the report; the alerts it raises, for the caller to send."""
        report.results.append(result)
        raised = []
        if not self.dry_run:
            count_swept(result.outcome, result.tool, self.ledger.backend)
            raised = self._alerts_for(result, now)
            report.alerts.extend(raised)
        try:
            progress.done(result)
        except Exception:  # a progress display never stops a pass
            log.exception("the sweep's progress display failed")
        return raised

    def _finish(self, report: Report, open_now: int) -> Report:
        report.open_uncertain = open_now
        report.finished = time.time()
        self._reachable()
        report_open(self.ledger.backend, open_now)
        return report

    def _unreachable(self, report: Report, exc: Exception) -> list[Alert]:
        report.error = str(exc) or type(exc).__name__
        report.finished = time.time()
        alert = Alert("ledger_unreachable", f"the sweeper cannot read the ledger: {exc}", self.url)
        if not self._due(alert.id):
            return []
        report.alerts.append(alert)
        return [alert]

    # -- alerts --------------------------------------------------------------------------

    def _alerts_for(self, result: Result, now: float) -> list[Alert]:
        record = result.record
        if record is None or result.outcome in ("found", "absent", "overtaken", "error"):
            return []
        if record.status not in (Status.UNCERTAIN, Status.PENDING):
            return []
        age = now - open_since(record)
        unknowns, _ = unknown_answers(record)
        raised = []
        if age >= self.alert_after_s:
            what = "UNCERTAIN" if record.status is Status.UNCERTAIN else "a stale claim"
            alert = Alert(
                "uncertain_too_long",
                f"{what} for {age:.0f} s (threshold {self.alert_after_s:g} s): "
                f"{result.reason or record.error or 'nothing settled it'}",
                self.url, record.key, record, result.tool, age, unknowns,
            )  # fmt: skip
            raised.append(alert)
        if self.alert_unknowns and unknowns >= self.alert_unknowns:
            last = next((e for e in reversed(record.history) if e.kind == "unknown"), None)
            said = last.note if last is not None else result.reason
            alert = Alert(
                "verifier_unknown",
                f"its reconciler ({result.reconciler or 'unknown'}) answered Unknown "
                f"{unknowns} time(s) in a row; the last: {said}",
                self.url, record.key, record, result.tool, age, unknowns,
            )  # fmt: skip
            raised.append(alert)
        return [alert for alert in raised if self._due(alert.id)]

    def _due(self, alert_id: str) -> bool:
        """Whether to say the condition now: not if it was said less than `alert_every_s`
        ago (by this sweeper; the outbox keeps one entry whoever says it)."""
        with self._alert_lock:
            now = time.monotonic()
            last = self._alerted.get(alert_id)
            if last is not None and now - last < self.alert_every_s:
                return False
            self._alerted[alert_id] = now
        return True

    def _send(self, alerts: list[Alert]) -> None:
        for alert in alerts:
            send_all(self.channels, alert)

    async def _asend(self, alerts: list[Alert]) -> None:
        """`_send` on one of the ledger's threads: a channel may write to the store (the
        outbox), which must not hold up the event loop."""
        if alerts:
            await asyncio.wrap_future(self.ledger._lanes.io().submit(self._send, alerts))

    def _reachable(self) -> None:
        """The ledger answered: an outage alerted before is over (the next one is said).
        The incidents watcher is told to look now rather than at its next probe, from its
        own thread: this runs on the event loop too."""
        unreachable = Alert("ledger_unreachable", "", self.url).id
        with self._alert_lock:
            was = self._alerted.pop(unreachable, None)
        if was is not None:
            log.warning("the sweeper reads %s again", self.url)
            _incidents.answered(self.ledger.backend)

    # -- again and again ------------------------------------------------------------------

    def watch(
        self,
        interval_s: float = 30.0,
        *,
        stop: threading.Event | None = None,
        passes: int | None = None,
        on_report: Callable[[Report], None] | None = None,
    ) -> None:
        """Sweep every `interval_s` seconds until `stop` is set (or `passes` are done),
        giving each report to `on_report`. A ledger that does not answer is an alert and a
        pass that ends early, never the end of the watch. Raises `TypeError` for an
        `interval_s` that is not a number, `ValueError` for a negative one; what
        `on_report` raises ends the watch."""
        check_seconds("interval_s", interval_s)
        stop = stop or threading.Event()
        done = 0
        while not stop.is_set():
            try:
                report = self.sweep()
            except Exception:  # a watch outlives any one pass
                log.exception("a sweep of %s failed", self.url)
            else:
                if on_report is not None:
                    on_report(report)
            done += 1
            if passes is not None and done >= passes:
                return
            stop.wait(interval_s)

    def start(self, interval_s: float = 30.0) -> Watching:
        """`watch` on a daemon thread of its own: for a process that does other work (a
        console, a worker). Stop it with `.stop()`. Raises `TypeError` for an
        `interval_s` that is not a number, `ValueError` for a negative one."""
        check_seconds("interval_s", interval_s)
        return Watching(self, interval_s)

    async def awatch(
        self,
        interval_s: float = 30.0,
        *,
        stop: asyncio.Event | None = None,
        passes: int | None = None,
        on_report: Callable[[Report], None] | None = None,
    ) -> None:
        """`watch` on the event loop (`asweep` every `interval_s`), until `stop` is set,
        `passes` are done, or the task is cancelled; `on_report` and what it raises as for
        `watch`. Raises `TypeError` for an `interval_s` that is not a number,
        `ValueError` for a negative one."""
        check_seconds("interval_s", interval_s)
        stop = stop or asyncio.Event()
        done = 0
        while not stop.is_set():
            try:
                report = await self.asweep()
            except Exception:  # a watch outlives any one pass
                log.exception("a sweep of %s failed", self.url)
            else:
                if on_report is not None:
                    on_report(report)
            done += 1
            if passes is not None and done >= passes:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)


class Watching:
    """A sweeper watching on a thread of its own (`Sweeper.start`): `sweeper.watch` every
    `interval_s` seconds, from the moment it is made, keeping the last ten reports in
    `reports`. Raises nothing (`Sweeper.start` checks `interval_s`)."""

    def __init__(self, sweeper: Sweeper, interval_s: float) -> None:
        self.sweeper = sweeper
        self.reports: list[Report] = []  # the last few passes, newest last
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=sweeper.watch,
            args=(interval_s,),
            kwargs={"stop": self._stop, "on_report": self._keep},
            name="crewai-idempotent-sweeper",
            daemon=True,
        )
        self._thread.start()

    def _keep(self, report: Report) -> None:
        self.reports = [*self.reports[-9:], report]

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the pass in progress (if any) and wait up to `timeout` seconds for
        it (None: as long as it takes). Raises nothing."""
        self._stop.set()
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


# -- reading the ledger -------------------------------------------------------------------

#: The statuses a pass looks at.
_OPEN = (Status.UNCERTAIN, Status.PENDING)
#: Candidates read at once (on the ledger's lanes, on the event loop): what a pass holds
#: of them, however many there are.
_CHUNK = 64


def _oldest(record: Record) -> tuple[float, str]:
    return (record.updated_at, record.key)


def _read(fn: Callable[..., T], *args: Any) -> Step[T]:
    """A read of the store as a step, so the ledger's drivers perform it as they perform
    their own: on its lanes from the event loop, any error of the store's as
    `LedgerUnavailable`."""
    return (yield _Call(fn, *args))


def _next(candidates: Iterator[Record]) -> list[Record]:
    return list(itertools.islice(candidates, _CHUNK))


# -- what a record says about its reconciliation ------------------------------------------


def unknown_answers(record: Record) -> tuple[int, float]:
    """How many times in a row a sweeper's reconciler answered Unknown for the record's
    current operation, and when it last did (0, 0.0 when it has not)."""
    count, last = 0, 0.0
    for event in reversed(record.history):
        if event.kind != "unknown" or event.token != record.token:
            break
        count += 1
        last = last or event.at
    return count, last


def open_since(record: Record) -> float:
    """When the record's outcome became open: the first of its trailing uncertain events
    (a stale claim: when its lease lapsed), on the store's clock."""
    if record.status is Status.PENDING:
        return record.lease_expires_at or record.updated_at
    since = None
    for event in reversed(record.history):
        if event.kind not in _STILL_OPEN:
            break
        since = event.at
    return since if since is not None else record.updated_at


def arguments(record: Record) -> Any:
    """The call's arguments as its claim recorded them (None when it did not)."""
    call = record.call
    if not call or "args" not in call:
        return None
    return decode(call["args"])
