"""What the sweeper's tests share: records left open the way a dead worker leaves them, and
reconcilers importable by path (so that a sweeper in another process can find them).

The answers the path-named reconcilers give are steered by the call's own arguments
(`answer`: found / absent / unknown / raise / garbage), so one reconciler serves every case
and nothing but the record tells a sweeper in another process what to say.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from crewai_idempotent import (
    Absent,
    CacheBackend,
    Event,
    Found,
    Ledger,
    OutcomeUnknown,
    Owner,
    Record,
    Status,
    Unknown,
)
from crewai_idempotent.ledger._results import encode
from crewai_idempotent.reconciliation import reconciles
from tests.support.faults.provider import Provider

#: Where `answer` reconcilers note each time they are asked (set by the tests).
ASKED_ENV = "RECONCILE_TEST_ASKED"


def answer(key: str, args: Any) -> Any:
    """Answers what the call's arguments say (`args["answer"]`); notes every ask."""
    asked = os.environ.get(ASKED_ENV)
    if asked:
        Provider(asked).record("asked", key=key, pid=os.getpid())
    said = (args or {}).get("answer", "found")
    if said == "found":
        return Found(f"receipt-{key}")
    if said == "absent":
        return Absent()
    if said == "unknown":
        return Unknown("the provider cannot tell yet")
    if said == "raise":
        raise ConnectionError("the provider is down")
    return 42  # garbage


@reconciles("registered_tool")
def registered(key: str, args: Any) -> Any:
    return Found(f"registered-{key}")


def explode(key: str, args: Any) -> Any:  # pragma: no cover - must never be called
    raise AssertionError("an untrusted reconciler path was imported and called")


def uncertain(
    ledger: Ledger,
    key: str,
    args: dict[str, Any] | None = None,
    *,
    reconcile: Any = "tests.support.reconcile:answer",
    tool: str | None = None,
) -> Record:
    """An UNCERTAIN record, as a body that lost its answer leaves it (the claim records the
    call, as a tool with a reconciler's does)."""
    options = ledger._call_options(None, None, None, reconcile, None, None, tool)

    def lost() -> Any:
        raise OutcomeUnknown("the provider did not answer")

    with contextlib.suppress(OutcomeUnknown):
        ledger._execute(key, lost, options.of_call("fp", args or {}))
    record = ledger.backend.get(key)
    assert record is not None and record.status is Status.UNCERTAIN, record
    return record


def stale_claim(
    backend: CacheBackend,
    key: str,
    args: dict[str, Any] | None = None,
    *,
    reconciler: str | None = "tests.support.reconcile:answer",
    tool: str | None = None,
    lapsed_s: float = 10.0,
) -> Record:
    """A PENDING record whose owner (another host's process, gone) stopped renewing its
    lease `lapsed_s` ago."""
    now = backend.now()
    owner = Owner("gone-host", 4242, "dead0001")
    call: dict[str, Any] = {"args": encode(args or {}), "ttl": None}
    if reconciler:
        call["reconciler"] = reconciler
    if tool:
        call["tool"] = tool
    record = Record(
        key, Status.PENDING, "fp", 1, 1, owner, 1, now - 60, now - 60, now - lapsed_s,
        history=(Event(now - 60, "claim", 1, owner.label),), call=call,
    )  # fmt: skip
    assert backend.insert(record) is None
    return record


def wait_for(check: Any, what: str, timeout: float = 60.0) -> None:
    """A hang guard, not a measurement: `check()` comes true, or the test fails."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.01)


def asked(path: Path) -> list[dict[str, Any]]:
    return Provider(path).effects(kind="asked") if path.exists() else []
