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
    # Most keys are printable ASCII: no control character, no surrogate, one byte per
    # character, and blank only if every character is a space. Anything else is
    # checked in full below.
    if (
        type(key) is str
        and key.isascii()
        and key.isprintable()
        and 0 < len(key) <= MAX_KEY_BYTES
        and not key.isspace()
    ):
        return key
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
# Values JSON cannot carry become {TYPE_TAG: tag, "v": ...}. A NUL in the key keeps the tag
# apart from any dict a caller passes (one that has this key is itself tagged as a map),
# and every plain JSON value keeps the canonical form (and fingerprint) it always had.
TYPE_TAG = "\x00type"
FINGERPRINT_METHOD = "__idempotency_fingerprint__"


def _tagged(tag: str, value: Any, **extra: Any) -> dict[str, Any]:
    return {TYPE_TAG: tag, **extra, "v": value}


def _canonical(value: Any) -> Any:
    """Reduce `value` to JSON types so that RFC 8785 can serialise it canonically; values of
    different types never share a form (2**60 is not "1152921504606846976")."""
    if value is None or isinstance(value, bool | str):
        return value
    method = getattr(type(value), FINGERPRINT_METHOD, None)
    if method is not None:
        cls = type(value)
        return _tagged(
            "custom", _canonical(method(value)), cls=f"{cls.__module__}.{cls.__qualname__}"
        )
    if isinstance(value, enum.Enum):  # as its value: a schema-validated argument is the member
        return _canonical(value.value)
    if isinstance(value, int):
        # JCS numbers are IEEE doubles; larger integers are kept exact as tagged text.
        return value if -_SAFE_INT <= value <= _SAFE_INT else _tagged("int", str(value))
    if isinstance(value, float):
        return value if math.isfinite(value) else _tagged("float", repr(value))
    if isinstance(value, decimal.Decimal):
        return _tagged("decimal", str(value))
    if isinstance(value, dt.datetime):
        return _tagged("datetime", value.isoformat())
    if isinstance(value, dt.date):
        return _tagged("date", value.isoformat())
    if isinstance(value, dt.time):
        return _tagged("time", value.isoformat())
    if isinstance(value, dt.timedelta):
        return _tagged("timedelta", [value.days, value.seconds, value.microseconds])
    if isinstance(value, uuid.UUID):
        return _tagged("uuid", str(value))
    if isinstance(value, PurePath):
        return _tagged("path", str(value))
    if isinstance(value, bytes | bytearray | memoryview):
        return _tagged("bytes", base64.b64encode(bytes(value)).decode("ascii"))
    if isinstance(value, Mapping):
        if all(type(k) is str and k != TYPE_TAG for k in value):
            return {k: _canonical(v) for k, v in value.items()}
        pairs = [[_canonical(k), _canonical(v)] for k, v in value.items()]
        return _tagged("map", sorted(pairs, key=rfc8785.dumps))
    if isinstance(value, set | frozenset):
        items = [_canonical(v) for v in value]
        return _tagged("set", sorted(items, key=rfc8785.dumps))
    if isinstance(value, list | tuple):  # a tuple is a list: schemas turn one into the other
        return [_canonical(v) for v in value]
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump):  # pydantic v2 model: its fields keep their types
        try:
            return _canonical(model_dump())
        except TypeError:
            return _canonical(model_dump(mode="json"))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _canonical(dataclasses.asdict(value))
    name = type(value).__name__
    raise TypeError(
        f"cannot fingerprint a value of type {name}: {value!r}. Give the tool a "
        f"fingerprint= callable (its arguments -> JSON-able data), or define "
        f"{name}.{FINGERPRINT_METHOD}(self) returning JSON-able data"
    )


def canonical_json(value: Any) -> bytes:
    """RFC 8785 (JCS) bytes of `value`: sorted keys, no insignificant whitespace."""
    return rfc8785.dumps(_canonical(value))


def fingerprint(args: Any) -> str:
    """SHA-256 hex digest of the canonical JSON of `args`."""
    return hashlib.sha256(canonical_json(args)).hexdigest()
