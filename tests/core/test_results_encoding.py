"""A replay returns what the body returned, of the same type, through a real ledger."""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import json
import logging
import math
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from crewai_idempotent import Ledger, Record, SQLiteCacheBackend
from crewai_idempotent.ledger._results import decode, encode


class Color(enum.Enum):
    RED = "red"


class Line(BaseModel):
    sku: str
    qty: int
    dims: tuple[int, int] = (1, 1)
    when: dt.datetime = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


class Receipt(BaseModel):
    id: str
    lines: list[Line]
    total: decimal.Decimal


VALUES: list[Any] = [
    (1, "a", None),
    {1, 2, 3},
    frozenset({"x"}),
    b"\x00\xffbinary",
    bytearray(b"ab"),
    dt.datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=dt.timezone(dt.timedelta(hours=2))),
    dt.datetime(2026, 11, 30, 12, 0),
    dt.date(2026, 11, 30),
    dt.time(23, 59, 1),
    dt.timedelta(days=-1, seconds=5, microseconds=7),
    decimal.Decimal("10.50"),
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    {1: "a", "1": "b", (2, 3): "tuple key", None: 0},
    {"$t": "tuple", "v": [1]},  # a plain dict that looks like a tag
    {"amount": math.inf, "fee": -math.inf},
    2**70,
    -(2**64),
    [Line(sku="a", qty=1), Line(sku="b", qty=2, dims=(3, 4))],
    {"receipt": Receipt(id="r1", lines=[Line(sku="a", qty=1)], total=decimal.Decimal("9.99"))},
    Color.RED,
    {"nested": [{"deep": ({1, 2}, b"x")}]},
    "lone \udcff surrogate",
    ("lone \udcff surrogate in a tuple",),
]


@pytest.fixture
def ledger(tmp_path: Path) -> Any:
    opened = Ledger(SQLiteCacheBackend(tmp_path / "ledger.db"))
    yield opened
    opened.close()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_a_replay_returns_the_same_value_and_type(ledger: Ledger, value: Any) -> None:
    calls = []

    def body() -> Any:
        calls.append(1)
        return value

    first = ledger.run("k", body)
    # A fresh process reads the record from the file: go through the stored JSON.
    with SQLiteCacheBackend(ledger.backend.path) as again:  # type: ignore[attr-defined]
        replayed = Ledger(again).run("k", body)
    assert len(calls) == 1
    assert first is value
    assert _same(replayed, value), (replayed, value)


def test_nan_survives_inside_a_dict(ledger: Ledger) -> None:
    ledger.run("nan", lambda: {"rate": math.nan})
    replayed = ledger.run("nan", lambda: pytest.fail("ran twice"))
    assert math.isnan(replayed["rate"])


def test_an_unknown_type_is_stored_as_text_with_one_warning(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    class Opaque:
        def __str__(self) -> str:
            return "opaque receipt 42"

    with caplog.at_level(logging.WARNING, logger="crewai_idempotent"):
        assert isinstance(ledger.run("a", Opaque), Opaque)  # the caller gets the real value
        ledger.run("b", Opaque)
        ledger.run("c", lambda: [Opaque()])
    warnings = [r for r in caplog.records if "Opaque" in r.getMessage()]
    assert len(warnings) == 1
    assert ledger.run("a", lambda: pytest.fail("ran twice")) == "opaque receipt 42"
    assert ledger.run("c", lambda: pytest.fail("ran twice")) == ["opaque receipt 42"]


def test_only_pydantic_models_and_enums_are_recreated_by_import_path() -> None:
    forged = {
        "t": "typed",
        "v": {"$t": "pydantic", "cls": "subprocess:Popen", "v": {"args": ["true"]}},
    }
    assert decode(forged) == {"args": ["true"]}
    forged_enum = {"t": "typed", "v": {"$t": "enum", "cls": "os:system", "v": "true"}}
    assert decode(forged_enum) == "true"
    missing = {"t": "typed", "v": {"$t": "pydantic", "cls": "no.such.module:M", "v": {"a": 1}}}
    assert decode(missing) == {"a": 1}


def test_records_written_by_earlier_versions_still_read() -> None:
    assert decode({"t": "json", "v": {"a": [1, 2]}}) == {"a": [1, 2]}
    assert decode({"t": "escaped", "v": json.dumps("x\udcff", ensure_ascii=True)}) == "x\udcff"
    assert decode({"t": "str", "v": "(1, 2)", "type": "tuple"}) == "(1, 2)"
    old_model = {"t": "pydantic", "cls": f"{__name__}:Line", "v": {"sku": "a", "qty": 1}}
    assert decode(old_model) == Line(sku="a", qty=1)
    assert decode(None) is None


def test_plain_json_is_stored_as_before() -> None:
    value = {"id": "ch_1", "amount": 1999, "tags": ["a"], "ok": True, "fee": 0.5, "x": None}
    assert encode(value) == {"t": "json", "v": value}
    assert encode("ch_1") == {"t": "json", "v": "ch_1"}


def test_a_record_round_trips_through_its_json(ledger: Ledger) -> None:
    ledger.run("r", lambda: (dt.date(2026, 1, 1), {b"k": {1.5}}))
    record = ledger.get("r")
    assert record is not None
    again = Record.from_json(record.to_json())
    assert again.value() == (dt.date(2026, 1, 1), {b"k": {1.5}})
