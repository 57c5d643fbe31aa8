"""OpenTelemetry for deliveries: a span per try, counters of tries by outcome, the time a
try took, and a gauge of the entries not yet delivered (the `otel` extra).

On when the guard's telemetry is (`_otel`: a configured SDK, or `instrument()`), off
otherwise, when a try pays one function call. Spans are `notification.deliver` with
`notification.type`, `notification.channel`, `notification.id` (the delivery id, an
entry's random or digest id, never a key), `notification.attempt`, and the outcome
(`delivered` or `failed`, the HTTP status and the error of a failed one).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from .. import _otel

if TYPE_CHECKING:
    from ._message import Message


class Watched(Protocol):
    """What the gauge reads of a dispatcher (`_dispatch.Dispatcher`, which imports this
    module: naming it here would be an import circle)."""

    name: str
    backend: Any

    @property
    def last(self) -> Any: ...


class _Nothing:
    def done(self, try_: dict[str, Any]) -> None:
        pass


_NOTHING = _Nothing()
_lock = threading.Lock()
_instruments: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_dispatchers: weakref.WeakSet[Any] = weakref.WeakSet()


def watch(dispatcher: Watched) -> None:
    """Count `dispatcher`'s undelivered entries in the gauge (as of its last pass)."""
    _dispatchers.add(dispatcher)


def _made(base: Any) -> dict[str, Any]:
    with _lock:
        made = _instruments.get(base)
        if made is not None:
            return made
        made = {}
        meter = base.meter
        if meter is not None:
            made["tries"] = meter.create_counter(
                "notifications.tries", unit="{try}",
                description="Delivery tries of outbox entries, by outcome",
            )  # fmt: skip
            made["duration"] = meter.create_histogram(
                "notifications.try.duration", unit="s", description="How long a try took"
            )
            meter.create_observable_gauge(
                "notifications.pending", callbacks=[_pending], unit="{entry}",
                description="Outbox entries not yet delivered to every channel (last pass)",
            )  # fmt: skip
        _instruments[base] = made
        return made


def _pending(options: Any = None) -> Iterable[Any]:
    from opentelemetry.metrics import Observation

    return [
        Observation(
            d.last.pending, {"dispatcher": d.name, "backend": _otel.backend_label(d.backend)}
        )
        for d in list(_dispatchers)
    ]


class _Try:
    def __init__(self, base: Any, made: dict[str, Any], channel: str, message: Message, n: int):
        self.made, self.channel, self.type = made, channel, message.type
        self.span = None
        if base.tracer is not None:
            self.span = base.tracer.start_span(
                "notification.deliver",
                attributes={
                    "notification.type": message.type, "notification.channel": channel,
                    "notification.id": message.id, "notification.attempt": n,
                },
            )  # fmt: skip

    def done(self, try_: dict[str, Any]) -> None:
        outcome = "delivered" if try_["ok"] else "failed"
        attrs = {"notification.channel": self.channel, "notification.type": self.type,
                 "outcome": outcome}  # fmt: skip
        if "tries" in self.made:
            self.made["tries"].add(1, attrs)
            self.made["duration"].record(try_.get("took_s") or 0.0, attrs)
        span = self.span
        if span is None:
            return
        span.set_attribute("notification.outcome", outcome)
        if try_.get("status") is not None:
            span.set_attribute("http.response.status_code", try_["status"])
        if not try_["ok"]:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, str(try_.get("error"))[:500]))
        span.end()


@contextlib.contextmanager
def attempt(channel: str, message: Message, n: int) -> Iterator[Any]:
    """Observe one try (`done(try_)` with its outcome); a no-op while telemetry is off."""
    base = _otel._instruments()
    if base is None:
        yield _NOTHING
        return
    yield _Try(base, _made(base), channel, message, n)
