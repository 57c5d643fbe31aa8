"""How a console runs: its authentication mode, the proxies it trusts, its public URL,
sessions, live refresh and Slack. Checked where it is made: a wrong setting is an error
naming it, before anything listens."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..gates._approvals import DEFAULT_APPROVAL_TTL
from ._auth import networks

AUTH_MODES = ("accounts", "proxy")


def _seconds(name: str, value: float, *, at_least: float = 0.0) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or math.isnan(value)
        or value <= at_least
    ):
        raise ValueError(f"{name} must be more than {at_least:g} seconds, not {value!r}")


@dataclass(frozen=True)
class ConsoleSettings:
    """- `auth`: "accounts" (log in with a console account's password) or "proxy" (the
      identity comes from `proxy_header`, believed only from `trusted_proxies`).
    - `trusted_proxies`: addresses or networks of the reverse / auth proxies in front;
      their X-Forwarded-For and X-Forwarded-Proto are believed, nobody else's.
    - `public_url`: the origin browsers use (`https://approvals.example.com`), when it is
      not the address the console listens on; forms are accepted only from it.
    - `allowed_hosts`: Host header values accepted besides the loopback names and
      `public_url`'s host (DNS rebinding is refused).
    - `session_ttl_s` / `idle_s`: a session ends that long after login / without a request.
    - `refresh_s`: how often, while a page is open, the store is asked whether the ledger
      changed (its change mark), for live updates.
    - `slack_signing_secret`: enables Slack's button posts at /slack/interactive;
      `slack_team`: only that workspace's; `slack_grant_ttl_s`: a Slack approval's grant;
      `slack_response_prefix`: the only URL prefix a click's answer is posted to.
    - `login_failures_per_name` / `login_failures_per_address`: failed logins allowed per
      account name / client address within `login_window_s`; past them the login form
      answers 429 until the window has passed.
    - `tls`: the console serves TLS itself (cookies are then Secure).

    Raises `ValueError` naming the setting that cannot work: an unknown `auth`, "proxy"
    without `trusted_proxies`, a malformed address, header name or `public_url`, a
    duration or limit out of range, a `slack_signing_secret` that is not Slack's.
    """

    auth: str = "accounts"
    proxy_header: str = "X-Forwarded-Email"
    trusted_proxies: tuple[str, ...] = ()
    public_url: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    session_ttl_s: float = 12 * 3600.0
    idle_s: float = 3600.0
    refresh_s: float = 2.0
    slack_signing_secret: str | None = field(default=None, repr=False)
    slack_team: str | None = None
    slack_grant_ttl_s: float = DEFAULT_APPROVAL_TTL
    slack_response_prefix: str = "https://hooks.slack.com/"
    login_failures_per_name: int = 5
    login_failures_per_address: int = 20
    login_window_s: float = 900.0
    tls: bool = False

    def __post_init__(self) -> None:
        if self.auth not in AUTH_MODES:
            raise ValueError(f"auth must be one of {', '.join(AUTH_MODES)}, not {self.auth!r}")
        object.__setattr__(self, "trusted_proxies", tuple(self.trusted_proxies))
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        networks(self.trusted_proxies)  # a malformed address fails here
        if self.auth == "proxy" and not self.trusted_proxies:
            raise ValueError(
                "auth='proxy' needs trusted_proxies (--trusted-proxy ADDRESS): the identity "
                "header is believed only from the auth proxy's own address"
            )
        header = self.proxy_header
        if not header or not all(c.isalnum() or c == "-" for c in header):
            raise ValueError(f"proxy_header must be an HTTP header name, not {header!r}")
        if self.public_url is not None:
            parts = urlsplit(self.public_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    f"public_url must be http(s)://host[:port], not {self.public_url!r}"
                )
            if parts.path not in ("", "/") or parts.query or parts.fragment:
                raise ValueError(
                    f"public_url is an origin, without a path: the console serves at the root "
                    f"of its host (e.g. https://approvals.example.com), not {self.public_url!r}"
                )
        _seconds("session_ttl_s", self.session_ttl_s, at_least=60)
        _seconds("idle_s", self.idle_s, at_least=60)
        _seconds("refresh_s", self.refresh_s, at_least=0.05)
        _seconds("slack_grant_ttl_s", self.slack_grant_ttl_s)
        _seconds("login_window_s", self.login_window_s)
        secret = self.slack_signing_secret
        if secret is not None and (not isinstance(secret, str) or len(secret.strip()) < 16):
            raise ValueError("slack_signing_secret looks wrong: Slack's are 32 hex characters")
        for name in ("login_failures_per_name", "login_failures_per_address"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number, 1 or more, not {value!r}")

    @property
    def public_origin(self) -> str | None:
        if self.public_url is None:
            return None
        parts = urlsplit(self.public_url)
        return f"{parts.scheme}://{parts.netloc}".lower()

    @property
    def secure(self) -> bool:
        """Whether browsers reach the console over TLS whatever a request says."""
        return self.tls or (self.public_url or "").lower().startswith("https://")
