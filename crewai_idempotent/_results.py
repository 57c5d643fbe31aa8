"""Storing a body's return value so that a replay returns an equal value."""

from __future__ import annotations

import importlib
import json
import logging
from typing import Any

import pydantic_core

log = logging.getLogger("crewai_idempotent")

_PLAIN = (str, int, float, bool, type(None))


def encode(value: Any) -> dict[str, Any]:
    """Encode `value` for the ledger. Never raises: the last resort is its str()."""
    if type(value) is str:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return {"t": "escaped", "v": json.dumps(value, ensure_ascii=True)}
        return {"t": "json", "v": value}
    payload = _encode(value)
    try:
        pydantic_core.to_json(payload)
    except pydantic_core.PydanticSerializationError:
        # Lone surrogates (say, from a filename decoded with surrogateescape) are not
        # UTF-8; keep the exact value as ASCII-escaped JSON text inside the payload.
        return {"t": "escaped", "v": json.dumps(value, ensure_ascii=True, default=str)}
    return payload


def _encode(value: Any) -> dict[str, Any]:
    if isinstance(value, _PLAIN):
        return {"t": "json", "v": value}
    try:
        if isinstance(value, dict | list):
            text = json.dumps(value, allow_nan=True)
            if json.loads(text) == value:
                return {"t": "json", "v": value}
        model_dump = getattr(value, "model_dump", None)
        if callable(model_dump):
            cls = type(value)
            return {
                "t": "pydantic",
                "cls": f"{cls.__module__}:{cls.__qualname__}",
                "v": model_dump(mode="json"),
            }
    except Exception:
        log.debug("result of type %s stored as str()", type(value).__name__, exc_info=True)
    try:
        text = str(value)
    except Exception as exc:  # noqa: BLE001
        text = f"<unprintable {type(value).__name__}: {exc!r}>"
    return {"t": "str", "v": text, "type": type(value).__name__}


def decode(payload: Any) -> Any:
    if payload is None:
        return None
    kind = payload.get("t")
    if kind == "escaped":
        return json.loads(payload["v"])
    if kind == "pydantic":
        module, _, qualname = payload["cls"].partition(":")
        try:
            obj: Any = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            return obj.model_validate(payload["v"])
        except Exception:  # noqa: BLE001 - the class is gone; its data is still the receipt
            log.warning("cannot restore %s; replaying its JSON data", payload["cls"])
            return payload["v"]
    return payload["v"]
