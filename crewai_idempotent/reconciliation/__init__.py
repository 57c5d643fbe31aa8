"""Reconciliation that runs itself: the sweeper, ready-made verifiers, alerts.

    from crewai_idempotent.reconciliation import Sweeper, StripeVerifier

    sweeper = Sweeper("postgresql://...", reconcilers={"charge": StripeVerifier()})
    report = sweeper.sweep()            # one pass; `crewai-idempotent reconcile`
    watching = sweeper.start(30)        # every 30 s on a thread of its own

The sweeper (`_sweeper`) settles UNCERTAIN records and stale claims through the ledger's
own decision (`_Machine._sweep`); `_registry` finds a record's reconciler in a process
that never built its tool; `_alerts` says what needs a person. Verifiers: `StripeVerifier`
(`_stripe`, the `stripe` extra), `IdempotencyKeyVerifier` for HTTP APIs that honour an
`Idempotency-Key` (`_http`, the `http` extra), and `lookup` / `sql_lookup` for your own
database or API (`_lookup`). See docs/recovery.md.

Every name loads on first use: importing this package imports no client library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from ..ledger._reconcile import NamedReconciler, named, reconciling
    from ._alerts import (
        ALERT_KINDS,
        Alert,
        AlertChannel,
        LogAlerts,
        OutboxAlerts,
        default_channels,
    )
    from ._http import IdempotencyKeyVerifier
    from ._lookup import lookup, sql_lookup
    from ._registry import GROUP, reconciles, register, unregister
    from ._stripe import StripeVerifier
    from ._sweeper import OUTCOMES, Progress, Report, Result, Sweeper, Watching

_WHERE = {
    "NamedReconciler": "..ledger._reconcile",
    "named": "..ledger._reconcile",
    "reconciling": "..ledger._reconcile",
    "ALERT_KINDS": "._alerts",
    "Alert": "._alerts",
    "AlertChannel": "._alerts",
    "LogAlerts": "._alerts",
    "OutboxAlerts": "._alerts",
    "default_channels": "._alerts",
    "IdempotencyKeyVerifier": "._http",
    "lookup": "._lookup",
    "sql_lookup": "._lookup",
    "GROUP": "._registry",
    "reconciles": "._registry",
    "register": "._registry",
    "unregister": "._registry",
    "StripeVerifier": "._stripe",
    "OUTCOMES": "._sweeper",
    "Progress": "._sweeper",
    "Report": "._sweeper",
    "Result": "._sweeper",
    "Sweeper": "._sweeper",
    "Watching": "._sweeper",
}

__getattr__ = lazy_attributes(__name__, _WHERE)

__all__ = [
    "ALERT_KINDS",
    "Alert",
    "AlertChannel",
    "GROUP",
    "IdempotencyKeyVerifier",
    "LogAlerts",
    "NamedReconciler",
    "OUTCOMES",
    "OutboxAlerts",
    "Progress",
    "Report",
    "Result",
    "StripeVerifier",
    "Sweeper",
    "Watching",
    "default_channels",
    "lookup",
    "named",
    "reconciles",
    "reconciling",
    "register",
    "sql_lookup",
    "unregister",
]
