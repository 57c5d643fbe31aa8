"""The release gate: whether a guarded body may run on the installed crewAI release.

`install()` (`_patch`) decides once, by the release's version and what the user says
(`_compat.untested_choice`), and sets the gate: open (a tested release, or
CREWAI_IDEMPOTENT_ALLOW_UNTESTED=1), shut with a refusal (outside the supported minors,
or the self-test turned off), or pending a verdict (a release newer than the newest
tested one, inside the supported minor). The guard (`_guard`) asks it before every
guarded call (`refuse_if_untested`); a pending gate loads `_verify` with the first call
(not in `import crewai`), whose `Gate` refuses until the release's self-test has passed
on this machine and then opens this one.

Beside the compatibility layer, not inside it: `_compat` says where each release keeps
what is patched and never imports the gate, the gate reads `_compat` (the user's choice)
and `_verify` (the verdicts), and the self-test (`offline/_selftest`), which installs the
integration, is run by `_verify` in another interpreter, never imported by it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .._errors import UnsupportedCrewAIVersion
from ._compat import ALLOW_UNTESTED_ENV

# -- what a refusal says -------------------------------------------------------------------


def untested_message(version: str, supported: str) -> str:
    return (
        f"crewai-idempotent is tested with crewai {supported}; crewai {version} is installed. "
        "The guard reaches into crewai internals this release may have changed, so tools "
        "flagged idempotent refuse to run (nothing was run); other tools and crews run as "
        "usual. `crewai-idempotent doctor --self-test` checks the guard against this "
        f"release; {ALLOW_UNTESTED_ENV}=1 installs the full guard on it."
    )


def unverified_off_message(version: str, newest: str) -> str:
    value = os.environ.get(ALLOW_UNTESTED_ENV, "")
    return (
        f"crewai {version} is newer than the newest release crewai-idempotent is tested with "
        f"({newest}), and {ALLOW_UNTESTED_ENV}={value.strip()!r} turns off its self-test, so "
        "tools flagged idempotent refuse to run (nothing was run); other tools and crews run "
        f"as usual. Without {ALLOW_UNTESTED_ENV} the release verifies itself; with it set to "
        "1 the full guard runs without a verdict."
    )


# -- the gate ------------------------------------------------------------------------------


class Verification:
    """What a guarded call asks while the release has no passing verdict: the first call
    loads `_verify` (not `import crewai`), whose gate raises until the verdict passes."""

    def __init__(self, version: str, newest: str) -> None:
        self.version = version
        self.newest = newest
        self._gate: Callable[[], None] | None = None

    def __call__(self) -> None:
        gate = self._gate
        if gate is None:
            from ._verify import Gate

            gate = self._gate = Gate(self.version, self.newest, done=self._passed)
        gate()

    def _passed(self) -> None:
        if _pending is self:
            set_pending(None)


_refusal: str | None = None
_pending: Verification | None = None


def set_refusal(message: str | None) -> None:
    global _refusal
    _refusal = message


def set_pending(verification: Verification | None) -> None:
    global _pending
    _pending = verification


def pending() -> Verification | None:
    return _pending


def refuse_if_untested() -> None:
    """Raise before a guarded body could run when the guard is not installed in full, or
    the release it is installed on has not been verified yet."""
    if _refusal is not None:
        raise UnsupportedCrewAIVersion(_refusal)
    verification = _pending
    if verification is not None:
        verification()
