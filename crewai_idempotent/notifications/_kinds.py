"""The channel kinds: the `Channel` every kind is, the registry of kinds by scheme, and
what the kinds share (options, an HTTP target, a POST that fails as a `DeliveryFailed`).

This module sits below the channels: `_webhook`, `_slack` and `_apprise` import it and
register their kind here when they load; `_channels` (channels named by URL) imports
them and reads the registry. Nothing here imports a channel module, so imports go one
way. A kind's module loads without its library (httpx, standardwebhooks, apprise): those
are imported when a channel is made or sends.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar
from urllib.parse import SplitResult, urlsplit

from .._errors import DeliveryFailed, LedgerConfigurationError
from ._message import Message

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
        self.timeout_s = _seconds(options.get("timeout_s"), DEFAULT_TIMEOUT_S)

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
        return f"{self.scheme}+{shown(self.target)}"

    def close(self) -> None:  # noqa: B027 - optional for channels that hold nothing open
        pass

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.url}>"


Maker = Callable[[str, Mapping[str, str]], Channel]

_KINDS: dict[str, Maker] = {}


def register(scheme: str, make: Maker) -> None:
    """Add a channel kind: `scheme+target#options` URLs are given to `make(target, options)`.
    A `scheme` registered again is replaced. Raises nothing."""
    _KINDS[scheme] = make


def built_in(scheme: str, make: Maker) -> None:
    """A kind of the package's own, registered as its module loads: a kind the application
    registered under `scheme` before that keeps its own maker."""
    _KINDS.setdefault(scheme, make)


def kinds() -> dict[str, Maker]:
    """The kinds registered so far, by scheme."""
    return _KINDS


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


def http_target(target: str, what: str, example: str, loopback: Callable[[str], bool]) -> None:
    """Check that `target` is an https:// URL with a host and a valid port (plain http://
    only where `loopback(host)`); `what` names the channel in the message, `example` is a
    URL it takes. Raises `LedgerConfigurationError` naming what is wrong."""
    try:
        parts: SplitResult = urlsplit(target)
    except ValueError as exc:
        raise LedgerConfigurationError(f"{what} cannot read its URL ({exc})") from None
    if parts.scheme not in ("https", "http"):
        given = f"{parts.scheme}://" if parts.scheme else repr(shown(target))
        raise LedgerConfigurationError(f"{what} posts to an https:// URL ({example}), not {given}")
    if not parts.hostname:
        raise LedgerConfigurationError(
            f"{what}'s URL names no host ({parts.scheme}:// and then a host, as in {example})"
        )
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 0 < port <= 65535:
        given = parts.netloc.rpartition(":")[2]
        raise LedgerConfigurationError(
            f"{what}'s URL has the port {given!r}: a port is a number from 1 to 65535"
        )
    if parts.scheme == "http" and not loopback(parts.hostname):
        raise LedgerConfigurationError(
            f"{what} sends its deliveries over https:// (plain http:// only to this host)"
        )


def _seconds(value: str | None, default: float) -> float:
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


def shown(url: str) -> str:
    """A URL as shown: no password, no path or query (a Slack webhook's path is its
    secret), no options (a webhook's secret may be one). Raises nothing."""
    try:
        parts = urlsplit(url.split("#", 1)[0])
        host = parts.hostname or ""
    except ValueError:
        return "<a URL that cannot be read>"
    try:
        port: Any = parts.port
    except ValueError:  # not a port: shown as given (it says what is wrong)
        port = parts.netloc.rpartition(":")[2][:20]
    if port:
        host = f"{host}:{port}"
    if not parts.netloc:
        return f"{parts.scheme}:…" if parts.scheme else "…"
    return f"{parts.scheme}://{host}" + ("/…" if parts.path.strip("/") or parts.query else "")


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
        seconds = float(value)
    except ValueError:
        pass
    else:
        return None if math.isnan(seconds) else max(seconds, 0.0)
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
