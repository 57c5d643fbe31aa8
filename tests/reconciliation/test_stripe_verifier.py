"""StripeVerifier with the real `stripe` client against the fake Stripe server: found by
metadata (listing since the claim, or searching with its lag), by replay within the key
retention (the original response, never a second charge), and every way Stripe can say
"not sure": a key reused with other parameters, a request in flight, a claim past the
retention window, bad credentials, no server. Charges are counted at the fake."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

stripe = pytest.importorskip("stripe")

from crewai_idempotent import Absent, Event, Found, Owner, Record, Status, Unknown  # noqa: E402
from crewai_idempotent.ledger._reconcile import ask  # noqa: E402
from crewai_idempotent.reconciliation import StripeVerifier  # noqa: E402
from tests.support.fake_stripe import API_KEY, FakeStripe  # noqa: E402


@pytest.fixture
def fake() -> Iterator[FakeStripe]:
    server = FakeStripe()
    yield server
    server.close()


def _client(fake: FakeStripe) -> Any:
    return stripe.StripeClient(API_KEY, base_addresses={"api": fake.url}, max_network_retries=0)


def _pay(fake: FakeStripe, key: str, amount: int = 500, **extra: Any) -> Any:
    """What the tool does: the guard's key as Idempotency-Key and in metadata."""
    return _client(fake).v1.payment_intents.create(
        _params(key, amount, **extra), {"idempotency_key": key}
    )


def _params(key: str, amount: int = 500, **extra: Any) -> dict[str, Any]:
    return {
        "amount": amount, "currency": "eur", "confirm": True, "payment_method": "pm_card_visa",
        "metadata": {"idempotency_key": key}, **extra,
    }  # fmt: skip


def _claimed(key: str, seconds_ago: float = 5.0) -> Record:
    """The record a sweeper asks about: claimed `seconds_ago`."""
    at = time.time() - seconds_ago
    owner = Owner("h", 1, "x")
    return Record(
        key, Status.UNCERTAIN, "fp", 1, 2, owner, 1, at, at,
        history=(Event(at, "claim", 1, owner.label), Event(at + 1, "uncertain", 1, "h")),
    )  # fmt: skip


def _ask(verifier: StripeVerifier, key: str, seconds_ago: float = 5.0, args: Any = None) -> Any:
    return ask(verifier, key, args or {}, None, None, _claimed(key, seconds_ago))


def _verifier(fake: FakeStripe, **options: Any) -> StripeVerifier:
    return StripeVerifier(api_key=API_KEY, api_base=fake.url, **options)


def test_found_by_metadata_among_what_was_made_since_the_claim(fake: FakeStripe) -> None:
    paid = _pay(fake, "pay:inv-1")
    _pay(fake, "pay:inv-2")
    verifier = _verifier(fake)
    assert _ask(verifier, "pay:inv-1") == Found(paid.id)
    assert _ask(verifier, "pay:inv-3") == Absent()
    assert len(fake.charges) == 2  # looking charged nothing


def test_an_object_from_before_the_claim_is_an_earlier_operation(fake: FakeStripe) -> None:
    old = _pay(fake, "pay:inv-1")
    fake.objects["payment_intents"][old.id]["created"] -= 7200  # two hours before the claim
    assert _ask(_verifier(fake), "pay:inv-1") == Absent()
    assert _ask(_verifier(fake), "pay:inv-1", seconds_ago=7300) == Found(old.id)


def test_two_objects_carrying_one_key_are_unknown(fake: FakeStripe) -> None:
    first = _pay(fake, "pay:dup")
    _client(fake).v1.payment_intents.create(_params("pay:dup"), {"idempotency_key": "other"})
    verdict = _ask(_verifier(fake), "pay:dup")
    assert isinstance(verdict, Unknown) and "2 payment_intents carry metadata" in verdict.reason
    assert first.id in verdict.reason


def test_search_finds_it_and_an_empty_search_is_absent_only_past_its_lag(fake: FakeStripe) -> None:
    paid = _pay(fake, "pay:it's")  # a quote in the key: escaped in the query
    verifier = _verifier(fake, search=True, search_lag_s=120)
    assert _ask(verifier, "pay:it's") == Found(paid.id)
    young = _ask(verifier, "pay:none", seconds_ago=5)
    assert isinstance(young, Unknown) and "the search lags" in young.reason
    assert _ask(verifier, "pay:none", seconds_ago=300) == Absent()


def test_charges_and_refunds(fake: FakeStripe) -> None:
    client = _client(fake)
    charge = client.v1.charges.create(
        {
            "amount": 100,
            "currency": "eur",
            "source": "tok_visa",
            "metadata": {"idempotency_key": "c:1"},
        },
        {"idempotency_key": "c:1"},
    )
    refund = client.v1.refunds.create(
        {"charge": charge.id, "metadata": {"idempotency_key": "r:1"}}, {"idempotency_key": "r:1"}
    )
    assert _ask(_verifier(fake, kind="charge"), "c:1") == Found(charge.id)
    assert _ask(_verifier(fake, kind="charge", search=True), "c:1", 300) == Found(charge.id)
    assert _ask(_verifier(fake, kind="refund"), "r:1") == Found(refund.id)
    assert _ask(_verifier(fake, kind="refund"), "r:2") == Absent()


