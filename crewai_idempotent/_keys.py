"""Idempotency key rules and argument fingerprints."""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import decimal
import enum
import hashlib
import math
import re
import uuid
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

import rfc8785

from ._errors import InvalidIdempotencyKey

MAX_KEY_BYTES = 512
_FORBIDDEN = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")


def validate_key(key: object) -> str:
    """Return `key` if it is a usable idempotency key, else raise InvalidIdempotencyKey."""
    if not isinstance(key, str):
        raise InvalidIdempotencyKey(f"idempotency key must be a str, not {type(key).__name__}")
    if not key.strip():
        raise InvalidIdempotencyKey("idempotency key is empty or blank")
    size = len(key.encode("utf-8", "surrogatepass"))
    if size > MAX_KEY_BYTES:
        raise InvalidIdempotencyKey(
            f"idempotency key is {size} UTF-8 bytes; the limit is {MAX_KEY_BYTES}: {key[:40]!r}..."
        )
    bad = _FORBIDDEN.search(key)
    if bad is not None:
        ch, i = bad.group(), bad.start()
        what = "a lone surrogate" if ch >= "\ud800" else "control character"
        raise InvalidIdempotencyKey(
            f"idempotency key contains {what} U+{ord(ch):04X} at index {i}: {key!r}"
        )
    return key


_SAFE_INT = 2**53 - 1


def _canonical(value: Any) -> Any:
    """Reduce `value` to JSON types so that RFC 8785 can serialise it canonically."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        # JCS numbers are IEEE doubles; larger integers are kept exact as strings.
        return value if -_SAFE_INT <= value <= _SAFE_INT else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if isinstance(value, uuid.UUID | PurePath):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        items = [_canonical(v) for v in value]
        return sorted(items, key=rfc8785.dumps)
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump):  # pydantic v2 model
        return _canonical(model_dump(mode="json"))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _canonical(dataclasses.asdict(value))
    raise TypeError(f"cannot fingerprint a value of type {type(value).__name__}: {value!r}")


def canonical_json(value: Any) -> bytes:
    """RFC 8785 (JCS) bytes of `value`: sorted keys, no insignificant whitespace."""
    return rfc8785.dumps(_canonical(value))


def fingerprint(args: Any) -> str:
    """SHA-256 hex digest of the canonical JSON of `args`."""
    return hashlib.sha256(canonical_json(args)).hexdigest()
