"""A decision's signed bytes: canonical, versioned, domain-separated, and covering every
field it decides."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import rfc8785

from crewai_idempotent.signing import DOMAIN, Decision, receipt_digest, role_for
from tests.signing.conftest import AT, CALL, FINGERPRINT, REQUEST, approval


def test_the_bytes_are_rfc8785_of_the_json_with_domain_and_version() -> None:
    decision = approval()
    doc = decision.to_json()
    assert doc["domain"] == DOMAIN == "crewai-idempotent/decision" and doc["v"] == 1
    assert doc["state"] == "APPROVED"
    assert decision.canonical() == rfc8785.dumps(doc)
    assert decision.challenge() == hashlib.sha256(decision.canonical()).digest()
    # Canonical: the same decision written with keys in another order is the same bytes.
    shuffled = json.loads(json.dumps(dict(reversed(list(doc.items())))))
    assert Decision.from_json(shuffled).canonical() == decision.canonical()


@pytest.mark.parametrize(
    "make",
    [
        approval,
        lambda: Decision.denial(request=REQUEST, round=2, key=CALL, fingerprint=FINGERPRINT,
                                by="bob", via="console", at=AT, reason="not ours"),
        lambda: Decision.found(key=CALL, token=3, receipt=receipt_digest({"id": "ch_1"}),
                               by="ops", via="cli", at=AT),
        lambda: Decision.absent(key=CALL, token=3, by="sweeper-1", via="sweeper", at=AT),
        lambda: Decision.cap_change(cap="total-EUR", limit=50_000, currency="EUR", by="cfo",
                                    via="api", at=AT, window="day:2027-01-01", until=AT + 60),
    ],
    ids=["approve", "deny", "found", "absent", "cap"],
)  # fmt: skip
def test_every_kind_round_trips_through_json(make) -> None:  # type: ignore[no-untyped-def]
    decision = make()
    again = Decision.from_json(json.loads(json.dumps(decision.to_json())))
    assert again == decision
    assert again.canonical() == decision.canonical()


def test_every_field_is_covered_by_the_bytes() -> None:
    base = approval()
    changes = {
        "request": "ap_" + "2" * 20, "round": 2, "key": "pay:invoice-8",
        "fingerprint": "e" * 64, "until": AT + 3601, "by": "mallory", "via": "console",
        "at": AT + 1, "reason": "other",
    }  # fmt: skip
    for name, value in changes.items():
        other = dataclasses.replace(base, **{name: value})
        assert other.canonical() != base.canonical(), name
        assert other.challenge() != base.challenge(), name
    # A denial of the same request is other bytes than its approval.
    denial = Decision.denial(
        request=REQUEST, round=1, key=CALL, fingerprint=FINGERPRINT, by="alice@example.com",
        via="cli", at=AT, reason="invoice checked",
    )  # fmt: skip
    assert denial.canonical() != base.canonical()


def test_resolutions_bind_the_token_and_the_receipt() -> None:
    found = Decision.found(key=CALL, token=3, receipt=receipt_digest("ch_1"), by="ops", via="cli",
                           at=AT)  # fmt: skip
    assert found.state == "COMMITTED" and found.role == "resolve"
    assert dataclasses.replace(found, token=4).canonical() != found.canonical()
    other = dataclasses.replace(found, receipt=receipt_digest("ch_2"))
    assert other.canonical() != found.canonical()
    absent = Decision.absent(key=CALL, token=3, by="ops", via="cli", at=AT)
    assert absent.state == "FAILED" and absent.receipt is None


def test_the_role_each_kind_needs() -> None:
    assert role_for("approve", "console") == role_for("deny", "slack") == "approve"
    assert role_for("resolve-found", "cli") == role_for("resolve-absent", "api") == "resolve"
    assert role_for("resolve-absent", "sweeper") == "sweeper"
    assert role_for("cap", "cli") == "cap"
    with pytest.raises(ValueError, match="kind must be one of"):
        role_for("grant", "cli")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"request": "ap_123"}, "request must be an approval request id"),
        ({"round": 0}, "round must be a whole number from 1"),
        ({"round": True}, "round must be a whole number"),
        ({"fingerprint": "F" * 64}, "fingerprint must be 64 lowercase hex"),
        ({"until": float("inf")}, "until must be a finite number"),
        ({"at": "now"}, "at must be a finite number"),
        ({"by": "alice smith"}, "by must be 1-200 characters without spaces"),
        ({"by": ""}, "by must be"),
        ({"via": "email"}, "via must be one of cli, console, slack, api, sweeper"),
        ({"via": "sweeper"}, "a sweeper only settles outcomes"),
        ({"reason": "a\x1b[2Jb"}, "reason must not hold control characters"),
        ({"key": ""}, "key must be text of 1-10000"),
    ],
)
def test_malformed_fields_are_refused_where_the_decision_is_made(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        approval(**changes)


def test_a_field_of_another_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="a approve decision has no token"):
        Decision("approve", "alice", "cli", AT, request=REQUEST, round=1, key=CALL,
                 fingerprint=FINGERPRINT, until=AT, token=3)  # fmt: skip
    with pytest.raises(ValueError, match="a resolve-found decision needs receipt"):
        Decision("resolve-found", "ops", "cli", AT, key=CALL, token=3)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(domain="webhook"), "not a version 1 decision"),
        (lambda d: d.update(v=2), "not a version 1 decision"),
        (lambda d: d.update(extra=1), "has no field 'extra'"),
        (lambda d: d.update(state="DENIED"), "state is 'APPROVED', not 'DENIED'"),
        (lambda d: d.pop("state"), "state is 'APPROVED', not None"),
        (lambda d: d.pop("by"), "a decision needs by"),
        (lambda d: d.pop("until"), "a approve decision needs until"),
    ],
)
def test_from_json_is_strict(edit, message: str) -> None:  # type: ignore[no-untyped-def]
    doc = approval().to_json()
    edit(doc)
    with pytest.raises(ValueError, match=message):
        Decision.from_json(doc)


def test_an_integer_time_is_the_same_bytes_as_its_float() -> None:
    assert approval(at=1_800_000_000).canonical() == approval(at=1_800_000_000.0).canonical()
