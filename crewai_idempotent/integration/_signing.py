"""Signed decisions as this process's guard sees them: the trusted keys it checks grants
and resolutions against, and until when it still counts unsigned grants.

Both are the process's, never a crew's: `configure(trusted_keys=...,
accept_unsigned_grants_until=...)`, else `$CREWAI_IDEMPOTENCY_TRUSTED_KEYS` (a file's
path) and `$CREWAI_IDEMPOTENCY_ACCEPT_UNSIGNED_GRANTS_UNTIL`. One ledger object serves
every crew of the process, and a crew that could set weaker keys than the process's
would be a way around them. Bad input is a `SigningConfigurationError` where it is given:
`configure()` reads the environment's file too, a `Crew(...)` reads it when configure()
set none, and otherwise the first guarded call does (it stops the kickoff, as a bad
ledger URL does). Nothing falls back to unsigned.

Without trusted keys anywhere nothing changes: grants and resolutions are obeyed as
written (docs/security.md says what that leaves open).
"""

from __future__ import annotations

import datetime as dt
import math
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .. import signing
from .._errors import SigningConfigurationError
from ..ledger._ledger import Ledger

TRUSTED_KEYS_ENV = "CREWAI_IDEMPOTENCY_TRUSTED_KEYS"  # signing.ENV, without loading it
UNSIGNED_UNTIL_ENV = "CREWAI_IDEMPOTENCY_ACCEPT_UNSIGNED_GRANTS_UNTIL"
_LEDGER_ATTRIBUTE = "trusted_keys"  # Ledger's: the keys a resolution must be signed with

_lock = threading.Lock()
_from_env: dict[str, signing.TrustedKeys] = {}  # by the variable's value: read once


@dataclass(frozen=True, slots=True)
class Signing:
    """The signing settings in force: `trusted_keys`, where they came from (`source`),
    and until when unsigned grants still count (`accept_unsigned_grants_until`, seconds
    since the epoch, or None)."""

    trusted_keys: signing.TrustedKeys
    source: str
    accept_unsigned_grants_until: float | None = None


def load_trusted(value: Any, where: str) -> signing.TrustedKeys | None:
    """The trusted keys `value` names (None: none given): a file's path, lines, or
    `TrustedKeys`, read and checked now. Raises `SigningConfigurationError` for a file
    or line that does not pass (prefixed by `where`), `TypeError` for another type."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray) or not isinstance(
        value, str | os.PathLike | Iterable | signing.TrustedKeys
    ):
        raise TypeError(
            f"{where}: trusted_keys is a file's path, a list of lines or signing.TrustedKeys, "
            f"not {type(value).__name__}"
        )
    if isinstance(value, str) and not value.strip():
        raise SigningConfigurationError(
            f"{where}: trusted_keys is blank; name the trusted keys file (leave the setting "
            "out for unsigned decisions)"
        )
    try:
        return signing.TrustedKeys.load(value)
    except SigningConfigurationError as exc:
        raise SigningConfigurationError(f"{where}: {exc}") from None


def parse_until(value: Any, where: str) -> float | None:
    """`accept_unsigned_grants_until` as seconds since the epoch: a number, an aware
    `datetime`, or ISO 8601 text with its offset (`2026-12-31T18:00:00+00:00`). Raises
    `SigningConfigurationError` for anything else (a naive time is ambiguous)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value.strip())
        except ValueError:
            raise SigningConfigurationError(
                f"{where}: {value!r} is not an ISO 8601 time such as 2026-12-31T18:00:00+00:00"
            ) from None
    if isinstance(value, dt.datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise SigningConfigurationError(
                f"{where}: {value.isoformat()} has no UTC offset; give one "
                "(+00:00), as workers in other zones would read it otherwise"
            )
        return value.timestamp()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SigningConfigurationError(
            f"{where}: accept_unsigned_grants_until is a time (an aware datetime, ISO 8601 "
            f"text, or seconds since the epoch), not {value!r}"
        )
    return float(value)


def env_marks() -> tuple[str, str]:
    """What the environment says, as read now: a settled resolution is redone when it
    changes. Raises nothing."""
    env = os.environ
    return env.get(TRUSTED_KEYS_ENV, "").strip(), env.get(UNSIGNED_UNTIL_ENV, "").strip()


def in_force(trusted_keys: signing.TrustedKeys | None, until: float | None) -> Signing | None:
    """The settings in force: `trusted_keys` and `until` as configure() set them, else
    the environment's (its file read once per value, then again when it changes). None:
    decisions are unsigned. Raises `SigningConfigurationError` for an environment that
    names a file that does not pass or a malformed time, and for a time to accept
    unsigned grants until with no trusted keys at all."""
    path, until_text = env_marks()
    if until is None and until_text:
        until = parse_until(until_text, f"${UNSIGNED_UNTIL_ENV}")
    if trusted_keys is not None:
        return Signing(trusted_keys, "configure()", until)
    if path:
        with _lock:
            trusted = _from_env.get(path)
        if trusted is None:
            try:
                trusted = signing.TrustedKeys.from_file(path)
            except SigningConfigurationError as exc:
                raise SigningConfigurationError(f"${TRUSTED_KEYS_ENV}: {exc}") from None
            with _lock:
                trusted = _from_env.setdefault(path, trusted)
        return Signing(trusted, f"${TRUSTED_KEYS_ENV} ({trusted.path})", until)
    if until is not None:
        raise SigningConfigurationError(
            "accept_unsigned_grants_until is set, but no trusted keys are: without them "
            f"every decision is unsigned (configure(trusted_keys=...) or ${TRUSTED_KEYS_ENV})"
        )
    return None


def apply(ledger: Ledger, settings: Signing | None) -> None:
    """Make `ledger` obey only resolutions signed by the trusted keys in force (or, with
    none, every resolution as written). Raises nothing."""
    wanted = None if settings is None else settings.trusted_keys
    if getattr(ledger, _LEDGER_ATTRIBUTE, None) is not wanted:
        # A settable attribute of Ledger's; set so in releases that check resolutions.
        setattr(ledger, _LEDGER_ATTRIBUTE, wanted)


def forget() -> None:
    """Read the environment's trusted keys file afresh at the next use (tests). Raises
    nothing."""
    with _lock:
        _from_env.clear()
