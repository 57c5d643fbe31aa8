"""Passkeys in the console: an approver registers one, then signs approvals and denials
with it (WebAuthn; options and checks by py_webauthn, the `passkeys` extra).

Registering (the Passkeys page): the browser creates a credential for the console's
relying party (the host of its origin) from options py_webauthn made; the answer is
checked (`signing.passkey_line`) and the trusted keys line it yields is kept in the
account (`Accounts.add_passkey`) and shown, to be added to the workers' trusted keys
file. The workers trust that file only: the line kept in the ledger tells the console
which credentials to ask for and lets it check an assertion early, nothing more.

Signing (a request's page): the console builds the decision from the request as it
stands (`Decision.approval` / `Decision.denial`: request, round, idempotency key,
arguments' fingerprint, grant deadline, the passkey's identity, via console) and gives
its challenge to `navigator.credentials.get`; the assertion that comes back is checked
against the account's passkeys (and the console's own trusted keys, when it has some)
before `Approvals.approve` / `deny(..., signed=(decision, envelope))` records it. A bad
one is refused at once, saying why; nothing is decided.

No state is kept between a challenge and its answer, so any console process behind a
balancer can take either: a registration's challenge carries its time and a MAC under
the session's secret; a decision travels back with its assertion and is checked again,
field by field, against the request as it stands and the clock.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import secrets
import shlex
import struct
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute

from .._errors import (
    AccountError,
    ApprovalAlreadyDecided,
    ApprovalNotFound,
    DecisionRefused,
    SigningConfigurationError,
)
from .._units import parse_duration
from ..gates._approvals import ApprovalRequest, ApprovalState, _check_id
from ..signing._decision import Decision
from ..signing._encoding import b64url, from_b64url
from ..signing._envelope import SignatureEnvelope
from ..signing._trusted import ENV, TrustedKeys
from ..signing._verify import verify
from ..signing._webauthn import passkey_line
from ._accounts import Passkey
from ._auth import Who
from ._console import MAX_TTL_S, Console, html, local_path, log, route

RP_NAME = "crewai-idempotent console"
TIMEOUT_MS = 120_000  # what the browser gives the person to touch their authenticator
FRESH_S = 600.0  # a challenge answered later than this is refused: ask again
MAX_REASON = 2000  # a signed decision's reason (`Decision`)
_REGISTRATION = b"crewai-idempotent/console/passkey-registration\x00"
_NONCE, _STAMP, _MAC = 16, 8, 16


# -- where passkeys are made ------------------------------------------------------------


def relying_party(console: Console, request: Request) -> tuple[str, str, str]:
    """(rp id, origin, why not) for passkeys made on the console as `request` reached it:
    the host of its origin (`public_url`'s, else the one the browser used). `why not` is
    "" when browsers can make passkeys there, else what to do instead. Raises nothing."""
    origin = sorted(console.origins(request))[0]
    parts = urlsplit(origin)
    host = (parts.hostname or "").lower()
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        local = f"{parts.scheme}://localhost" + (f":{parts.port}" if parts.port else "")
        why = (
            f"Passkeys belong to a domain name, and this console was opened at the address "
            f"{host}: open it by name ({local} on this machine, or its --public-url)."
        )
        return host, origin, why
    if parts.scheme != "https" and host != "localhost":
        return host, origin, (
            "Browsers make passkeys only over https (or on localhost): serve the console "
            "with TLS or behind a TLS proxy, and give it --public-url https://..."
        )  # fmt: skip
    return host, origin, ""


def _own_keys(who: Who) -> TrustedKeys | None:
    """The account's passkeys as trusted keys, to check an assertion with before it is
    recorded (None without any). A line that no longer reads (edited in the ledger, or
    no py_webauthn here) is left out, and said in the log: it signs nothing here."""
    lines: dict[str, str] = {}
    for passkey in who.passkeys:
        try:
            (key,) = TrustedKeys.from_lines([passkey.line], f"passkey {passkey.key_id}")
        except (SigningConfigurationError, ValueError) as exc:
            log.warning("a passkey of %s cannot be read: %s", who.name, exc)
            continue
        lines.setdefault(key.key_id, key.line())
    if not lines:
        return None
    return TrustedKeys.from_lines(
        list(lines.values()), f"the passkeys of console account {who.name!r}"
    )


def _usable(who: Who, rp_id: str) -> list[Passkey]:
    """The account's passkeys made for this relying party (one made where the console
    was reached by another name cannot sign here)."""
    keys = _own_keys(who)
    if keys is None:
        return []
    return [p for p in who.passkeys if (k := keys.get(p.key_id)) is not None and k.rp_id == rp_id]


def _need_webauthn() -> str:
    try:
        import webauthn  # noqa: F401
    except ImportError as exc:
        return (
            f"Passkeys need py_webauthn, which is not installed with this console "
            f"({exc.name} is missing): pip install 'crewai-idempotent[passkeys]'"
        )
    return ""


def _json(data: Mapping[str, Any], status: int = 200) -> Response:
    return JSONResponse(dict(data), status_code=status)


def _error(message: str, status: int = 400) -> Response:
    return _json({"error": message}, status)


# -- the Passkeys page ------------------------------------------------------------------


def _trusted_file(console: Console) -> str:
    """Where the lines go, as a shell word: the console's own trusted keys file when it
    reads one, else the file the workers' environment names."""
    trusted = console.trusted_keys
    if trusted is not None and trusted.path is not None:
        return shlex.quote(str(trusted.path))
    return f'"${ENV}"'


