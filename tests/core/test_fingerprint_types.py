"""Fingerprints tell values of different types apart, and keep plain JSON as it was."""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import enum
import hashlib
import uuid
from pathlib import PurePosixPath
from typing import Any

import pytest
import rfc8785
from hypothesis import given
from hypothesis import strategies as st

from crewai_idempotent import fingerprint
from crewai_idempotent.ledger._keys import _canonical, canonical_json

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


# The value space where the encoder's fast path and RFC 8785 could part: every float
# (integral, tiny, huge, negative zero), every character (beyond the BMP, in keys too,
# lone surrogates), tuples, nesting; and the exact types' subclasses, which go the slow way.
_edge_floats = st.sampled_from(
    [0.0, -0.0, 1.0, -1.0, 1e-4, 9.999e-5, 1e-6, 1e-7, 1e16, 1e21, 1.5e300, 5e-324,
     2.0**53, 2.0**53 + 2, -(2.0**53), 0.1, 123456789.125, 1e15 + 0.5]
)  # fmt: skip
_any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=8)
json_values_everywhere = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53) - 3, 2**53 + 3)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _edge_floats
    | _any_text,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=3).map(tuple)
        | st.dictionaries(_any_text, children, max_size=4)
    ),
    max_leaves=16,
)


def _slow(value: Any) -> bytes | type[BaseException]:
    try:
        return rfc8785.dumps(_canonical(value))
    except Exception as exc:  # noqa: BLE001 - the kind of failure is what is compared
        return type(exc)


@given(json_values_everywhere)
def test_the_fast_path_writes_exactly_the_canonical_bytes(value: Any) -> None:
    try:
        fast: bytes | type[BaseException] = canonical_json(value)
    except Exception as exc:  # noqa: BLE001
        fast = type(exc)
    assert fast == _slow(value)


def test_fingerprints_of_existing_ledgers_do_not_change() -> None:
    """Digests recorded with the RFC 8785 implementation before the fast path existed."""
    cases = [
        ({"tool": "pay", "args": {"invoice_id": "INV-1", "amount_cents": 1200}},
         "30787a15b8143ba3a1209ecc5e41a493a7e747031d237306df3794890f6b5cfb"),
        ({"a": 1.0, "b": -0.0, "c": 0.1, "d": 1e-7, "e": 1e21, "f": 123456789.125,
          "g": 2**53, "h": float(2**53)},
         "5924db8b5c14f03e00c2b2fbef7ec82abd31a4b3c49aa09930ef49909a40f452"),
        ({"ü": "é", "\U0001f600": "x", "\ue000": "y"},
         "3963c8f1e4a8a25b7f69eb50a7ee133b2868a93addda8fee2455146a9525ea10"),
        ([1, [2, [3, {"k": None, "t": True}]]],
         "e6500a69d7e71bd0fdec7e5f7e5814dfd61b6c6fb7988befbbca22fbce77f5d4"),
        ({"x": dt.date(2026, 1, 1), "y": decimal.Decimal("1.5")},
         "454f5722f88eacc1d41c035a5b44df03b8136a1301b39f90392b35b6e4102c46"),
        ({"s": 'a"b\\c\n\t\x01\x7f'},
         "f6137adde3fa508da1f43d89b32e366d0c74937dde33eb02af0deac7b477662e"),
        ((1, 2, 3), "a615eeaee21de5179de080de8c3052c8da901138406ba71c38c032845f7d54f4"),
        ({"big": 2**60}, "cbfd6528aee601ee07500e3240f99f4c32f4509381aec4b248d133ac097bb457"),
        ({"f": 1.5e300, "g": -2.5e-5, "h": 0.0001, "i": 9.999e-5},
         "025359f1cfb00b0572ab2612f73f3a20aad557a1af9d8a70faa46089ed68df73"),
    ]  # fmt: skip
    for value, digest in cases:
        assert fingerprint(value) == digest, value


class _Label(str):
    pass


class _Count(int):
    pass


def test_subclasses_of_json_types_take_the_slow_path_and_fingerprint_as_before() -> None:
    class Tier(enum.IntEnum):
        GOLD = 1

    for value in ({"tier": Tier.GOLD}, {"label": _Label("x")}, {"n": _Count(3)}, {"b": True}):
        assert canonical_json(value) == rfc8785.dumps(_canonical(value))
