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
a `LedgerConfigurationError` where it is given, never at the first delivery.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar
from urllib.parse import parse_qsl, urlsplit

from .._errors import DeliveryFailed, LedgerConfigurationError
from ._message import Message

#: Channels for every process that has no `notify=` setting of its own (space or comma
#: separated URLs), and for `crewai-idempotent notify` without `--channel`.
ENV = "CREWAI_IDEMPOTENCY_NOTIFY"
DEFAULT_TIMEOUT_S = 10.0


class Channel(ABC):
    """Somewhere entries go. `send` delivers one message or raises `DeliveryFailed`;
    every try of one entry carries the same `message.id`, for the receiver to deduplicate.

    `target` is where it sends (the URL after `channel+`, without the fragment), `options`
    the fragment's options (`name`, `types`, `timeout_s` and the channel's own). Raises
    `LedgerConfigurationError` for a `timeout_s` that is not a positive number of seconds.
    """

    scheme: ClassVar[str]

    def __init__(self, target: str, options: Mapping[str, str]) -> None:
        self.target = target
        self.options = dict(options)
        self.name = options.get("name") or f"{self.scheme}-{_digest(target)}"
        types = options.get("types", "*")
        self.types = tuple(t.strip() for t in types.split(",") if t.strip()) or ("*",)
        self.timeout_s = _seconds(options.get("timeout_s"), DEFAULT_TIMEOUT_S, self.scheme)

    def wants(self, entry_type: str) -> bool:
        """Whether entries of `entry_type` go to this channel: it matches one of the
        channel's `types` patterns. Raises nothing."""
        return any(fnmatch.fnmatchcase(entry_type, pattern) for pattern in self.types)

    @abstractmethod
    def send(self, message: Message) -> None:
        """Deliver `message` once. Raises `DeliveryFailed` when it was not delivered (with
        the HTTP status and Retry-After, if any, for the backoff); the dispatcher tries
        again later with the same `message.id`."""

    @property
    def url(self) -> str:
        """The channel as shown: where it sends, without the credentials in it."""
        return f"{self.scheme}+{_shown(self.target)}"

    def close(self) -> None:  # noqa: B027 - optional for channels that hold nothing open
        pass

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.url}>"


_CHANNELS: dict[str, Callable[[str, Mapping[str, str]], Channel]] = {}
# URLs in one string are separated by spaces, or by a comma before the next channel (a
# comma inside a URL, as in `types=approval.*,record.*`, stays in it).
_SEPARATOR = re.compile(r"\s+|,\s*(?=[A-Za-z][A-Za-z0-9.-]*\+)")


def register(scheme: str, make: Callable[[str, Mapping[str, str]], Channel]) -> None:
    """Add a channel kind: `scheme+target#options` URLs are given to `make(target, options)`.
    A `scheme` registered again is replaced. Raises nothing."""
    _CHANNELS[scheme] = make


_built_in = False  # whether the built-in kinds are in _CHANNELS yet


def _known() -> dict[str, Callable[[str, Mapping[str, str]], Channel]]:
    # Loaded at the first URL, not at import (their modules import httpx); a kind the
    # application registered before that keeps its own maker.
    global _built_in
    if not _built_in:
        from . import _apprise, _slack, _webhook

        _CHANNELS.setdefault("webhook", _webhook.WebhookChannel)
        _CHANNELS.setdefault("slack", _slack.SlackChannel)
        _CHANNELS.setdefault("apprise", _apprise.AppriseChannel)
        _built_in = True
    return _CHANNELS


def channel_from_url(url: str) -> Channel:
    """The channel `url` names (see the module's docstring). Raises
    `LedgerConfigurationError` for a `url` that is not `channel+target`, an unknown channel,
    an option given twice, or a setting the channel refuses (the message names the URL)."""
    if not isinstance(url, str) or "+" not in url.split("://", 1)[0]:
        raise LedgerConfigurationError(
            f"not a notification channel URL: {_shown(str(url))!r}; one is CHANNEL+TARGET, such "
            "as webhook+https://..., slack+https://hooks.slack.com/... or apprise+mailto://..."
        )
    scheme, target = url.strip().split("+", 1)
    make = _known().get(scheme.lower())
    if make is None:
        raise LedgerConfigurationError(
            f"{_shown(url)!r}: unknown notification channel {scheme!r}; the channels are "
            f"{', '.join(sorted(_known()))}"
        )
    target, _, fragment = target.partition("#")
    options: dict[str, str] = {}
    for name, value in parse_qsl(fragment, keep_blank_values=True, strict_parsing=False):
        if name in options:
            raise LedgerConfigurationError(f"{_shown(url)!r}: option {name!r} given twice")
        options[name] = value
    try:
        return make(target, options)
    except LedgerConfigurationError as exc:
        raise LedgerConfigurationError(f"{_shown(url)!r}: {exc}") from None
    except ValueError as exc:
        raise LedgerConfigurationError(f"{_shown(url)!r}: {exc}") from None


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


def check_options(scheme: str, options: Mapping[str, str], known: Iterable[str]) -> None:
    allowed = {"name", "types", "timeout_s", *known}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise LedgerConfigurationError(
            f"unknown option(s) {unknown} for a {scheme} channel; its options are "
            f"{', '.join(sorted(allowed))}"
        )


def flag(value: str | None, name: str) -> bool:
    if value is None:
        return False
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise LedgerConfigurationError(f"{name} must be true or false, not {value!r}")


def _seconds(value: str | None, default: float, scheme: str) -> float:
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise LedgerConfigurationError(f"timeout_s must be seconds, not {value!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise LedgerConfigurationError(f"timeout_s must be more than 0 seconds, not {value!r}")
    return seconds


def _digest(target: str) -> str:
    return hashlib.sha256(target.encode("utf-8", "surrogatepass")).hexdigest()[:10]


def _shown(url: str) -> str:
    """A URL as shown: no password, no path or query (a Slack webhook's path is its
    secret), no options (a webhook's secret may be one)."""
    try:
        parts = urlsplit(url.split("#", 1)[0])
    except ValueError:
        return "<a URL that cannot be read>"
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    if not parts.netloc:
        return f"{parts.scheme}:…" if parts.scheme else "…"
    shown = f"{parts.scheme}://{host}"
    return shown + ("/…" if parts.path.strip("/") or parts.query else "")


def post(client: Any, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> Any:
    """POST `body` to `url`; the response, or `DeliveryFailed` for anything but a 2xx
    (the status and a Retry-After kept). Redirects are not followed: a signed delivery
    goes where it was configured to, or fails."""
    import httpx

    try:
        response = client.post(url, content=body, headers=dict(headers), timeout=timeout_s)
    except httpx.TimeoutException as exc:
        raise DeliveryFailed(f"no answer within {timeout_s} s ({type(exc).__name__})") from exc
    except httpx.HTTPError as exc:
        raise DeliveryFailed(f"{type(exc).__name__}: {exc}") from exc
    if 200 <= response.status_code < 300:
        return response
    raise DeliveryFailed(
        f"HTTP {response.status_code}: {response.text[:200]}".strip(),
        status=response.status_code,
        retry_after=_retry_after(response.headers.get("retry-after")),
    )


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        import email.utils
        import time

        when = email.utils.parsedate_to_datetime(value)
        return max(when.timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None


def http_client() -> Any:
    import httpx

    return httpx.Client(follow_redirects=False, headers={"user-agent": _agent()})


def _agent() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"crewai-idempotent/{version('crewai-idempotent')}"
    except PackageNotFoundError:
        return "crewai-idempotent"