def test_a_receipt_function_says_what_the_tool_returned(fake: FakeStripe) -> None:
    paid = _pay(fake, "pay:r")
    verifier = _verifier(fake, receipt=lambda pi: {"id": pi.id, "status": pi.status})
    assert _ask(verifier, "pay:r") == Found({"id": paid.id, "status": "succeeded"})


# -- replay ------------------------------------------------------------------------------------


def _replaying(fake: FakeStripe, amount: int = 500, **options: Any) -> StripeVerifier:
    return _verifier(
        fake, metadata_key=None, replay=lambda key, args: _params(key, amount), **options
    )


def test_a_replay_returns_the_original_response_and_never_charges_twice(fake: FakeStripe) -> None:
    paid = _pay(fake, "pay:rp")
    assert _ask(_replaying(fake), "pay:rp") == Found(paid.id)
    assert len(fake.charged("pay:rp")) == 1
    assert fake.requests[-1] == ("POST", "/v1/payment_intents", "pay:rp")


def test_a_replay_of_a_request_stripe_never_saw_charges_it_once(fake: FakeStripe) -> None:
    verdict = _ask(_replaying(fake), "pay:never-sent")
    assert isinstance(verdict, Found)
    assert [c["id"] for c in fake.charged("pay:never-sent")] == [verdict.result]
    assert _ask(_replaying(fake), "pay:never-sent") == verdict  # and once only
    assert len(fake.charged("pay:never-sent")) == 1


def test_a_key_reused_with_other_parameters_is_unknown_and_charges_nothing(
    fake: FakeStripe,
) -> None:
    _pay(fake, "pay:other", amount=500)
    verdict = _ask(_replaying(fake, amount=900), "pay:other")
    assert isinstance(verdict, Unknown)
    assert "the key was used with other parameters" in verdict.reason
    assert "400 IdempotencyError" in verdict.reason
    assert len(fake.charges) == 1


def test_a_replay_while_the_first_request_is_in_flight_is_unknown(fake: FakeStripe) -> None:
    import threading

    fake.hold("/v1/payment_intents")
    first = threading.Thread(target=_pay, args=(fake, "pay:flight"))
    first.start()
    assert fake.holding.wait(30)
    verdict = _ask(_replaying(fake), "pay:flight")
    fake.release()
    first.join(30)
    assert isinstance(verdict, Unknown) and "still in flight" in verdict.reason
    assert "409" in verdict.reason
    assert len(fake.charged("pay:flight")) == 1


def test_a_declined_card_moved_no_money(fake: FakeStripe) -> None:
    with pytest.raises(stripe.CardError):
        _pay(fake, "pay:declined", payment_method="pm_card_chargeDeclined")
    verifier = _verifier(
        fake,
        metadata_key=None,
        replay=lambda key, args: _params(key, payment_method="pm_card_chargeDeclined"),
    )
    assert _ask(verifier, "pay:declined") == Absent()
    assert fake.charges == []


def test_past_the_retention_window_a_replay_is_never_sent(fake: FakeStripe) -> None:
    day = 24 * 3600
    sent = len(fake.requests)
    verdict = _ask(_replaying(fake), "pay:old", seconds_ago=day + 60)
    assert (
        isinstance(verdict, Unknown) and "past Stripe's idempotency key retention" in verdict.reason
    )
    assert len(fake.requests) == sent and fake.charges == []
    # With the key in the metadata too, the lookup still answers.
    both = _verifier(fake, replay=lambda key, args: _params(key))
    assert _ask(both, "pay:old", seconds_ago=day + 60) == Absent()
    assert fake.charges == []


def test_trouble_talking_to_stripe_is_unknown(fake: FakeStripe) -> None:
    _pay(fake, "pay:t")
    bad_key = StripeVerifier(api_key="sk_test_wrong", api_base=fake.url)
    verdict = _ask(bad_key, "pay:t")
    assert isinstance(verdict, Unknown) and "401 AuthenticationError" in verdict.reason
    gone = StripeVerifier(api_key=API_KEY, api_base="http://127.0.0.1:9", timeout_s=2)
    verdict = _ask(gone, "pay:t")
    assert isinstance(verdict, Unknown) and "APIConnectionError" in verdict.reason


def test_no_api_key_anywhere_is_unknown_with_the_reason(
    fake: FakeStripe, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STRIPE_API_KEY", raising=False)
    monkeypatch.setattr(stripe, "api_key", None)
    verdict = _ask(StripeVerifier(api_base=fake.url), "pay:k")
    assert isinstance(verdict, Unknown) and "no Stripe API key" in verdict.reason
    monkeypatch.setenv("STRIPE_API_KEY", API_KEY)
    assert _ask(StripeVerifier(api_base=fake.url), "pay:k") == Absent()


def test_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="Search API has no refunds"):
        StripeVerifier("refund", search=True)
    with pytest.raises(ValueError, match="can only replay"):
        StripeVerifier(metadata_key=None)
    with pytest.raises(ValueError, match="kind must be one of"):
        StripeVerifier("invoice")  # type: ignore[arg-type]
