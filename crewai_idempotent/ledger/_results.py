"""Storing a body's return value so that a replay returns an equal value of the same type.

A payload is `{"t": kind, "v": ...}`:

- `json`: the value is plain JSON (str keys, finite floats) and is stored as it is;
- `typed`: a tree in which every value JSON cannot carry is a tagged object
  `{"$t": tag, "v": ...}`: tuple, set, frozenset, bytes, bytearray, datetime, date, time,
  timedelta, Decimal, UUID, very large ints, NaN and infinities, dicts with keys that are
  not str (or that contain "$t"), enum members and pydantic models (re-created from their
  import path, and only if that names a pydantic model or an Enum);
- `escaped`, `pydantic`, `str`: written by earlier versions (and `escaped` still for plain
  text with lone surrogates); still read.

Anything else is stored as its `str()` with a warning, once per type: the effect has
happened, so storing the receipt must not fail.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import enum
import importlib
import json
import logging
import math
import threading
import uuid
from typing import Any

import pydantic_core

log = logging.getLogger("crewai_idempotent")

TAG = "$t"
_INT_LIMIT = 2**63  # JSON readers differ above 64 bits: larger ints travel as text
_warned: set[str] = set()
_warned_lock = threading.Lock()


def encode(value: Any) -> dict[str, Any]:
    """Encode `value` for the ledger. Never raises: the last resort is its str()."""
    if type(value) is str:
        if _utf8(value):
            return {"t": "json", "v": value}
        return {"t": "escaped", "v": json.dumps(value, ensure_ascii=True)}
    try:
        encoder = _Encoder()
        tree = encoder.tree(value)
    except Exception:
        log.warning("result of type %s stored as str()", type(value).__name__, exc_info=True)
        return {"t": "str", "v": _text(value), "type": type(value).__name__}
    if not encoder.tagged:
        return {"t": "json", "v": value}
    payload = {"t": "typed", "v": tree}
    try:
        pydantic_core.to_json(payload)
    except pydantic_core.PydanticSerializationError:  # a last guard: keep the receipt
        return {"t": "str", "v": _text(value), "type": type(value).__name__}
    return payload


def _utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _text(value: Any) -> str:
    try:
        return str(value)
    except Exception as exc:  # noqa: BLE001
        return f"<unprintable {type(value).__name__}: {exc!r}>"


def _path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _tag(tag: str, value: Any, **extra: Any) -> dict[str, Any]:
    return {TAG: tag, **extra, "v": value}


class _Encoder:
    def __init__(self) -> None:
        self.tagged = False
        self._active: set[int] = set()

    def tree(self, value: Any) -> Any:
        kind = type(value)
        if kind is str:
            if _utf8(value):
                return value
            return self._tagged("esc", json.dumps(value, ensure_ascii=True))
        if value is None or kind is bool:
            return value
        if kind is int:
            return value if -_INT_LIMIT < value < _INT_LIMIT else self._tagged("int", str(value))
        if kind is float:
            return value if math.isfinite(value) else self._tagged("float", repr(value))
        if kind is list:
            return self._nested(value, lambda: [self.tree(item) for item in value])
        if kind is dict:
            return self._nested(value, lambda: self._dict(value))
        return self._special(value)

    def _tagged(self, tag: str, value: Any, **extra: Any) -> dict[str, Any]:
        self.tagged = True
        return _tag(tag, value, **extra)

    def _nested(self, value: Any, build: Any) -> Any:
        if id(value) in self._active:
            raise ValueError("the result contains itself")
        self._active.add(id(value))
        try:
            return build()
        finally:
            self._active.discard(id(value))

    def _dict(self, value: dict[Any, Any]) -> Any:
        if all(type(k) is str and k != TAG and _utf8(k) for k in value):
            return {k: self.tree(v) for k, v in value.items()}
        return self._tagged("dict", [[self.tree(k), self.tree(v)] for k, v in value.items()])

    def _special(self, value: Any) -> Any:
        if isinstance(value, enum.Enum):
            return self._tagged("enum", self.tree(value.value), cls=_path(type(value)))
        if isinstance(value, pydantic_core.PydanticUndefinedType):
            raise TypeError("PydanticUndefined")
        model_dump = getattr(value, "model_dump", None)
        if callable(model_dump) and hasattr(type(value), "model_validate_json"):
            data = model_dump(mode="json")
            return self._tagged("pydantic", data, cls=_path(type(value)))
        # Subclasses of plain types (an IntEnum is handled above) keep their base value.
        if isinstance(value, bool):
            return bool(value)
        if isinstance(value, int):
            return self.tree(int(value))
        if isinstance(value, float):
            return self.tree(float(value))
        if isinstance(value, str):
            return self.tree(str(value))
        if isinstance(value, tuple):
            return self._nested(value, lambda: self._tagged("tuple", [self.tree(v) for v in value]))
        if isinstance(value, frozenset | set):
            tag = "frozenset" if isinstance(value, frozenset) else "set"
            return self._nested(value, lambda: self._tagged(tag, [self.tree(v) for v in value]))
        if isinstance(value, list):
            return self._nested(value, lambda: [self.tree(item) for item in value])
        if isinstance(value, dict):
            return self._nested(value, lambda: self._dict(dict(value)))
        if isinstance(value, bytes | bytearray | memoryview):
            tag = "bytearray" if isinstance(value, bytearray) else "bytes"
            return self._tagged(tag, base64.b64encode(bytes(value)).decode("ascii"))
        if isinstance(value, dt.datetime):
            return self._tagged("datetime", value.isoformat())
        if isinstance(value, dt.date):
            return self._tagged("date", value.isoformat())
        if isinstance(value, dt.time):
            return self._tagged("time", value.isoformat())
        if isinstance(value, dt.timedelta):
            return self._tagged("timedelta", [value.days, value.seconds, value.microseconds])
        if isinstance(value, decimal.Decimal):
            return self._tagged("decimal", str(value))
        if isinstance(value, uuid.UUID):
            return self._tagged("uuid", str(value))
        name = _path(type(value))
        with _warned_lock:
            first = name not in _warned
            _warned.add(name)
        if first:
            log.warning(
                "a tool returned a %s, which the ledger cannot store as itself; replays "
                "return its str() (return JSON types, a pydantic model or a dataclass "
                "converted with asdict to keep it exact)",
                name,
            )
        return self._tagged("str", _text(value), type=name)


def decode(payload: Any) -> Any:
    if payload is None:
        return None
    kind = payload.get("t")
    if kind == "typed":
        return _decode(payload["v"])
    if kind == "escaped":
        return json.loads(payload["v"])
    if kind == "pydantic":  # written by earlier versions: one model at the top level
        cls = _importable(payload["cls"], "model")
        if cls is None:
            return payload["v"]
        try:
            return cls.model_validate(payload["v"])
        except Exception:  # noqa: BLE001 - the model changed; its data is still the receipt
            log.warning("cannot restore %s; replaying its JSON data", payload["cls"])
            return payload["v"]
    return payload["v"]


def unrestorable(payload: Any) -> list[str]:
    """The classes (module:qualname) a stored payload names that cannot be re-created here:
    decoding would replay their plain data instead."""
    if not isinstance(payload, dict):
        return []
    if payload.get("t") == "pydantic":
        return [] if _quiet_import(payload.get("cls"), "model") else [str(payload.get("cls"))]
    if payload.get("t") != "typed":
        return []
    missing: list[str] = []

    def walk(tree: Any) -> None:
        if isinstance(tree, list):
            for item in tree:
                walk(item)
        elif isinstance(tree, dict):
            tag = tree.get(TAG)
            if tag in ("pydantic", "enum") and not _quiet_import(
                tree.get("cls"), "model" if tag == "pydantic" else "enum"
            ):
                missing.append(str(tree.get("cls")))
            for value in tree.values():
                walk(value)

    walk(payload.get("v"))
    return missing


def describe(payload: Any) -> tuple[str, Any]:
    """For people: what kind of value a stored payload holds, and its stored data (tags
    and all), without importing any class it names."""
    if not isinstance(payload, dict):
        return "?", payload
    kind = payload.get("t")
    if kind == "pydantic":
        what = str(payload.get("cls"))
    elif kind == "str":
        what = f"str() of {payload.get('type')}"
    elif kind == "typed":
        what = "json with tagged types"
    else:
        what = "json"
    return what, payload.get("v")


def _quiet_import(path: Any, what: str) -> bool:
    logger = logging.getLogger("crewai_idempotent")
    previous = logger.disabled
    logger.disabled = True
    try:
        return isinstance(path, str) and _importable(path, what) is not None
    finally:
        logger.disabled = previous


def _importable(path: str, what: str) -> Any:
    """The pydantic model (`what="model"`) or Enum class at `path`, or None (logged)."""
    from pydantic import BaseModel

    module, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:  # noqa: BLE001 - the class is gone; its data is still the receipt
        log.warning("cannot import %s; replaying its stored data", path)
        return None
    base = BaseModel if what == "model" else enum.Enum
    if not (isinstance(obj, type) and issubclass(obj, base)):
        log.warning("%s is not a %s class; replaying its stored data", path, base.__name__)
        return None
    return obj


def _decode(tree: Any) -> Any:
    if isinstance(tree, list):
        return [_decode(item) for item in tree]
    if not isinstance(tree, dict):
        return tree
    tag = tree.get(TAG)
    if tag is None:
        return {k: _decode(v) for k, v in tree.items()}
    value = tree["v"]
    decoder = _DECODERS.get(tag)
    if decoder is not None:
        return decoder(value)
    if tag == "enum":
        cls = _importable(tree["cls"], "enum")
        member = _decode(value)
        if cls is None:
            return member
        try:
            return cls(member)
        except ValueError:
            log.warning("%s has no member %r any more; replaying its value", tree["cls"], member)
            return member
    if tag == "pydantic":
        cls = _importable(tree["cls"], "model")
        if cls is None:
            return value
        try:
            return cls.model_validate_json(json.dumps(value))
        except Exception:  # noqa: BLE001 - the model changed; its data is still the receipt
            log.warning("cannot restore %s; replaying its JSON data", tree["cls"])
            return value
    if tag == "str":
        return value
    raise ValueError(f"unknown result tag {tag!r}: written by a newer crewai-idempotent?")


def _pairs(value: Any) -> dict[Any, Any]:
    return {_decode(k): _decode(v) for k, v in value}


_DECODERS: dict[str, Any] = {
    "esc": json.loads,
    "int": int,
    "float": float,
    "dict": _pairs,
    "tuple": lambda v: tuple(_decode(i) for i in v),
    "set": lambda v: {_decode(i) for i in v},
    "frozenset": lambda v: frozenset(_decode(i) for i in v),
    "bytes": base64.b64decode,
    "bytearray": lambda v: bytearray(base64.b64decode(v)),
    "datetime": dt.datetime.fromisoformat,
    "date": dt.date.fromisoformat,
    "time": dt.time.fromisoformat,
    "timedelta": lambda v: dt.timedelta(days=v[0], seconds=v[1], microseconds=v[2]),
    "decimal": decimal.Decimal,
    "uuid": uuid.UUID,
}
