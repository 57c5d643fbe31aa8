"""What the Stripe crash test's workers and its sweeper share, without crewai: the charge a
tool makes through the real `stripe` client, and the verifier its records name.

The fake Stripe server's address comes from FAKE_STRIPE_URL (read when used, so that a
sweeper imports this module before the variable matters). A sweeper finds `verify_payment`
by the import path the tool's claims record (`--import tests.support.crewai.stripe_tools`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import stripe

from crewai_idempotent.reconciliation import StripeVerifier
from tests.support.fake_stripe import API_KEY

PATH = "tests.support.crewai.stripe_tools:verify_payment"


class _FromEnvironment(StripeVerifier):
    """The verifier, pointed at the fake server named in the environment when it is asked."""

    def client(self) -> stripe.StripeClient:
        self._api_base = os.environ["FAKE_STRIPE_URL"]
        return super().client()


verify_payment = _FromEnvironment(api_key=API_KEY)


def pay(invoice: str, amount: int, idempotency_key: str, hold: str | None, when: str) -> str:
    """Charge `amount` for `invoice` with the guard's key (Idempotency-Key and metadata). With
    `hold`, stop there for ever (to be killed): `when` is "before" or "after" the charge."""
    if hold and when == "before":
        Path(hold).write_text("")
        time.sleep(3600)
    client = stripe.StripeClient(
        API_KEY, base_addresses={"api": os.environ["FAKE_STRIPE_URL"]}, max_network_retries=0
    )
    intent = client.v1.payment_intents.create(
        {
            "amount": amount, "currency": "eur", "confirm": True,
            "payment_method": "pm_card_visa", "metadata": {"idempotency_key": idempotency_key},
        },
        {"idempotency_key": idempotency_key},
    )  # fmt: skip
    if hold and when == "after":
        Path(hold).write_text(intent.id)
        time.sleep(3600)
    return str(intent.id)
