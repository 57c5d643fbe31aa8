"""OpenTelemetry for guarded calls: a span per call, counters, latency histograms and a
gauge of open UNCERTAIN records (the `otel` extra; see docs/observability.md).

Switched on when an OpenTelemetry SDK is configured: the global tracer or meter provider
is an SDK one (not the API's no-op proxy, not crewai's own telemetry provider), or
`instrument()` was given providers. `CREWAI_IDEMPOTENT_OTEL=0` switches it off. While
off, a guarded call pays one dictionary lookup: opentelemetry is not even imported.

Spans are named `idempotency.<outcome>` (claim, replay, conflict, uncertain, approval)
and are children of whatever span is current where the tool runs (crewai's tool span
when a tracing integration opened one). The raw key is never an attribute unless
`instrument(record_keys=True)` or `CREWAI_IDEMPOTENT_OTEL_KEYS=1` (the environment is
read when a global provider is first seen): keys often hold
customer or invoice ids; `idempotency.key_hash` (SHA-256, 16 hex digits) correlates
calls without them.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ._errors import (
    ApprovalDenied,
    ApprovalRequired,
    BodyFailed,
    IdempotencyKeyConflict,
    OperationInProgress,
    OutcomeUncertain,
    SpendCapExceeded,
)
from .ledger._record import Record, Status
from .ledger._select import Select

if TYPE_CHECKING:
    from .ledger._ledger import Ledger

SCOPE = "crewai_idempotent"
OUTCOMES = ("claim", "replay", "conflict", "uncertain", "approval")
_CREWAI_TELEMETRY_SERVICE = "crewAI-telemetry"


def _switched_off() -> bool:
    value = os.environ.get("CREWAI_IDEMPOTENT_OTEL", "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return True
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def _raw_keys_from_env() -> bool:
    return os.environ.get("CREWAI_IDEMPOTENT_OTEL_KEYS", "").strip().lower() in ("1", "true")


def backend_label(backend: Any) -> str:
    """ "sqlite", "postgres", "redis", "filelock", "memory", or the class name."""
    name = type(backend).__name__
    short = name.removesuffix("CacheBackend").lower()
    return short or name


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class _Instruments:
    """The tracer and the metric instruments of one pair of providers."""

    def __init__(self, tracer_provider: Any, meter_provider: Any, record_keys: bool) -> None:
        self.record_keys = record_keys
        self.tracer = tracer_provider.get_tracer(SCOPE) if tracer_provider is not None else None
        self.meter = meter_provider.get_meter(SCOPE) if meter_provider is not None else None
        meter = self.meter
        if meter is None:
            self.counters: dict[str, Any] = {}
            self.claim_latency = self.commit_latency = None
            return
        self.counters = {
            "claim": meter.create_counter(
                "idempotency.claims", unit="{call}", description="Keys claimed: the body ran"
            ),
            "replay": meter.create_counter(
                "idempotency.replays", unit="{call}", description="Stored results returned"
            ),
            "conflict": meter.create_counter(
                "idempotency.conflicts",
                unit="{call}",
                description="Calls refused: other arguments, or the key is held elsewhere",
            ),
            "uncertain": meter.create_counter(
                "idempotency.uncertain",
                unit="{call}",
                description="Calls whose effect may or may not have happened",
            ),
            "ledger_error": meter.create_counter(
                "idempotency.ledger_errors",
                unit="{call}",
                description="Calls the ledger could not serve (nothing was run)",
            ),
        }
        self.claim_latency = meter.create_histogram(
            "idempotency.claim.duration", unit="s", description="From the call to its claim"
        )
        self.commit_latency = meter.create_histogram(
            "idempotency.commit.duration",
            unit="s",
            description="From the body's return to its receipt being stored",
        )
        meter.create_observable_gauge(
            "idempotency.uncertain.open",
            callbacks=[_uncertain_watch.observe],
            unit="{record}",
            description="UNCERTAIN records waiting for a decision (watch_uncertain)",
        )


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.explicit: _Instruments | None = None
        self.global_key: tuple[Any, Any] | None = None
        self.global_instruments: _Instruments | None = None
        self.api: tuple[Any, Any] | None = None
        # A cheaper way to tell that `api` would return the API's proxies (see _unset_check).
        self.unset: tuple[Any, Callable[[], bool] | None] | None = None


_state = _State()


def instrument(
    tracer_provider: Any = None, meter_provider: Any = None, *, record_keys: bool = False
) -> None:
    """Use these providers (instead of the global ones) for the guard's spans and metrics.
    `record_keys=True` adds the raw idempotency key to spans."""
    with _state.lock:
        _state.explicit = _Instruments(tracer_provider, meter_provider, record_keys)


def uninstrument() -> None:
    """Back to the global providers (and off if none is configured)."""
    with _state.lock:
        _state.explicit = None
        _state.global_key = None
        _state.global_instruments = None


def _configured(provider: Any) -> bool:
    if provider is None or type(provider).__name__.lstrip("_").startswith(("Proxy", "NoOp")):
        return False
    resource = getattr(provider, "resource", None) or getattr(provider, "_resource", None)
    attributes = getattr(resource, "attributes", None) or {}
    # crewai's anonymous usage telemetry sets its own provider globally (up to 1.15.x on
    # some paths); the user's spans do not belong there.
    return attributes.get("service.name") != _CREWAI_TELEMETRY_SERVICE


def _instruments() -> _Instruments | None:
    explicit = _state.explicit
    if explicit is not None:
        return explicit
    api = _state.api
    if api is None:
        if sys.modules.get("opentelemetry") is None:
            return None  # nothing in this process uses OpenTelemetry: nothing to configure
        try:
            from opentelemetry import metrics, trace
        except ImportError:
            return None
        _state.api = api = (trace.get_tracer_provider, metrics.get_meter_provider)
        _state.unset = (api, _unset_check(trace, metrics))
    unset = _state.unset
    if unset is not None and unset[0] is api and unset[1] is not None and unset[1]():
        return None  # no global provider yet: the API's proxies, never configured
    key = (api[0](), api[1]())
    if key == _state.global_key:
        return _state.global_instruments  # decided when these providers were first seen
    instruments = None
    if not _switched_off():
        tracer_provider, meter_provider = (p if _configured(p) else None for p in key)
        if tracer_provider is not None or meter_provider is not None:
            instruments = _Instruments(tracer_provider, meter_provider, _raw_keys_from_env())
    with _state.lock:
        _state.global_key, _state.global_instruments = key, instruments
    return instruments


def _unset_check(trace: Any, metrics: Any) -> Callable[[], bool] | None:
    """A check that no global provider is set, without the API's getters: while none is,
    each getter looks in the environment for a provider to load, on every guarded call.
    None (use the getters) where the API keeps its globals elsewhere, or where the
    environment names a provider to load."""
    internal = sys.modules.get("opentelemetry.metrics._internal")
    if (
        not hasattr(trace, "_TRACER_PROVIDER")
        or internal is None
        or not hasattr(internal, "_METER_PROVIDER")
        or "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
        or "OTEL_PYTHON_METER_PROVIDER" in os.environ
    ):
        return None
    return lambda: trace._TRACER_PROVIDER is None and internal._METER_PROVIDER is None


# -- one guarded call ------------------------------------------------------------------


class Observer:
    """The hooks a guarded call reports to; this one, used while OpenTelemetry is off,
    does nothing."""

    __slots__ = ()

    def claimed(self) -> None:
        pass

    def returned(self) -> None:
        pass

    def finish(
        self, outcome: str, record: Record | None = None, error: BaseException | None = None
    ) -> None:
        pass

    def ledger_error(self, error: BaseException) -> None:
        pass


NOTHING = Observer()


class Observation(Observer):
    """The span and timings of one guarded call."""

    __slots__ = (
        "attrs", "backend", "context_token", "instruments", "span", "started", "t_claimed",
        "t_returned",
    )  # fmt: skip

    def __init__(
        self, instruments: _Instruments, tool: str, key: str, backend: str, attempt: int | None
    ) -> None:
        self.instruments = instruments
        self.backend = backend
        self.started = time.monotonic()
        self.t_claimed: float | None = None
        self.t_returned: float | None = None
        self.context_token: Any = None
        self.attrs: dict[str, Any] = {
            "idempotency.tool": tool,
            "idempotency.key_hash": key_hash(key),
            "idempotency.backend": backend,
        }
        if instruments.record_keys:
            self.attrs["idempotency.key"] = key
        self.span = None
        if instruments.tracer is not None:
            # Started now, so that its duration covers the claim and any wait; a child of
            # the current span (crewai's tool span under a tracing integration).
            self.span = instruments.tracer.start_span("idempotency", attributes=self.attrs)

    def claimed(self) -> None:
        """The body starts: spans it opens are children of this call's span."""
        self.t_claimed = time.monotonic()
        if self.span is not None:
            from opentelemetry import context, trace

            self.context_token = context.attach(trace.set_span_in_context(self.span))

    def returned(self) -> None:
        """The body returned or raised (called in the body's own context)."""
        self.t_returned = time.monotonic()
        if self.context_token is not None:
            from opentelemetry import context

            context.detach(self.context_token)
            self.context_token = None

    def finish(
        self, outcome: str, record: Record | None = None, error: BaseException | None = None
    ) -> None:
        now = time.monotonic()
        metric_attrs = {"idempotency.tool": self.attrs["idempotency.tool"], "backend": self.backend}
        instruments = self.instruments
        counter = instruments.counters.get(outcome)
        if counter is not None:
            counter.add(1, metric_attrs)
        if self.t_claimed is not None and instruments.claim_latency is not None:
            waited = self.t_claimed - self.started
            instruments.claim_latency.record(waited, {"backend": self.backend})
        if error is None and self.t_returned is not None and instruments.commit_latency is not None:
            instruments.commit_latency.record(now - self.t_returned, {"backend": self.backend})
        span = self.span
        if span is None:
            return
        waited = (self.t_claimed if self.t_claimed is not None else now) - self.started
        attrs: dict[str, Any] = {"idempotency.outcome": outcome, "idempotency.wait_s": waited}
        if record is not None:
            attrs["idempotency.status"] = record.status.value
            attrs["idempotency.fencing_token"] = record.token
            attrs["idempotency.attempt"] = record.attempts
        span.update_name(f"idempotency.{outcome}")
        span.set_attributes(attrs)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:500]))
        span.end()

    def ledger_error(self, error: BaseException) -> None:
        counter = self.instruments.counters.get("ledger_error")
        if counter is not None:
            tool = self.attrs["idempotency.tool"]
            counter.add(1, {"idempotency.tool": tool, "backend": self.backend})
        self.finish("claim", None, error)


