"""The outbox of what needs a person, and the channels that reach them.

Writing an entry is part of the transition that causes it (`_outbox`); a `Dispatcher`
delivers the entries of one ledger to its channels, at least once, with backoff and a
delivery id a receiver deduplicates on (`_dispatch`); channels are named by URL like
ledgers (`_channels`; the kinds, a Standard Webhooks-signed webhook, Slack and apprise,
register into `_kinds`). See docs/notifications.md. Everything loads on first use: the
ledger's own modules import `_outbox` alone.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .._errors import DeliveryFailed
    from ._channels import ENV, channel_from_url, channels_from
    from ._dispatch import Dispatcher, Pass
    from ._kinds import Channel, register
    from ._message import Message, approval_link
    from ._outbox import TYPES, Delivery, Entry, Outbox, alert, put

_LAZY = {
    "ENV": "._channels",
    "Channel": "._kinds",
    "DeliveryFailed": ".._errors",
    "channel_from_url": "._channels",
    "channels_from": "._channels",
    "register": "._kinds",
    "Dispatcher": "._dispatch",
    "Pass": "._dispatch",
    "Message": "._message",
    "approval_link": "._message",
    "TYPES": "._outbox",
    "Delivery": "._outbox",
    "Entry": "._outbox",
    "Outbox": "._outbox",
    "alert": "._outbox",
    "put": "._outbox",
}

__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = [
    "ENV",
    "TYPES",
    "Channel",
    "Delivery",
    "DeliveryFailed",
    "Dispatcher",
    "Entry",
    "Message",
    "Outbox",
    "Pass",
    "alert",
    "approval_link",
    "channel_from_url",
    "channels_from",
    "put",
    "register",
]
