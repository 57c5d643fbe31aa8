"""The Stripe verifier registered for the tool `charge_card` by its name, for a sweeper
told `--import tests.support.crewai.stripe_by_name`: the tool itself names no reconciler,
and its key (`charge:{invoice}`) does not start with its name."""

from __future__ import annotations

from crewai_idempotent.reconciliation import register

from .stripe_tools import verify_payment

register("charge_card", verify_payment)