def _notice(request: Request) -> str:
    done = request.query_params.get("done", "")
    if done == "registered":
        return (
            "Registered. Its trusted keys line is below: until the workers' trusted keys "
            "file holds it, they refuse what it signs."
        )
    if done == "removed":
        return (
            "Removed from this console. Take its line out of the workers' trusted keys file "
            "too: until then they still trust what it signs."
        )
    return ""


def passkeys_page(
    console: Console,
    request: Request,
    who: Who,
    form: FormData | None,
    error: str = "",
    status: int = 200,
) -> Response:
    """The account's passkeys, their trusted keys lines, and the form that registers one."""
    rp_id, origin, unusable = relying_party(console, request)
    trusted = console.trusted_keys
    here = {p.key_id for p in _usable(who, rp_id)}
    rows = [
        {
            "passkey": p,
            "command": f"printf '%s\\n' {shlex.quote(p.line)} >> {_trusted_file(console)}",
            "trusted": None if trusted is None else trusted.get(p.key_id) is not None,
            "here": p.key_id in here,
        }
        for p in who.passkeys
    ]
    return html(
        "passkeys.html", status, **console.context(request, who, "passkeys"), rows=rows,
        rp_id=rp_id, origin=origin, unusable=unusable or _need_webauthn(), env=ENV,
        trusted_path=None if trusted is None else str(trusted.path or ""),
        fresh=request.query_params.get("key", ""), notice=_notice(request), error=error,
    )  # fmt: skip


def _registration_challenge(who: Who, at: float, nonce: bytes | None = None) -> bytes:
    """A challenge only this session could have been given, and when: nonce, time, MAC."""
    assert who.session is not None
    nonce = nonce if nonce is not None else secrets.token_bytes(_NONCE)
    stamp = struct.pack(">d", at)
    mac = hmac.new(
        who.session.csrf.encode(), _REGISTRATION + who.name.encode() + b"\x00" + nonce + stamp,
        hashlib.sha256,
    ).digest()[:_MAC]  # fmt: skip
    return nonce + stamp + mac


def _challenge_of(registration: Mapping[str, Any]) -> bytes:
    client = json.loads(from_b64url(registration["response"]["clientDataJSON"]))
    return from_b64url(client["challenge"])


def _check_registration_challenge(who: Who, challenge: bytes, now: float) -> str:
    if len(challenge) != _NONCE + _STAMP + _MAC:
        return "The passkey answered another challenge than this console gave: register again."
    nonce, stamp = challenge[:_NONCE], challenge[_NONCE : _NONCE + _STAMP]
    (at,) = struct.unpack(">d", stamp)
    if not hmac.compare_digest(challenge, _registration_challenge(who, at, nonce)):
        return "The passkey answered a challenge given to another session: register again."
    if not at - 60 <= now <= at + FRESH_S:
        return "The registration took too long (or the clock moved): register again."
    return ""


