"""Trusted public keys, one per line, in the spirit of SSH's authorized_keys:

    <roles> <algorithm> <public key> <identity> [options]

    approve,resolve ed25519 MCowBQYDK2VwAyEA... alice@example.com
    approve webauthn pQECAyYgASFYIC... alice@example.com credential=Xy9... rp=example.com origin=https://console.example.com
    sweeper ed25519 q2Vw... payments-sweeper

Roles (comma-separated): `approve` (approvals and denials), `resolve` (settling an
uncertain outcome), `cap` (changing a spend cap), `sweeper` (a sweeper's automatic
settlements: a key is trusted for those only when its line says so). Algorithms:
`ed25519` (the raw 32-byte public key, base64) and `webauthn` (a passkey: its COSE public
key, base64url, with `credential=` its credential id (base64url), `rp=` the relying
party id it was registered for and `origin=` the console's origin, several separated by
commas; `uv=required` also demands user verification). The identity is the person or
service the key belongs to: several lines may share one (two passkeys, a key being
rotated in), and the two-person rule counts identities, not keys. `#` starts a comment.

A line that does not parse is a `SigningConfigurationError` naming where it was read;
nothing is skipped. Public key objects are built once, when the line is read.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .._errors import SigningConfigurationError
from ._cose import check_cose_key
from ._decision import check_identity
from ._encoding import b64url, from_b64, from_b64url, key_id

ALGORITHMS = ("ed25519", "webauthn")
ROLES = ("approve", "resolve", "cap", "sweeper")
_OPTIONS = {"ed25519": (), "webauthn": ("credential", "rp", "origin", "uv")}
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_RP_ID = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")


@dataclass(frozen=True, slots=True)
class TrustedKey:
    """One trusted public key: its `roles`, `algorithm`, `public_key` (bytes: raw
    Ed25519, or a passkey's COSE key), the `identity` it belongs to, its `options`
    (a passkey's credential, rp, origin, uv), its `key_id`, the `source` it was read
    from (a file and line) and its `verifier` (the public key object, made once). Made by
    `parse_line`, which raises; raises nothing itself."""

    roles: frozenset[str]
    algorithm: str
    public_key: bytes
    identity: str
    options: Mapping[str, str]
    key_id: str
    source: str
    # The public key object made once when the line was read.
    verifier: Any = field(default=None, compare=False, repr=False)

    def __hash__(self) -> int:  # a set of the keys that signed counts each once
        return hash(self.key_id)

    @property
    def credential_id(self) -> bytes | None:
        """A passkey's credential id (None for an Ed25519 key)."""
        value = self.options.get("credential")
        return None if value is None else from_b64url(value)

    @property
    def rp_id(self) -> str | None:
        """The relying party id a passkey was registered for."""
        return self.options.get("rp")

    @property
    def origins(self) -> tuple[str, ...]:
        """The origins a passkey's assertions may come from."""
        value = self.options.get("origin")
        return tuple(value.split(",")) if value else ()

    @property
    def user_verification(self) -> bool:
        """Whether a passkey's assertions must carry user verification, not only presence."""
        return self.options.get("uv") == "required"

    def line(self) -> str:
        """The trusted keys line that reads back as this key. Raises nothing."""
        encoded = (
            base64.b64encode(self.public_key).decode()
            if self.algorithm == "ed25519"
            else b64url(self.public_key)
        )
        words = [",".join(r for r in ROLES if r in self.roles), self.algorithm, encoded]
        words.append(self.identity)
        words += [f"{name}={self.options[name]}" for name in _OPTIONS[self.algorithm]
                  if name in self.options]  # fmt: skip
        return " ".join(words)


def render_line(
    roles: str | Iterable[str],
    algorithm: str,
    public_key: bytes,
    identity: str,
    **options: str,
) -> str:
    """The trusted keys line for a key (checked by reading it back). Raises
    `SigningConfigurationError` for a role, algorithm, identity or option it would
    refuse."""
    listed = roles if isinstance(roles, str) else ",".join(roles)
    encoded = (
        base64.b64encode(public_key).decode() if algorithm == "ed25519" else b64url(public_key)
    )
    words = [listed, algorithm, encoded, identity, *(f"{k}={v}" for k, v in options.items())]
    text = " ".join(words)
    key = parse_line(text, "the line made for " + repr(identity))
    assert key is not None  # a line of words is never a comment
    return key.line()


def parse_roles(text: str, where: str) -> frozenset[str]:
    """The roles a comma-separated list names. Raises `SigningConfigurationError` for an
    empty list or an unknown role."""
    roles = text.split(",")
    unknown = [r for r in roles if r not in ROLES]
    if not text or unknown:
        raise SigningConfigurationError(
            f"{where}: unknown role {', '.join(map(repr, unknown or [text]))}; roles are "
            f"{', '.join(ROLES)}, separated by commas (approve,resolve)"
        )
    return frozenset(roles)


def parse_line(text: str, where: str) -> TrustedKey | None:
    """The key one trusted keys line holds (None for a blank or comment line); `where`
    names the line in errors ("trusted keys file /etc/keys line 3"). Raises
    `SigningConfigurationError` for a line that does not parse, an unknown role or
    algorithm, a key that is not one, an option that is unknown or malformed, and a
    passkey line in a process without the `passkeys` extra."""
    words = text.split()
    for at, word in enumerate(words):
        if word.startswith("#"):
            words = words[:at]
            break
    if not words:
        return None
    if len(words) < 4:
        raise SigningConfigurationError(
            f"{where}: a trusted key line is `<roles> <algorithm> <public key> <identity> "
            f"[options]`; this one has {len(words)} field{'s' if len(words) != 1 else ''}"
        )
    roles_text, algorithm, encoded, identity, *rest = words
    roles = parse_roles(roles_text, where)
    if algorithm not in ALGORITHMS:
        raise SigningConfigurationError(
            f"{where}: unknown algorithm {algorithm!r}; trusted keys are {' or '.join(ALGORITHMS)}"
        )
    try:
        check_identity(identity)
    except ValueError as exc:
        raise SigningConfigurationError(f"{where}: {exc}") from None
    options: dict[str, str] = {}
    for word in rest:
        name, equals, value = word.partition("=")
        if not equals or name not in _OPTIONS[algorithm]:
            allowed = ", ".join(f"{o}=" for o in _OPTIONS[algorithm]) or "none"
            raise SigningConfigurationError(
                f"{where}: unknown option {word!r} for an {algorithm} key (options: {allowed})"
            )
        if name in options:
            raise SigningConfigurationError(f"{where}: option {name}= is given twice")
        options[name] = value
    if algorithm == "ed25519":
        try:
            public_key = from_b64(encoded)
            if len(public_key) != 32:
                raise ValueError(f"{len(public_key)} bytes, not the 32 of an Ed25519 key")
            verifier: Any = Ed25519PublicKey.from_public_bytes(public_key)
        except ValueError as exc:
            raise SigningConfigurationError(
                f"{where}: the public key is not an Ed25519 key in base64: {exc}"
            ) from None
    else:
        _check_passkey_options(options, where)
        try:
            public_key = from_b64url(encoded)
        except ValueError as exc:
            raise SigningConfigurationError(
                f"{where}: a passkey's public key is its COSE key in base64url: {exc}"
            ) from None
        verifier = check_cose_key(public_key, where)
    return TrustedKey(
        roles=roles, algorithm=algorithm, public_key=public_key, identity=identity,
        options=MappingProxyType(options), key_id=key_id(algorithm, public_key), source=where,
        verifier=verifier,
    )  # fmt: skip


def _check_passkey_options(options: dict[str, str], where: str) -> None:
    missing = [o for o in ("credential", "rp", "origin") if o not in options]
    if missing:
        raise SigningConfigurationError(
            f"{where}: a webauthn key needs {', '.join(f'{o}=' for o in missing)} (credential="
            "its credential id, rp= the relying party id, origin= the console's https origin)"
        )
    try:
        if not from_b64url(options["credential"]):
            raise ValueError("it is empty")
    except ValueError as exc:
        raise SigningConfigurationError(
            f"{where}: credential= is the passkey's credential id in base64url: {exc}"
        ) from None
    rp = options["rp"]
    if not _RP_ID.match(rp):
        raise SigningConfigurationError(
            f"{where}: rp= is a relying party id, a lowercase domain such as example.com "
            f"(no scheme, port or path), not {rp!r}"
        )
    for origin in options["origin"].split(","):
        host = _origin_host(origin, where)
        if host != rp and not host.endswith("." + rp):
            raise SigningConfigurationError(
                f"{where}: origin {origin} is not on the relying party {rp} (its host must "
                f"be {rp} or under it)"
            )
    if options.get("uv", "required") != "required":
        raise SigningConfigurationError(
            f"{where}: uv= takes only `required` (leave it out to require user presence only)"
        )


def _origin_host(origin: str, where: str) -> str:
    """The host of a browser origin (`https://host[:port]`, or http on this machine)."""
    try:
        parts = urlsplit(origin)
        port = parts.port
        host = parts.hostname or ""
    except ValueError:
        parts, port, host = None, None, ""
    local = host in ("localhost", "127.0.0.1", "::1")
    canonical = (
        parts is not None
        and (parts.scheme == "https" or (parts.scheme == "http" and local))
        and host
        and parts.netloc.lower() == parts.netloc
        and not parts.username
        and parts.path == parts.query == parts.fragment == ""
        and port not in ({"https": 443, "http": 80}.get(parts.scheme),)
    )
    if not canonical:
        raise SigningConfigurationError(
            f"{where}: origin= is the console's origin as a browser writes it: https://host "
            f"or https://host:port, no path or trailing slash (http only for "
            f"{', '.join(_LOCAL_HOSTS)}), not {origin!r}"
        )
    return host
