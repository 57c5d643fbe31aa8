"""A decision: what a person (or a sweeper) decides, in the exact bytes that are signed.

A decision names everything it decides and nothing the ledger could change under it:
for an approval or a denial, the request, its round, the call (idempotency key and the
fingerprint of its arguments) and, for an approval, the grant's deadline; for a
resolution, the key, the fencing token of the record it settles and, when the operation
happened, the digest of its receipt; for a cap, the cap, its new limit and currency.
Every kind also names who decided (`by`, the identity of the key that signs), where
(`via`) and when (`at`), and why (`reason`, as the history shows it).

Its signed bytes are RFC 8785 canonical JSON of those fields with a version and a
domain-separation tag (`DOMAIN`), so that no other message signed with the same key (a
webhook, a login) can pass for a decision, and a later version of this format cannot be
read as this one. A passkey signs a challenge, not the bytes: the decision's challenge is
the SHA-256 of the bytes.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import rfc8785

from ..ledger._keys import fingerprint as _fingerprint

DOMAIN = "crewai-idempotent/decision"
VERSION = 1

KINDS = ("approve", "deny", "resolve-found", "resolve-absent", "cap")
VIAS = ("cli", "console", "slack", "api", "sweeper")
# The state each kind moves its subject to (a cap has none: it changes a limit).
STATES = {
    "approve": "APPROVED",
    "deny": "DENIED",
    "resolve-found": "COMMITTED",
    "resolve-absent": "FAILED",
}
# The fields each kind decides, beyond kind, by, via, at and reason (which all have);
# a field in brackets may be left out.
_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "approve": (("request", "round", "key", "fingerprint", "until"), ()),
    "deny": (("request", "round", "key", "fingerprint"), ()),
    "resolve-found": (("key", "token", "receipt"), ()),
    "resolve-absent": (("key", "token"), ()),
    "cap": (("cap", "limit", "currency"), ("window", "until")),
}
_OPTIONAL = (
    "request", "round", "key", "fingerprint", "until", "token", "receipt", "cap", "limit",
    "currency", "window",
)  # fmt: skip

_IDENTITY = re.compile(r"^[^\s\x00-\x1f\x7f#][^\s\x00-\x1f\x7f]{0,199}$")
_REQUEST = re.compile(r"^ap_[0-9a-f]{20}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CURRENCY = re.compile(r"^[A-Z]{3}$")
_TEXT = re.compile(r"^[^\x00-\x1f\x7f]*$")
_MAX_INT = 2**53 - 1  # RFC 8785 numbers are IEEE doubles: larger integers would round


def check_identity(value: Any, what: str = "identity") -> str:
    """`value` if it can name a person or a service: 1-200 characters, no whitespace or
    control character, not starting with '#' (a trusted keys line's comment). Raises
    `ValueError` otherwise."""
    if not isinstance(value, str) or not _IDENTITY.match(value):
        raise ValueError(
            f"{what} must be 1-200 characters without spaces or control characters, not "
            f"starting with '#' (alice@example.com, payments-sweeper), not {value!r}"
        )
    return value


def role_for(kind: str, via: str) -> str:
    """The role a trusted key needs to sign a decision of `kind` made `via` somewhere:
    approve for approvals and denials, resolve for resolutions (sweeper for those a
    sweeper made), cap for caps. Raises `ValueError` for an unknown kind."""
    if kind in ("approve", "deny"):
        return "approve"
    if kind in ("resolve-found", "resolve-absent"):
        return "sweeper" if via == "sweeper" else "resolve"
    if kind == "cap":
        return "cap"
    raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")


def receipt_digest(result: Any) -> str:
    """The digest a found resolution signs for its receipt: the SHA-256 of the canonical
    JSON of `result`, the receipt as the record stores it (encoded). Raises `TypeError`
    for a value with no canonical form."""
    return _fingerprint(result)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of seconds, not {value!r}")
    if not 0 <= value <= _MAX_INT:
        raise ValueError(f"{name} must be between 0 and 2**53 seconds, not {value!r}")
    return float(value)


def _whole(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= _MAX_INT:
        raise ValueError(f"{name} must be a whole number from {least} to 2**53, not {value!r}")
    return value


def _text(name: str, value: Any, *, blank: bool = False, limit: int = 1000) -> str:
    if not isinstance(value, str) or (not blank and not value) or len(value) > limit:
        size = f"0-{limit}" if blank else f"1-{limit}"
        raise ValueError(f"{name} must be text of {size} characters, not {value!r}")
    if not _TEXT.match(value):
        raise ValueError(f"{name} must not hold control characters: {value!r}")
    return value


def _pattern(name: str, value: Any, pattern: re.Pattern[str], shape: str) -> str:
    if not isinstance(value, str) or not pattern.match(value):
        raise ValueError(f"{name} must be {shape}, not {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Decision:
    """What one person or service decided, as it is signed (build one with `approval`,
    `denial`, `found`, `absent` or `cap_change`). Raises `ValueError` for a field that is
    missing, not its kind's, or malformed.

    `kind`: approve, deny, resolve-found, resolve-absent or cap. `by`: the identity of
    the key that signs it. `via`: where it was made (cli, console, slack, api, sweeper).
    `at`: when (seconds since the epoch). `reason`: why, as people wrote it. `request`,
    `round`, `key`, `fingerprint`, `until`: an approval's request id, round, call
    (idempotency key and the fingerprint of its arguments) and grant deadline. `token`,
    `receipt`: a resolution's record fencing token and receipt digest. `cap`, `limit`,
    `currency`, `window`: a cap's name, new limit in minor units, currency and window.
    """

    kind: str
    by: str
    via: str
    at: float
    reason: str = ""
    request: str | None = None
    round: int | None = None
    key: str | None = None
    fingerprint: str | None = None
    until: float | None = None
    token: int | None = None
    receipt: str | None = None
    cap: str | None = None
    limit: int | None = None
    currency: str | None = None
    window: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        check_identity(self.by, "by")
        if self.via not in VIAS:
            raise ValueError(f"via must be one of {', '.join(VIAS)}, not {self.via!r}")
        if self.via == "sweeper" and not self.kind.startswith("resolve-"):
            raise ValueError(f"a sweeper only settles outcomes: it cannot {self.kind}")
        object.__setattr__(self, "at", _number("at", self.at))
        _text("reason", self.reason, blank=True, limit=2000)
        needed, optional = _FIELDS[self.kind]
        for name in _OPTIONAL:
            value = getattr(self, name)
            if value is None:
                if name in needed:
                    raise ValueError(f"a {self.kind} decision needs {name}")
                continue
            if name not in needed and name not in optional:
                raise ValueError(f"a {self.kind} decision has no {name} (given {value!r})")
            checked = _CHECKS[name](value)
            if checked is not value:
                object.__setattr__(self, name, checked)

    # -- building one --------------------------------------------------------------------

    @classmethod
    def approval(
        cls,
        *,
        request: str,
        round: int,
        key: str,
        fingerprint: str,
        until: float,
        by: str,
        via: str,
        at: float | None = None,
        reason: str = "",
    ) -> Decision:
        """`by` approves round `round` of approval request `request` for the call under
        idempotency key `key` whose arguments have `fingerprint`, until `until` (the
        grant's deadline, seconds since the epoch); made `via` somewhere, `at` a time
        (now by default), for `reason`. Raises `ValueError` for a malformed field."""
        return cls(
            "approve", by, via, time.time() if at is None else at, reason, request=request,
            round=round, key=key, fingerprint=fingerprint, until=until,
        )  # fmt: skip

    @classmethod
    def denial(
        cls,
        *,
        request: str,
        round: int,
        key: str,
        fingerprint: str,
        by: str,
        via: str,
        at: float | None = None,
        reason: str = "",
    ) -> Decision:
        """`by` denies round `round` of approval request `request` (the call under `key`
        with `fingerprint`); `via`, `at` and `reason` as for `approval`. Raises
        `ValueError` for a malformed field."""
        return cls(
            "deny", by, via, time.time() if at is None else at, reason, request=request,
            round=round, key=key, fingerprint=fingerprint,
        )  # fmt: skip

    @classmethod
    def found(
        cls,
        *,
        key: str,
        token: int,
        receipt: str,
        by: str,
        via: str,
        at: float | None = None,
        reason: str = "",
    ) -> Decision:
        """`by` settles the record of `key` held under fencing token `token` as happened,
        with the receipt whose digest is `receipt` (`receipt_digest`); `via`, `at` and
        `reason` as for `approval`. Raises `ValueError` for a malformed field."""
        return cls(
            "resolve-found", by, via, time.time() if at is None else at, reason, key=key,
            token=token, receipt=receipt,
        )  # fmt: skip

    @classmethod
    def absent(
        cls,
        *,
        key: str,
        token: int,
        by: str,
        via: str,
        at: float | None = None,
        reason: str = "",
    ) -> Decision:
        """`by` settles the record of `key` held under fencing token `token` as never
        happened (the next call runs); `via`, `at` and `reason` as for `approval`. Raises
        `ValueError` for a malformed field."""
        return cls(
            "resolve-absent", by, via, time.time() if at is None else at, reason, key=key,
            token=token,
        )  # fmt: skip

    @classmethod
    def cap_change(
        cls,
        *,
        cap: str,
        limit: int,
        currency: str,
        by: str,
        via: str,
        window: str | None = None,
        until: float | None = None,
        at: float | None = None,
        reason: str = "",
    ) -> Decision:
        """`by` sets spend cap `cap` to `limit` minor units of `currency` (for one
        `window` only, and until `until`, when given); `via`, `at` and `reason` as for
        `approval`. Raises `ValueError` for a malformed field."""
        return cls(
            "cap", by, via, time.time() if at is None else at, reason, cap=cap, limit=limit,
            currency=currency, window=window, until=until,
        )  # fmt: skip

    # -- what is signed ------------------------------------------------------------------

    @property
    def state(self) -> str | None:
        """The state the decision moves its subject to (None for a cap)."""
        return STATES.get(self.kind)

    @property
    def role(self) -> str:
        """The role a trusted key needs to sign it (`role_for`)."""
        return role_for(self.kind, self.via)

    @property
    def subject(self) -> str:
        """What it decides about, as messages name it: the approval request, the key, or
        the cap."""
        if self.request is not None:
            return f"approval request {self.request}"
        if self.key is not None:
            return f"idempotency key {self.key!r}"
        return f"spend cap {self.cap!r}"

    def to_json(self) -> dict[str, Any]:
        """The decision as plain JSON: its domain tag, version and every field it has (the
        form stored beside its signature). Raises nothing."""
        doc: dict[str, Any] = {"domain": DOMAIN, "v": VERSION}
        for spec in fields(self):
            value = getattr(self, spec.name)
            if value is not None:
                doc[spec.name] = value
        state = self.state
        if state is not None:
            doc["state"] = state
        return doc

    def canonical(self) -> bytes:
        """The bytes that are signed: RFC 8785 canonical JSON of `to_json()`. Raises
        nothing (every field was checked when the decision was made)."""
        return rfc8785.dumps(self.to_json())

    def challenge(self) -> bytes:
        """The WebAuthn challenge for it: the SHA-256 of `canonical()`. Raises nothing."""
        return hashlib.sha256(self.canonical()).digest()

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Decision:
        """The decision `doc` (a `to_json()`) holds. Raises `ValueError` for another domain
        or version, an unknown field, a state that is not its kind's, or a malformed
        field."""
        if not isinstance(doc, Mapping):
            raise ValueError(f"a decision is a JSON object, not {type(doc).__name__}")
        if doc.get("domain") != DOMAIN or doc.get("v") != VERSION:
            raise ValueError(
                f"not a version {VERSION} decision (domain {doc.get('domain')!r}, "
                f"version {doc.get('v')!r})"
            )
        names = {spec.name for spec in fields(cls)}
        unknown = sorted(set(doc) - names - {"domain", "v", "state"})
        if unknown:
            raise ValueError(f"a decision has no field {', '.join(map(repr, unknown))}")
        for name in ("kind", "by", "via", "at"):
            if name not in doc:
                raise ValueError(f"a decision needs {name}")
        decision = cls(**{name: value for name, value in doc.items() if name in names})
        if doc.get("state") != decision.state:
            raise ValueError(
                f"a {decision.kind} decision's state is {decision.state!r}, not "
                f"{doc.get('state')!r}"
            )
        return decision


_CHECKS: dict[str, Any] = {
    "request": lambda v: _pattern("request", v, _REQUEST, "an approval request id (ap_...)"),
    "round": lambda v: _whole("round", v, 1),
    "key": lambda v: _text("key", v, limit=10_000),
    "fingerprint": lambda v: _pattern("fingerprint", v, _HEX64, "64 lowercase hex digits"),
    "until": lambda v: _number("until", v),
    "token": lambda v: _whole("token", v, 0),
    "receipt": lambda v: _pattern("receipt", v, _HEX64, "64 lowercase hex digits"),
    "cap": lambda v: _text("cap", v, limit=200),
    "limit": lambda v: _whole("limit", v, 0),
    "currency": lambda v: _pattern("currency", v, _CURRENCY, "an ISO 4217 code such as EUR"),
    "window": lambda v: _text("window", v, limit=1000),
}