def registration_options(
    console: Console, request: Request, who: Who, form: FormData | None
) -> Response:
    """The options for `navigator.credentials.create`, as JSON."""
    rp_id, _, unusable = relying_party(console, request)
    unusable = unusable or _need_webauthn()
    if unusable:
        return _error(unusable, 409)
    from webauthn import generate_registration_options, options_to_json
    from webauthn.helpers.cose import COSEAlgorithmIdentifier as Alg
    from webauthn.helpers.structs import (
        AuthenticatorSelectionCriteria,
        PublicKeyCredentialDescriptor,
        ResidentKeyRequirement,
        UserVerificationRequirement,
    )

    options = generate_registration_options(
        rp_id=rp_id, rp_name=RP_NAME, user_name=who.name,
        # The same handle for every passkey of an account, naming nobody outside it.
        user_id=hashlib.sha256(b"crewai-idempotent console account\x00" + rp_id.encode()
                               + b"\x00" + who.name.encode()).digest()[:32],
        challenge=_registration_challenge(who, console.backend.now()), timeout=TIMEOUT_MS,
        authenticator_selection=AuthenticatorSelectionCriteria(
            resident_key=ResidentKeyRequirement.PREFERRED,
            user_verification=UserVerificationRequirement.REQUIRED,
        ),
        exclude_credentials=[PublicKeyCredentialDescriptor(id=from_b64url(p.credential))
                             for p in who.passkeys],
        supported_pub_key_algs=[Alg.ECDSA_SHA_256, Alg.EDDSA, Alg.RSASSA_PKCS1_v1_5_SHA_256],
    )  # fmt: skip
    return _json({"publicKey": json.loads(options_to_json(options))})


