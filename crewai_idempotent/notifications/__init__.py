"""The outbox of what needs a person, and the channels that reach them.

Writing an entry is part of the transition that causes it (`_outbox`); a `Dispatcher`
delivers the entries of one ledger to its channels, at least once, with backoff and a
delivery id a receiver deduplicates on (`_dispatch`); channels are named by URL like
ledgers (`_channels`: a Standard Webhooks-signed webhook, Slack, apprise). See
docs/notifications.md. Everything loads on first use: the ledger's own modules import
`_outbox` alone.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from ._outbox import TYPES, Delivery, Entry, Outbox, alert, put

_LAZY = {
    "TYPES": "._outbox",
    "Delivery": "._outbox",
    "Entry": "._outbox",
    "Outbox": "._outbox",
    "alert": "._outbox",
    "put": "._outbox",
}

__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = ["TYPES", "Delivery", "Entry", "Outbox", "alert", "put"]
