"""The four states a record moves through.

Its own module so that the errors (which classify a failure as one of these) and the
record (which raises an error on a corrupt document) can both import it, each one way.
"""

from __future__ import annotations

import enum


class Status(enum.StrEnum):
    PENDING = "PENDING"  # claimed; the body is running (or its owner died)
    COMMITTED = "COMMITTED"  # done; `result` holds the receipt to replay
    FAILED = "FAILED"  # the body raised before any effect; the next attempt may run
    UNCERTAIN = "UNCERTAIN"  # the effect may or may not have happened; resolve first