def register(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
    """Check the browser's new credential and keep its trusted keys line."""
    assert form is not None
    rp_id, origin, unusable = relying_party(console, request)
    unusable = unusable or _need_webauthn()
    if unusable:
        return passkeys_page(console, request, who, form, unusable, 409)
    label = str(form.get("label") or "").strip()
    try:
        registration = json.loads(str(form.get("credential") or ""))
        challenge = _challenge_of(registration)
    except (ValueError, KeyError, TypeError):
        why = "The browser sent no passkey (this page's script makes it): try again."
        return passkeys_page(console, request, who, form, why, 400)
    refused = _check_registration_challenge(who, challenge, console.backend.now())
    if refused:
        return passkeys_page(console, request, who, form, refused, 403)
    try:
        line = passkey_line(
            registration, challenge=challenge, rp_id=rp_id, origin=origin, identity=who.name,
            roles=("approve",), require_user_verification=True,
        )  # fmt: skip
        made = console.accounts.add_passkey(who.name, line, label)
    except (SigningConfigurationError, AccountError) as exc:
        return passkeys_page(console, request, who, form, f"Not registered: {exc}", 400)
    log.info("%s registered passkey %s (%s)", who.name, made.key_id, made.label or "no label")
    query = urlencode({"done": "registered", "key": made.key_id})
    return RedirectResponse(f"/passkeys?{query}#passkey-{made.credential}", 303)


def remove(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
    """Forget one of the account's passkeys here (the workers' file is someone's to edit)."""
    assert form is not None
    try:
        gone = console.accounts.remove_passkey(who.name, str(form.get("key") or ""))
    except AccountError as exc:
        return passkeys_page(console, request, who, form, str(exc), 404)
    log.info("%s removed passkey %s from the console", who.name, gone.key_id)
    return RedirectResponse("/passkeys?done=removed", 303)


# -- signing a decision -----------------------------------------------------------------


def _verdict(text: str) -> str:
    return "approve" if text == "approve" else "deny"


def _build(
    asked: ApprovalRequest, who: Who, verdict: str, ttl_s: float, reason: str, at: float
) -> Decision:
    """The decision the passkey is asked to sign: the request as it stands, now."""
    if verdict == "approve":
        return Decision.approval(
            request=asked.id, round=asked.round, key=asked.key, fingerprint=asked.fingerprint,
            until=at + ttl_s, by=who.name, via="console", at=at, reason=reason,
        )  # fmt: skip
    return Decision.denial(
        request=asked.id, round=asked.round, key=asked.key, fingerprint=asked.fingerprint,
        by=who.name, via="console", at=at, reason=reason,
    )  # fmt: skip


def challenge(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
    """The decision to sign and the options for `navigator.credentials.get`, as JSON."""
    assert form is not None
    rid = request.path_params["rid"]
    verdict = _verdict(str(form.get("verdict") or ""))
    rp_id, _, unusable = relying_party(console, request)
    unusable = unusable or _need_webauthn()
    if unusable:
        return _error(unusable, 409)
    usable = _usable(who, rp_id)
    if not usable:
        return _error(f"You have no passkey for {rp_id}: register one on the Passkeys page.", 409)
    try:
        asked = console.approvals.get(_check_id(rid))
    except (ApprovalNotFound, ValueError):
        return _error(f"No approval request {rid}.", 404)
    round_text = str(form.get("round") or "")
    if not round_text.isdigit() or int(round_text) != asked.round:
        return _error(
            f"{rid} is in round {asked.round} now ({asked.state.value}): reload the page "
            "and look at it again.", 409,
        )  # fmt: skip
    allowed = (ApprovalState.PENDING,) + ((ApprovalState.APPROVED,) if verdict == "deny" else ())
    if asked.state not in allowed:
        return _error(f"{rid} is {asked.state.value}: there is nothing to {verdict}.", 409)
    reason = " ".join(str(form.get("reason") or "").split())
    if verdict == "deny" and not reason:
        return _error("Say why it is denied: the agent is told.")
    if len(reason) > MAX_REASON:
        return _error(f"A signed decision's reason is at most {MAX_REASON} characters.")
    ttl_s = 0.0
    if verdict == "approve":
        ttl = parse_duration(str(form.get("ttl") or ""))
        if ttl is None or not 0 < ttl <= MAX_TTL_S:
            return _error(
                "The grant's time must be a duration such as 30m, 4h or 2d (at most 30d)."
            )
        ttl_s = ttl
    try:
        decision = _build(asked, who, verdict, ttl_s, reason, console.backend.now())
    except ValueError as exc:
        return _error(f"This request cannot be signed: {exc}.", 409)
    from webauthn import generate_authentication_options, options_to_json
    from webauthn.helpers.structs import (
        PublicKeyCredentialDescriptor,
        UserVerificationRequirement,
    )

    options = generate_authentication_options(
        rp_id=rp_id, challenge=decision.challenge(), timeout=TIMEOUT_MS,
        allow_credentials=[PublicKeyCredentialDescriptor(id=from_b64url(p.credential))
                           for p in usable],
        user_verification=UserVerificationRequirement.REQUIRED,
    )  # fmt: skip
    what = "approve" if verdict == "approve" else "deny"
    summary = (
        f"Your passkey signs: {who.name} {what}s {rid}, round {asked.round}, the call "
        f"{asked.key} with arguments {asked.fingerprint[:12]}…"
    )
    return _json({
        "decision": decision.to_json(), "publicKey": json.loads(options_to_json(options)),
        "summary": summary,
    })  # fmt: skip


def _refused(console: Console, request: Request, who: Who, status: int, why: str) -> Response:
    log.warning("refused a passkey decision on %s by %s: %s", request.url.path, who.name, why)
    return console.refusal(request, status, f"Refused: {why} Nothing was decided.", who)


def _signed(
    console: Console, request: Request, who: Who, form: FormData, verdict: str
) -> tuple[Decision, SignatureEnvelope, ApprovalRequest] | Response:
    """The decision and its signature the form carries, once they are checked against the
    request as it stands, the clock, and the account's passkeys; else the refusal."""
    rid = request.path_params["rid"]
    try:
        asked = console.approvals.get(_check_id(rid))
    except (ApprovalNotFound, ValueError):
        return console.refusal(request, 404, f"No approval request {rid}.", who)
    try:
        decision = Decision.from_json(json.loads(str(form.get("decision") or "")))
        assertion = json.loads(str(form.get("assertion") or ""))
        if not isinstance(assertion, dict):
            raise ValueError("the assertion is not a JSON object")
        credential = from_b64url(str(assertion.get("rawId", "")))
    except (ValueError, TypeError) as exc:
        why = f"the form carried no signed decision this console can read ({exc})."
        return _refused(console, request, who, 400, why)
    expected = {
        "kind": "approve" if verdict == "approve" else "deny", "request": asked.id,
        "round": asked.round, "key": asked.key, "fingerprint": asked.fingerprint,
        "by": who.name, "via": "console",
    }  # fmt: skip
    wrong = [name for name, value in expected.items() if getattr(decision, name) != value]
    if wrong:
        shown = ", ".join(f"{n} {getattr(decision, n)!r} (here: {expected[n]!r})" for n in wrong)
        why = f"the signed decision is not this one to {verdict} {asked.id}: {shown}."
        return _refused(console, request, who, 409 if wrong == ["round"] else 403, why)
    now = console.backend.now()
    if not decision.at - 60 <= now <= decision.at + FRESH_S:
        return _refused(
            console, request, who, 409, "the decision was signed too long ago: sign again."
        )
    if decision.until is not None and not (
        now < decision.until and decision.until - decision.at <= MAX_TTL_S
    ):
        return _refused(
            console, request, who, 403, "the grant's deadline is not one this console gives."
        )
    rp_id, _, _ = relying_party(console, request)
    mine = {p.credential for p in _usable(who, rp_id)}
    own = _own_keys(who)
    key = own.by_credential(credential) if own is not None else None
    if key is None or b64url(credential) not in mine:
        return _refused(
            console,
            request,
            who,
            403,
            f"the signature is not by one of {who.name}'s passkeys for {rp_id}.",
        )
    envelope = SignatureEnvelope.from_assertion(assertion, key.key_id)
    assert own is not None
    try:
        verify(decision, envelope, own, role="approve")
    except DecisionRefused as exc:
        return _refused(
            console,
            request,
            who,
            403,
            f"your passkey's signature does not hold ({exc.reason}): {exc.detail}.",
        )
    trusted = console.trusted_keys
    if trusted is not None:
        try:
            verify(decision, envelope, trusted, role="approve")
        except DecisionRefused as exc:
            why = (
                f"the workers would refuse it ({exc.reason}): {exc.detail}. Add the passkey's "
                "line (Passkeys page) to the trusted keys file first."
            )
            return _refused(console, request, who, 403, why)
    return decision, envelope, asked


def decide(verdict: str) -> Any:
    """The handler that records a passkey-signed approval (`verdict` "approve") or denial."""

    def signed(console: Console, request: Request, who: Who, form: FormData | None) -> Response:
        assert form is not None
        checked = _signed(console, request, who, form, verdict)
        if isinstance(checked, Response):
            return checked
        decision, envelope, asked = checked
        back = local_path(str(form.get("back") or ""), f"/approvals/{asked.id}")
        try:
            if verdict == "approve":
                assert decision.until is not None
                decided = console.approvals.approve(
                    asked.id, by=decision.by, reason=decision.reason, via="console",
                    ttl_s=max(decision.until - console.backend.now(), 1e-3),
                    round=decision.round, signed=(decision, envelope),
                )  # fmt: skip
            else:
                decided = console.approvals.deny(
                    asked.id, by=decision.by, reason=decision.reason, via="console",
                    round=decision.round, signed=(decision, envelope),
                )  # fmt: skip
        except ApprovalNotFound:
            return console.refusal(request, 404, f"No approval request {asked.id}.", who)
        except ApprovalAlreadyDecided as exc:
            return _refused(console, request, who, 409, f"{exc}.")
        except DecisionRefused as exc:
            return _refused(console, request, who, 403, f"{exc}.")
        except ValueError as exc:  # not about the request as it is now (moved meanwhile)
            return _refused(console, request, who, 409, f"{exc}.")
        log.info(
            "%s %s %s with passkey %s (%s)", who.name,
            "approved" if verdict == "approve" else "denied", asked.id, envelope.key_id,
            decided.state.value,
        )  # fmt: skip
        console.wake_dispatchers()
        done = "approved" if verdict == "approve" else "denied"
        return RedirectResponse(f"{back}?{urlencode({'done': done, 'id': asked.id})}", 303)

    return signed


ROUTES: list[BaseRoute] = [
    route("/passkeys", "view", passkeys_page),
    route("/passkeys/options", "decide", registration_options, ["POST"]),
    route("/passkeys/register", "decide", register, ["POST"]),
    route("/passkeys/remove", "decide", remove, ["POST"]),
    route("/approvals/{rid}/passkey/challenge", "decide", challenge, ["POST"]),
    route("/approvals/{rid}/passkey/approve", "decide", decide("approve"), ["POST"]),
    route("/approvals/{rid}/passkey/deny", "decide", decide("deny"), ["POST"]),
]

__all__ = ["ROUTES", "relying_party"]
