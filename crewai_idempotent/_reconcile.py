"""What a reconciler answers when asked whether an operation happened."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


Verdict = Found | Absent | Unknown