def observe(tool: str, key: str, backend: Any) -> Observer:
    """Start observing one guarded call (a no-op object when OpenTelemetry is off)."""
    instruments = _instruments()
    if instruments is None:
        return NOTHING
    return Observation(instruments, tool, key, backend_label(backend), None)


def outcome_of(error: BaseException) -> str:
    """The span outcome of a call that raised `error`."""
    cause = error.__cause__ if isinstance(error, BodyFailed) else error
    declared = getattr(cause, "idempotency_outcome", None)
    if declared in OUTCOMES:
        return str(declared)
    if isinstance(cause, ApprovalRequired | ApprovalDenied | SpendCapExceeded):
        return "approval"  # a gate stopped the call before its body
    if isinstance(error, IdempotencyKeyConflict | OperationInProgress):
        return "conflict"
    if isinstance(error, OutcomeUncertain):
        return "uncertain"
    return "claim"


# -- open UNCERTAIN records ------------------------------------------------------------


class _UncertainWatch:
    """Counts UNCERTAIN records in the ledgers given to `watch_uncertain`, every
    `interval_s` on a daemon thread; the gauge reports the last counts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ledgers: weakref.WeakSet[Ledger] = weakref.WeakSet()
        self.counts: dict[str, int] = {}
        self.thread: threading.Thread | None = None
        self.stop_event = threading.Event()
        self.interval_s = 60.0

    def count_now(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for ledger in list(self.ledgers):
            label = backend_label(ledger.backend)
            try:
                # From the store's index of the status: the gauge reads what it counts.
                found = sum(1 for _ in ledger.select(Select(status=Status.UNCERTAIN)))
            except Exception:  # noqa: BLE001 - a ledger that does not answer keeps its last count
                continue
            counts[label] = counts.get(label, 0) + found
        with self.lock:
            self.counts = counts
        return counts

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.count_now()
            self.stop_event.wait(self.interval_s)

    def observe(self, options: Any = None) -> Iterable[Any]:
        from opentelemetry.metrics import Observation as Point

        with self.lock:
            counts = dict(self.counts)
        return [Point(n, {"backend": label}) for label, n in counts.items()]


_uncertain_watch = _UncertainWatch()


def watch_uncertain(ledger: Ledger, *, interval_s: float = 60.0) -> None:
    """Report `ledger`'s open UNCERTAIN records as the `idempotency.uncertain.open` gauge,
    counted every `interval_s` seconds on a background thread (reading the UNCERTAIN
    records from the store's index of them, not the ledger)."""
    if interval_s <= 0:
        raise ValueError(f"interval_s must be more than 0 seconds, not {interval_s!r}")
    watch = _uncertain_watch
    with watch.lock:
        watch.ledgers.add(ledger)
        watch.interval_s = interval_s
        start = watch.thread is None or not watch.thread.is_alive()
        if start:
            watch.stop_event.clear()
            watch.thread = threading.Thread(
                target=watch.run, name="crewai-idempotent-uncertain-gauge", daemon=True
            )
    if start:
        assert watch.thread is not None
        watch.thread.start()
    else:
        watch.count_now()


def report_uncertain(backend: Any, count: int) -> None:
    """Set the gauge's count for `backend` (a sweeper counts the open UNCERTAIN records on
    every pass, so the gauge needs no background count of its own where one runs)."""
    watch = _uncertain_watch
    with watch.lock:
        watch.counts = {**watch.counts, backend_label(backend): count}


def stop_watching() -> None:
    """Stop the background count (the gauge keeps its last values)."""
    watch = _uncertain_watch
    watch.stop_event.set()
    thread = watch.thread
    if thread is not None:
        thread.join(timeout=5)
    with watch.lock:
        watch.thread = None
        watch.ledgers = weakref.WeakSet()
