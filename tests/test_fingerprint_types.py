"""Fingerprints tell values of different types apart, and keep plain JSON as it was."""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import hashlib
import uuid
from pathlib import PurePosixPath
from typing import Any

import pytest
import rfc8785
from hypothesis import given
from hypothesis import strategies as st

from crewai_idempotent import fingerprint

PAIRS = [
    (2**60, "1152921504606846976"),
    (2**60, 2**60 + 1),
    (b"payload", base64.b64encode(b"payload").decode()),
    (dt.datetime(2026, 1, 1, 12), "2026-01-01T12:00:00"),
    (dt.date(2026, 1, 1), "2026-01-01"),
    (dt.time(12, 0), "12:00:00"),
    (dt.timedelta(seconds=1), 1),
    (dt.timedelta(seconds=1), 1.0),
    (decimal.Decimal("1.5"), "1.5"),
    (decimal.Decimal("1.5"), 1.5),
    (uuid.UUID(int=1), str(uuid.UUID(int=1))),
    (PurePosixPath("/a/b"), "/a/b"),
    ({1, 2}, [1, 2]),
    (float("nan"), "nan"),
    (float("inf"), "inf"),
    ({1: "a"}, {"1": "a"}),
    ({1: "a", "1": "b"}, {"1": "b"}),
    ({1: "a", "1": "b"}, {1: "b", "1": "a"}),
    ({"\x00type": "int", "v": "5"}, 2**60),  # a dict shaped like a tag is not the tag
]


@pytest.mark.parametrize(("a", "b"), PAIRS, ids=[repr(a)[:30] for a, _ in PAIRS])
def test_values_of_different_types_never_share_a_fingerprint(a: Any, b: Any) -> None:
    assert fingerprint({"x": a}) != fingerprint({"x": b})


def test_no_value_is_dropped() -> None:
    both = {1: "a", "1": "b"}
    assert fingerprint(both) != fingerprint({1: "a"}) != fingerprint({"1": "b"})


def test_a_tagged_dict_that_collides_with_a_map_is_told_apart() -> None:
    assert fingerprint({"\x00type": "map", "v": [[1, "a"]]}) != fingerprint({1: "a"})


def test_equal_values_share_one_fingerprint() -> None:
    assert fingerprint({"when": dt.datetime(2026, 1, 1)}) == fingerprint(
        {"when": dt.datetime(2026, 1, 1)}
    )
    assert fingerprint({3, 1, 2}) == fingerprint({2, 3, 1})
    assert fingerprint({1: "a", 2: "b"}) == fingerprint({2: "b", 1: "a"})
    assert fingerprint((1, 2)) == fingerprint([1, 2])  # schemas turn one into the other


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53) + 1, 2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@given(json_values)
def test_plain_json_fingerprints_exactly_as_before(value: Any) -> None:
    """In-flight records written before this change keep matching their retries."""
    assert fingerprint(value) == hashlib.sha256(rfc8785.dumps(value)).hexdigest()


def test_a_type_can_say_how_it_fingerprints() -> None:
    class Money:
        def __init__(self, cents: int, currency: str) -> None:
            self.cents, self.currency = cents, currency

        def __idempotency_fingerprint__(self) -> Any:
            return {"cents": self.cents, "currency": self.currency}

    assert fingerprint(Money(5, "EUR")) == fingerprint(Money(5, "EUR"))
    assert fingerprint(Money(5, "EUR")) != fingerprint(Money(5, "USD"))
    assert fingerprint(Money(5, "EUR")) != fingerprint({"cents": 5, "currency": "EUR"})


def test_an_unknown_type_is_refused_with_a_way_out() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"fingerprint= callable.*__idempotency_fingerprint__"):
        fingerprint({"x": Opaque()})
