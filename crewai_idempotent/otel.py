"""OpenTelemetry for guarded calls (the `otel` extra): see docs/observability.md.

A configured global SDK is picked up by itself; these functions are for providers of
your own, the raw-key switch, and the gauge of open UNCERTAIN records.
"""

from ._otel import OUTCOMES, instrument, stop_watching, uninstrument, watch_uncertain

__all__ = ["OUTCOMES", "instrument", "stop_watching", "uninstrument", "watch_uncertain"]
