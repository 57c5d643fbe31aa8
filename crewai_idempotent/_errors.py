"""Every error the package raises, its warnings, and the one signal a tool body may raise
(`OutcomeUnknown`).

In one module so that each states its fact in one voice and pickles the same way (Celery
and multiprocessing send exceptions between processes). At run time this module imports
only `_units` (how an amount is printed) and `_error_base` (the base class and the two
errors `ledger/_record` raises, defined beneath it), so every other module may raise
from it.
Exceptions that never leave the code that raises them stay beside it: `Halt`, which
carries one of these errors out through crewAI to the kickoff (`integration/_call`), and
the loops' own signals (`_gatestore.Unchanged`, `_keys._NotPlain`, the self-test's
`CheckFailed`).
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any

# Beneath ledger/_record, which raises these two; re-exported: every error is imported here.
from ._error_base import CorruptRecord as CorruptRecord
from ._error_base import IdempotencyError as IdempotencyError
from ._error_base import LedgerUnavailable as LedgerUnavailable
from ._error_base import _rebuild
from ._units import format_money

if TYPE_CHECKING:
    from .ledger._record import Record


def shell_word(text: str) -> str:
    """`text` as one word a shell reads back unchanged: in single quotes, as keys are
    shown everywhere, and quoted by shlex when it holds a single quote itself (repr's
    quoting is Python's: a key holding `'` and `$` came out in double quotes, in which
    the shell expands `$`)."""
    return f"'{text}'" if "'" not in text else shlex.quote(text)


def command(ledger: str | None, *args: str) -> str:
    """A `crewai-idempotent` command line for a message: `--ledger URL` first when the
    ledger is not the CLI's default (`ledger` is its URL, passwords already `***`)."""
    words = ["crewai-idempotent"]
    if ledger:
        words += ["--ledger", shlex.quote(ledger)]
    return " ".join([*words, *args])


class InvalidIdempotencyKey(IdempotencyError, ValueError):
    """The key is empty, too long, or contains control characters; nothing ran."""


class IdempotencyKeyConflict(IdempotencyError):
    """The key was already used for different arguments; nothing ran."""

    def __init__(self, key: str, stored_fingerprint: str, fingerprint: str) -> None:
        self.key = key
        self.stored_fingerprint = stored_fingerprint
        self.fingerprint = fingerprint
        super().__init__(
            f"idempotency key {key!r} was already used with different arguments "
            f"(stored fingerprint {stored_fingerprint[:12]}, this call {fingerprint[:12]}); "
            "nothing was run"
        )


class OperationInProgress(IdempotencyError):
    """Another worker holds a live claim on the key and did not finish in time."""

    def __init__(self, key: str, record: Record, waited_s: float) -> None:
        self.key = key
        self.record = record
        self.waited_s = waited_s
        owner = record.owner.label if record.owner else "unknown owner"
        super().__init__(
            f"idempotency key {key!r} is being executed by {owner} "
            f"(token {record.token}); waited {waited_s:.1f} s, nothing was run"
        )


class OutcomeUncertain(IdempotencyError):
    """Whether the operation happened is unknown; nothing runs until it is resolved.

    `ledger`: the URL of the ledger holding the record (None: the CLI's default ledger),
    which the message's `resolve` command names with --ledger."""

    def __init__(
        self, key: str, record: Record | None, reason: str, *, ledger: str | None = None
    ) -> None:
        self.key = key
        self.record = record
        self.reason = reason
        self.ledger = ledger
        super().__init__(self._message())

    def _message(self) -> str:
        resolve = command(self.ledger, "resolve", shell_word(self.key), "--happened/--absent")
        return (
            f"outcome of idempotency key {self.key!r} is uncertain: {self.reason}. Nothing "
            "runs under this key until it is settled: reconcile it with the provider, then "
            f"`{resolve}`"
        )

    def name_ledger(self, ledger: str | None) -> None:
        """Say which ledger holds the record (its URL), once the raiser knows."""
        self.ledger = ledger
        self.args = (self._message(),)


class BodyFailed(IdempotencyError):
    """The guarded body raised (its exception is `__cause__`); nothing more will run.

    `status` is how the ledger recorded it: FAILED (the next attempt runs) or UNCERTAIN;
    `record` is the stored record, or None if it could not be stored or was taken over.
    Raised in place of the body's own exception only by `Ledger.execute(...,
    wrap_errors=True)`, for callers that act on the recorded outcome without a read.
    """

    def __init__(self, key: str, status: str, reason: str, record: Record | None) -> None:
        self.key = key
        self.status = status
        self.reason = reason
        self.record = record
        super().__init__(key, status, reason, record)

    def __str__(self) -> str:
        return f"the body of idempotency key {self.key!r} raised; recorded {self.status}: " + (
            self.reason
        )


class ResolutionRefused(IdempotencyError):
    """Only an uncertain record, or a pending one whose lease expired, can be resolved."""


class LedgerConfigurationError(IdempotencyError, ValueError):
    """A ledger setting cannot be used: a malformed URL, an unknown scheme or option, a path
    that cannot hold a ledger. Raised where the setting is given, or, for
    CREWAI_IDEMPOTENCY_URL, it stops the kickoff at the first guarded call; never handed to
    the agent as a tool error. Nothing was run."""


class SigningConfigurationError(LedgerConfigurationError):
    """A signing setting cannot be used: a key file that does not parse, that group or
    others may read or write, or that another user owns; a trusted keys file or line
    that does not parse, names an unknown algorithm or role, or that another user could
    change; a passkey line in a process without the `passkeys` extra. Raised where it is
    given (configure(), a `Signer`, the CLI) and, for a trusted keys file read again
    after it changed, where it is next used: never a silent unsigned mode. Nothing was
    run."""


class DecisionRefused(IdempotencyError):
    """A decision (an approval, a denial, a resolution, a cap) is not obeyed: unsigned,
    its signature does not verify, or the key that signed it is not trusted for it.

    `subject` names what it was for (the approval request, the idempotency key or the
    cap), `reason` says in one word what failed (`signing.REASONS`: unsigned, malformed,
    untrusted-key, algorithm, role, kind, identity, signature, credential, challenge,
    origin, rp-id, user-presence, user-verification, client-data; and from the guard,
    subject: a valid signature about another call or record, approvers: too few distinct
    trusted approvers), `detail` how, and
    `key_id` the key the signature named (None when there was none)."""

    def __init__(
        self,
        subject: str,
        reason: str,
        detail: str,
        *,
        kind: str = "decision",
        key_id: str | None = None,
    ) -> None:
        self.subject = subject
        self.reason = reason
        self.detail = detail
        self.kind = kind
        self.key_id = key_id
        super().__init__(f"{kind} for {subject} refused ({reason}): {detail}; it is not obeyed")


class GuardInactive(IdempotencyError, RuntimeError):
    """A tool that must only run guarded (`IdempotentTool`, `@idempotent_tool`) was called
    while the crewai integration is not installed; nothing was run."""


class OutcomeUnknown(Exception):
    """Raised by a tool body to say "the effect may have happened" (e.g. a provider timeout).

    The record becomes UNCERTAIN rather than FAILED, so nothing re-runs it blindly.
    """


class ApprovalRequired(IdempotencyError):
    """The call needs an operator's approval that it does not have yet; nothing was run.

    `request_id` names the stored request (`crewai-idempotent approvals approve ID`);
    `ledger` is the URL of the ledger holding it (None: the CLI's default ledger), which
    the suggested commands name with --ledger.
    """

    def __init__(
        self, key: str, request_id: str, tool: str, reason: str, *, ledger: str | None = None
    ) -> None:
        self.key = key
        self.request_id = request_id
        self.tool = tool
        self.reason = reason
        self.ledger = ledger
        approve = command(ledger, "approvals", "approve", request_id)
        deny = command(ledger, "approvals", "deny", request_id, "--reason", "...")
        super().__init__(
            f"tool {tool!r} (idempotency key {key!r}) needs approval: {reason}. Nothing was "
            f"run. Approve it with `{approve}` (or deny it with `{deny}`), then run the "
            "kickoff again"
        )


class ApprovalDenied(IdempotencyError):
    """An operator denied the approval this call needs; it never runs."""

    def __init__(self, key: str, request_id: str, by: str, reason: str) -> None:
        self.key = key
        self.request_id = request_id
        self.by = by
        self.reason = reason
        super().__init__(
            f"approval request {request_id} (idempotency key {key!r}) was denied by {by}"
            + (f": {reason}" if reason else "")
            + "; the call was not run and will not be"
        )


class SpendCapExceeded(IdempotencyError):
    """The call's amount would take a spend cap over its limit; nothing was run."""

    def __init__(
        self,
        key: str,
        cap: str,
        amount: int,
        currency: str,
        limit: int,
        spent: int,
        reserved: int,
    ) -> None:
        self.key = key
        self.cap = cap
        self.amount = amount
        self.currency = currency
        self.limit = limit
        self.spent = spent
        self.reserved = reserved

        def money(minor: int) -> str:
            return format_money(minor, currency)

        super().__init__(
            f"spend cap {cap!r} refuses idempotency key {key!r}: {money(amount)} on top of "
            f"{money(spent)} spent and {money(reserved)} reserved would exceed the limit of "
            f"{money(limit)}; nothing was run"
        )


class ApprovalNotFound(LookupError):
    """No approval request has this id."""


class ApprovalAlreadyDecided(ValueError):
    """Only a PENDING request can be approved or denied."""


class ApprovalMovedOn(ApprovalAlreadyDecided):
    """The decision named the round it was made on, and the request is in another one."""


class ApprovalNeedsAnother(ApprovalAlreadyDecided):
    """This identity has approved this round already: the rule wants distinct approvers."""


class UnsupportedCrewAIVersion(IdempotencyError, RuntimeError):
    """The installed crewai is outside the range this integration was tested with: a tool
    flagged idempotent refuses to run (nothing was run) rather than run half guarded.
    (A RuntimeError too, as it was before it became an IdempotencyError.)"""


class UnverifiedCrewAIVersion(UnsupportedCrewAIVersion):
    """The installed crewai is newer than the newest release tested, inside the supported
    minor, and its self-test has not passed on this machine (yet): nothing was run.

    `state` is "running" (the self-test runs now: try again once it is done), "failed"
    (it failed; `crewai-idempotent doctor` shows which checks), or "unavailable" (it
    cannot run here: the message says why)."""

    def __init__(self, message: str, state: str) -> None:
        super().__init__(message)
        self.state = state


class CacheUnusable(Exception):
    """The cache folder cannot hold verdicts (not writable, not this user's)."""


class ToolReportedFailure(Exception):
    """A body returned crewai's `ToolFailure` (MCP `isError`, crewai >= 1.15.9): recorded
    as FAILED, so the next call runs again instead of replaying the failure for ever; the
    caller still gets the ToolFailure back, as crewai expects."""

    def __init__(self, failure: Any) -> None:
        super().__init__(getattr(failure, "message", str(failure)))
        self.failure = failure


class DeliveryFailed(Exception):
    """One try of a notification channel did not deliver: why, the HTTP status if there
    was one, and how long the receiver asked us to wait (Retry-After)."""

    def __init__(
        self, reason: str, *, status: int | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(reason)
        self.reason, self.status, self.retry_after = reason, status, retry_after

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class AccountError(ValueError):
    """A change to the console's accounts that cannot be made (the message says why)."""


class ListenError(OSError):
    """The console cannot listen where it was told (the message says where and why)."""


# -- warnings ---------------------------------------------------------------------------


class PostgresDurabilityWarning(UserWarning):
    """The PostgreSQL server may lose a commit it acknowledged (see docs/backends.md)."""


class RedisDurabilityWarning(UserWarning):
    """The Redis server does not persist what the ledger writes (see docs/backends.md)."""
