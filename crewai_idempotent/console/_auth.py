"""Who is asking: a logged-in account, or the identity a trusted auth proxy vouches for.

Two modes, one per console process:

- `accounts`: a name and password checked against the accounts' Argon2 hashes, then a
  session (`_sessions`). Failed logins are throttled per account name and per client
  address (`LoginThrottle`): past the limit the login form answers 429 until the window
  has passed, whatever the password.
- `proxy`: an auth proxy in front (oauth2-proxy, an nginx `auth_request`, ...) puts the
  user's identity in a header. The header is believed only on connections whose peer
  address is one of the configured proxies (the TCP peer, never X-Forwarded-For), and the
  identity must be an account here, whose role applies. Anything else is refused, never
  taken for a login.

Either way the decision is recorded under the account's name: the identity established
here, never a name typed into a form.

Behind a trusted proxy, `X-Forwarded-For` gives the client address (for throttling and
logs) and `X-Forwarded-Proto` whether the browser used TLS (cookies get `Secure`).
"""

from __future__ import annotations

import collections
import ipaddress
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ._accounts import Passkey, Role
from ._sessions import Session

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Who:
    """The identity a request acts as."""

    name: str
    role: Role
    via: str  # "console" (a password login), "auth proxy", "slack"
    session: Session | None = None
    passkeys: tuple[Passkey, ...] = ()  # the account's, as read for this request

    def may(self, action: str) -> bool:
        return self.role.may(action)


def networks(addresses: Iterable[str]) -> tuple[Network, ...]:
    """Addresses or networks (`10.0.0.5`, `10.0.0.0/24`, `::1`) as networks; a malformed
    one is a ValueError naming it."""
    found = []
    for text in addresses:
        try:
            found.append(ipaddress.ip_network(text.strip(), strict=False))
        except ValueError:
            raise ValueError(
                f"not an IP address or network: {text!r} (e.g. 127.0.0.1, 10.0.0.0/24, ::1)"
            ) from None
    return tuple(found)


def _address(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if not text:
        return None
    try:
        address = ipaddress.ip_address(text.strip().strip("[]"))
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


class Trust:
    """The proxies whose headers are believed."""

    def __init__(self, proxies: tuple[Network, ...]) -> None:
        self.proxies = proxies

    def trusted(self, peer: str | None) -> bool:
        address = _address(peer)
        return address is not None and any(address in net for net in self.proxies)

    def client(self, peer: str | None, forwarded_for: str | None) -> str:
        """The client's address: the peer, or behind trusted proxies the nearest address
        in X-Forwarded-For that is not one of them."""
        if not self.trusted(peer) or not forwarded_for:
            return peer or "unknown"
        hops = [hop.strip() for hop in forwarded_for.split(",") if hop.strip()]
        for hop in reversed(hops):
            if not self.trusted(hop):
                return hop if _address(hop) is not None else "unknown"
        return hops[0] if hops else (peer or "unknown")

    def https(self, peer: str | None, scheme: str, forwarded_proto: str | None) -> bool:
        if scheme == "https":
            return True
        if forwarded_proto and self.trusted(peer):
            return forwarded_proto.split(",")[0].strip().lower() == "https"
        return False


class LoginThrottle:
    """Failed logins per account name and per client address in a sliding window. Kept in
    this process: each console process counts its own (several behind one balancer each
    allow the limit)."""

    def __init__(
        self,
        *,
        per_name: int = 5,
        per_address: int = 20,
        window_s: float = 900.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_name = per_name
        self.per_address = per_address
        self.window_s = window_s
        self.clock = clock
        self._failures: dict[str, collections.deque[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, key: str, now: float) -> collections.deque[float]:
        failures = self._failures.setdefault(key, collections.deque())
        while failures and failures[0] <= now - self.window_s:
            failures.popleft()
        return failures

    def wait_s(self, name: str, address: str) -> float:
        """0 if a login may be tried now; else the seconds until one may."""
        now = self.clock()
        with self._lock:
            waits = []
            for key, limit in ((f"name:{name.lower()}", self.per_name),
                               (f"addr:{address}", self.per_address)):  # fmt: skip
                failures = self._recent(key, now)
                if len(failures) >= limit:
                    waits.append(failures[len(failures) - limit] + self.window_s - now)
            return max(waits, default=0.0)

    def failed(self, name: str, address: str) -> None:
        now = self.clock()
        with self._lock:
            for key in (f"name:{name.lower()}", f"addr:{address}"):
                self._recent(key, now).append(now)
            if len(self._failures) > 10_000:  # forget the quiet ones, not the counting
                for key in [k for k, v in self._failures.items() if not v]:
                    del self._failures[key]

    def succeeded(self, name: str) -> None:
        with self._lock:
            self._failures.pop(f"name:{name.lower()}", None)
