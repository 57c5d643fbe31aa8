"""Channels, named by URL like ledgers, and what they have in common.

    webhook+https://hooks.example.com/crewai#secret_env=HOOK_SECRET
    slack+https://hooks.slack.com/services/T000/B000/XXXX#console=https://ops.example.com
    apprise+mailtos://user:app-password@gmail.com#types=approval.*

The part before `+` is the channel; the rest is where it sends (a webhook's URL, a Slack
incoming webhook's URL, an apprise URL). The channel's own options are in the fragment
(`#name=value&...`), which no client ever sends to a server: they cannot collide with the
target's query or leak to it. Options every channel takes:

- `name`: what `notifications ls` calls it, and what its deliveries are kept under (by
  default the channel and a digest of its URL: change the URL, and it is a new channel);
- `types`: the entry types it wants, as comma-separated patterns (`approval.*,record.*`);
- `timeout_s`: how long one try may take (10 s).

A setting that cannot work (an unknown channel or option, a webhook without a secret) is
a `LedgerConfigurationError` where it is given, never at the first delivery. An option's
value is taken as written, `+` included (a base64 secret holds them); `%XX` escapes are
decoded. The kinds (`Channel`, `register`) live in `_kinds`, which the channel modules
register into as they load; this module loads them and reads it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl

from .._errors import LedgerConfigurationError
from . import _apprise, _slack, _webhook
from ._kinds import Channel, kinds, register, shown

__all__ = ["ENV", "Channel", "channel_from_url", "channels_from", "env_channels", "register"]

#: Channels for every process that has no `notify=` setting of its own (space or comma
#: separated URLs), and for `crewai-idempotent notify` without `--channel`.
ENV = "CREWAI_IDEMPOTENCY_NOTIFY"
# The built-in kinds registered themselves as they loaded (above); named here so that
# reading this module says which they are.
BUILT_IN = (_webhook.WebhookChannel, _slack.SlackChannel, _apprise.AppriseChannel)

# URLs in one string are separated by spaces, or by a comma before the next channel (a
# comma inside a URL, as in `types=approval.*,record.*`, stays in it).
_SEPARATOR = re.compile(r"\s+|,\s*(?=[A-Za-z][A-Za-z0-9.-]*\+)")


def channel_from_url(url: str) -> Channel:
    """The channel `url` names (see the module's docstring). Raises
    `LedgerConfigurationError` for a `url` that is not `channel+target`, an unknown channel,
    an option given twice, or a setting the channel refuses (the message names the URL)."""
    if not isinstance(url, str) or "+" not in url.split("://", 1)[0]:
        raise LedgerConfigurationError(
            f"not a notification channel URL: {shown(str(url))!r}; one is CHANNEL+TARGET, such "
            "as webhook+https://..., slack+https://hooks.slack.com/... or apprise+mailto://..."
        )
    scheme, target = url.strip().split("+", 1)
    make = kinds().get(scheme.lower())
    if make is None:
        raise LedgerConfigurationError(
            f"{shown(url)!r}: unknown notification channel {scheme!r}; the channels are "
            f"{', '.join(sorted(kinds()))}"
        )
    target, _, fragment = target.partition("#")
    options: dict[str, str] = {}
    # `+` is kept as it is (form encoding would read it as a space: a base64 secret
    # would sign with a key other than the one given); `%XX` is still decoded.
    verbatim = fragment.replace("+", "%2B")
    for name, value in parse_qsl(verbatim, keep_blank_values=True, strict_parsing=False):
        if name in options:
            raise LedgerConfigurationError(f"{shown(url)!r}: option {name!r} given twice")
        options[name] = value
    try:
        return make(target, options)
    except LedgerConfigurationError as exc:
        raise LedgerConfigurationError(f"{shown(url)!r}: {exc}") from None
    except ValueError as exc:
        raise LedgerConfigurationError(f"{shown(url)!r}: {exc}") from None


def channels_from(value: Any, where: str = "notify") -> tuple[Channel, ...]:
    """Channels from a setting: `value` is a URL, a `Channel`, or a list of them (a string
    may hold several URLs, separated by spaces, or by commas before each next `channel+`);
    None is none. `where` names the setting in messages. Raises `TypeError` for a `value`
    (or an item of it) that is neither a URL nor a `Channel`, and `LedgerConfigurationError`
    for a URL `channel_from_url` refuses or two channels with the same name."""
    if value is None:
        return ()
    items: Iterable[Any] = [value] if isinstance(value, str | Channel) else value
    if not hasattr(items, "__iter__"):
        raise TypeError(f"{where}: channels are URLs or Channel objects, not {value!r}")
    found: list[Channel] = []
    for item in items:
        if isinstance(item, Channel):
            found.append(item)
        elif isinstance(item, str):
            found += [channel_from_url(u) for u in _SEPARATOR.split(item.strip()) if u]
        else:
            raise TypeError(f"{where}: channels are URLs or Channel objects, not {item!r}")
    names = [c.name for c in found]
    if len(set(names)) != len(names):
        raise LedgerConfigurationError(f"{where}: two channels are named alike {names}; name=")
    return tuple(found)


def env_channels() -> tuple[Channel, ...]:
    """The channels `CREWAI_IDEMPOTENCY_NOTIFY` names."""
    value = os.environ.get(ENV, "").strip()
    return channels_from(value, ENV) if value else ()
