"""Idempotency key rules and argument fingerprints."""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import decimal
import enum
import hashlib
import json
import json.encoder
import math
import re
import uuid
from collections.abc import Callable, Mapping
from pathlib import PurePath
from typing import Any

import rfc8785

from .._errors import InvalidIdempotencyKey

MAX_KEY_BYTES = 512
_FORBIDDEN = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")


def validate_key(key: object) -> str:
    """Return `key` if it is a usable idempotency key: a non-blank str of at most 512 UTF-8
    bytes without control characters. Raises `InvalidIdempotencyKey` otherwise."""
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
        f"cannot fingerprint a value of type {name}: {value!r} has no canonical JSON form "
        f"(a tool's fingerprint= callable, its arguments -> JSON-able data, or a "
        f"{name}.{FINGERPRINT_METHOD}(self) method returning JSON-able data gives one)"
    )


def canonical_json(value: Any) -> bytes:
    """RFC 8785 (JCS) bytes of `value`: sorted keys, no insignificant whitespace."""
    try:
        plain = _plain(value)
    except (_NotPlain, RecursionError):
        return rfc8785.dumps(_canonical(value))
    try:
        return _json(plain).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: the slow path raises what it always did
        return rfc8785.dumps(_canonical(value))


def fingerprint(args: Any) -> str:
    """SHA-256 hex digest of the canonical JSON of `args` (RFC 8785; Decimal, datetime,
    bytes, sets, enums and pydantic models by type-aware rules, a type's own
    `__idempotency_fingerprint__()` where it has one). Raises `TypeError` for a value with
    no canonical form."""
    return hashlib.sha256(canonical_json(args)).hexdigest()


# -- the fast path: plain JSON through the C encoder -----------------------------------
#
# For plain JSON values (exact str, int, float, bool, None, list, tuple and dict with str
# keys) Python's own encoder, with sorted keys, no spaces and no ASCII escaping, writes
# the same bytes as RFC 8785 once two differences are ruled out: JCS sorts keys by UTF-16
# code units (the same order as code points while no key holds a character beyond the
# BMP) and writes numbers as ECMAScript does. An integral float below 2**53 is written
# as that integer (so it goes to the encoder as one), and a float with a fraction is
# written as `repr` writes it while it is at least 1e-4 (`repr` turns to an exponent
# below that, ECMAScript below 1e-6); anything else takes the slow path, which stays the
# definition (tests/core/test_fingerprint_types.py proves the two equal over JSON values).


def _encoder() -> Callable[[Any], str]:
    """Plain JSON, sorted keys, no spaces, no ASCII escaping. The C encoder, made once (the
    stdlib's `JSONEncoder.encode` builds one per call, which costs more than encoding)."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # no C accelerator (PyPy): the same bytes, slower
        slow = json.JSONEncoder(
            ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":")
        )
        return slow.encode

    def unsupported(value: Any) -> Any:
        raise TypeError(f"not plain JSON: {type(value).__name__}")

    encode = make(
        None, unsupported, json.encoder.encode_basestring, None, ":", ",", True, False, False
    )
    return lambda value: "".join(encode(value, 0))


_json = _encoder()
_BMP_END = "\U00010000"


class _NotPlain(Exception):
    """The value needs the slow path."""


def _plain(value: Any) -> Any:
    """`value` as the C encoder must see it to write its RFC 8785 form, else _NotPlain.
    The value itself when nothing needs changing (the common case: no copy is made)."""
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return value
    if kind is int:
        if -_SAFE_INT <= value <= _SAFE_INT:
            return value
        raise _NotPlain
    if kind is float:
        if value.is_integer():
            if -_SAFE_INT <= value <= _SAFE_INT:
                return int(value)  # 1.0 and -0.0 are "1" and "0" in JCS
        elif 1e-4 <= abs(value) < 1e16:
            return value
        raise _NotPlain  # tiny, huge, NaN or infinite
    if kind is dict:
        changed: dict[str, Any] | None = None
        for key, item in value.items():
            if type(key) is not str or key == TYPE_TAG:
                raise _NotPlain
            if not key.isascii() and max(key) >= _BMP_END:
                raise _NotPlain
            kind = type(item)
            if kind is str or kind is bool or item is None:
                continue
            if kind is int and -_SAFE_INT <= item <= _SAFE_INT:
                continue
            plain = _plain(item)
            if plain is not item and changed is None:
                changed = dict(value)
            if changed is not None:
                changed[key] = plain
        return value if changed is None else changed
    if kind is list or kind is tuple:
        items = [_plain(item) for item in value]
        if kind is list and all(new is old for new, old in zip(items, value, strict=True)):
            return value
        return items
    raise _NotPlain
