"""Signed resolutions: the decision a resolution makes, signed and stored on its record,
and the check a ledger with trusted keys makes before it obeys one.

A resolution (an operator's `resolve`, a sweeper's settlement) is a `signing.Decision`:
found (the record's key, its fencing token and the digest of the receipt it stores) or
absent (the key and the token). `signed` makes it and its signature envelope; the record
keeps both with the event that made the resolution (`Record.signed`, bound into the
chain) and marks its status as that resolution's (`Record.resolved`).

`check` is what the machine asks before it obeys a resolution, and only then: before a
takeover of a FAILED record that a resolution settled as absent, and before a replay of a
COMMITTED record a resolution settled as found; never on an ordinary replay. The
signature must verify against the ledger's trusted keys (configured outside the ledger)
with the role the decision needs (resolve, or sweeper for a sweeper's), and the decision
must be about this record as it is: its key, its token, its state and, for found, the
receipt it stores. Anything else is `DecisionRefused`, naming the key and the command
that settles it with a signature; nothing runs.

The signing package is loaded only here, and `cryptography` only when a signature is
made or checked: a ledger without trusted keys or signers never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._errors import DecisionRefused, command, shell_word
from ._record import Record, Status

if TYPE_CHECKING:
    from ..signing._keyfile import Signer
    from ..signing._trusted import TrustedKeys

# The events that make a record FAILED by a resolution: an operator's (resolve) or a
# sweeper's (absent). A FAILED record whose last event is one of these is checked even
# when its mark is missing (a mark stripped from the document).
RESOLVING = ("resolve", "absent")


def signed(
    record: Record,
    *,
    absent: bool,
    result: Any,
    signer: Signer,
    via: str,
    reason: str,
    at: float,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The decision settling `record` (absent, or found with the encoded receipt
    `result`), made by `signer`'s identity `via` somewhere at `at` for `reason`, and its
    signature: both as JSON, as a record stores them. Raises `ValueError` for a reason or
    key a decision cannot hold."""
    from ..signing._decision import Decision, receipt_digest

    if absent:
        decision = Decision.absent(
            key=record.key, token=record.token, by=signer.identity, via=via, at=at,
            reason=_printable(reason),
        )  # fmt: skip
    else:
        decision = Decision.found(
            key=record.key, token=record.token, receipt=receipt_digest(result),
            by=signer.identity, via=via, at=at, reason=_printable(reason),
        )  # fmt: skip
    return decision.to_json(), signer.sign(decision).to_json()


def _printable(reason: str) -> str:
    """A reason as a decision holds it: one line (a decision's reason has no controls)."""
    return "".join(c if c >= " " and c != "\x7f" else " " for c in reason)[:2000]


def needs_check(record: Record) -> bool:
    """Whether `record`'s status comes from a resolution that must be verified before it
    is obeyed: marked so, or FAILED by a resolving event."""
    if record.resolved is not None:
        return True
    history = record.history
    return record.status is Status.FAILED and bool(history) and history[-1].kind in RESOLVING


def check(record: Record, trusted: TrustedKeys, ledger: str | None = None) -> None:
    """Return if the resolution `record`'s status comes from is signed by a key
    `trusted` holds for it and is about this record as stored; else raise
    `DecisionRefused` naming the key, what failed and the command that settles it with a
    signature (`ledger`: its --ledger URL, None for the CLI's default). Raises
    `SigningConfigurationError` if a trusted keys file changed and no longer passes."""
    from ..signing._decision import Decision, receipt_digest
    from ..signing._verify import verify

    subject = f"idempotency key {record.key!r}"
    kind = "resolve-absent" if record.status is Status.FAILED else "resolve-found"
    hint = _hint(record, ledger)
    entry = record.resolution
    if entry is None:
        raise DecisionRefused(
            subject, "unsigned",
            f"its {record.status.value} status comes from a resolution that carries no "
            f"signature, and this ledger trusts only signed ones; nothing was run. {hint}",
            kind=kind,
        )  # fmt: skip
    _, decision_doc, signature = entry
    try:
        verify(decision_doc, signature, trusted)
    except DecisionRefused as refused:
        raise DecisionRefused(
            subject, refused.reason, f"{refused.detail}; nothing was run. {hint}",
            kind=refused.kind, key_id=refused.key_id,
        ) from None  # fmt: skip
    decision = Decision.from_json(decision_doc)  # verify read it already
    wrong = None
    if decision.key != record.key:
        wrong = f"it settles idempotency key {decision.key!r}, not this one"
    elif decision.token != record.token:
        wrong = f"it settles the record under token {decision.token}, not {record.token}"
    elif decision.state != record.status.value:
        wrong = f"it settles the record as {decision.state}, not {record.status.value}"
    elif decision.receipt is not None and decision.receipt != receipt_digest(record.result):
        wrong = "it settles the record with another receipt than the one stored"
    if wrong is not None:
        raise DecisionRefused(
            subject, "subject",
            f"the signed decision by {decision.by} is not about this record as stored: "
            f"{wrong}; nothing was run. {hint}",
            kind=decision.kind,
        )  # fmt: skip


def _hint(record: Record, ledger: str | None) -> str:
    resolve = command(
        ledger, "resolve", shell_word(record.key), "--happened/--absent", "--reason", "TEXT",
        "--key", "FILE",
    )  # fmt: skip
    return (
        f"Check the provider, then settle it with a resolution signed by a trusted key: `{resolve}`"
    )


def refuse_unsigned(key: str, trusted: TrustedKeys) -> DecisionRefused:
    """The error for a resolution about to be made without a signer on a ledger that
    trusts only signed ones. Raises nothing."""
    where = trusted.path or "the lines configured"
    return DecisionRefused(
        f"idempotency key {key!r}", "unsigned",
        f"this ledger trusts only signed resolutions (trusted keys: {where}): give a signer "
        "(Ledger.resolve(..., signer=Signer.from_file(PATH)), or `crewai-idempotent resolve "
        "... --key FILE`); nothing was written",
        kind="resolve",
    )  # fmt: skip
