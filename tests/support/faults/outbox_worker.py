"""A worker process that makes one transition and stops at one of its store writes, to be
SIGKILLed there (tests/notifications/test_notify_processes.py):

    python -m tests.support.faults.outbox_worker --ledger URL --scenario uncertain \
        --stop-at 2 --when before --marker /tmp/x/at

Every write the transition makes (insert, replace, delete) is counted; at write
`--stop-at`, before or after it reaches the store, the worker writes `--marker` and
blocks until SIGKILL. A transition that makes fewer writes ends normally and writes
`--report` (how many writes it made), which tells the test it has tried every step.

The scenarios, each on a store the test prepared (`prepare`):

* `requested`: a gated call asks for approval (a new request);
* `approved`: the pending request is approved;
* `uncertain`: a body's outcome is unknown (the owner records UNCERTAIN);
* `stale`: a caller finds a claim whose owner died and marks it UNCERTAIN;
* `resolved`: an operator resolves the uncertain record;
* `threshold`: a reservation takes a cap window past its warning share.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

from crewai_idempotent import (
    CacheBackend,
    Ledger,
    OutcomeUncertain,
    OutcomeUnknown,
    Owner,
    Record,
    Status,
    backend_from_url,
)
from crewai_idempotent._errors import ApprovalRequired
from crewai_idempotent.gates._approvals import Approvals, request_id
from crewai_idempotent.gates._plan import Plan
from crewai_idempotent.gates._spend import Money, SpendCap, Where
from crewai_idempotent.ledger._record import Event

SCENARIOS = ("requested", "approved", "uncertain", "stale", "resolved", "threshold")
KEY = "pay:INV-7"
PLAN = Plan(
    tool="pay_invoice", fingerprint="fp-7", approval=True, approval_reason="big",
    summary={"invoice": "INV-7", "amount_cents": 90_000}, where=Where(kickoff="k1"),
)  # fmt: skip
CAP = SpendCap(100_00, "EUR", per="total", warn_at=0.5)


def _threshold_plan(key: str) -> Plan:
    return Plan(
        tool="pay", fingerprint=f"fp-{key}", amount=Money(30_00, "EUR"), caps=[("crew", CAP)]
    )


class Stepping(CacheBackend):
    """`inner`, stopping (marker, then blocked) at write number `stop_at`."""

    def __init__(self, inner: CacheBackend, stop_at: int, when: str, marker: str | None) -> None:
        self.inner, self.stop_at, self.when, self.marker = inner, stop_at, when, marker
        self.read_first, self.host_clock = inner.read_first, inner.host_clock
        self.writes = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.inner.url  # type: ignore[attr-defined,no-any-return]

    def now(self) -> float:
        return self.inner.now()

    def now_blocks(self) -> bool:
        return self.inner.now_blocks()

    def _write(self, what: str, fn: Any, *args: Any) -> Any:
        with self.lock:
            self.writes += 1
            number = self.writes
        if number == self.stop_at and self.when == "before":
            self._stop(what, number)
        result = fn(*args)
        if number == self.stop_at and self.when == "after":
            self._stop(what, number)
        return result

    def _stop(self, what: str, number: int) -> None:
        if self.marker:
            temp = Path(f"{self.marker}.tmp")
            temp.write_text(json.dumps({"pid": os.getpid(), "write": number, "what": what}))
            os.replace(temp, self.marker)
        threading.Event().wait()  # until SIGKILL

    def insert(self, record: Record) -> Record | None:
        return self._write(f"insert {record.key}", self.inner.insert, record)  # type: ignore[no-any-return]

    def replace(self, current: Record, new: Record) -> bool:
        return self._write(f"replace {current.key}", self.inner.replace, current, new)  # type: ignore[no-any-return]

    def delete(self, current: Record) -> bool:
        return self._write(f"delete {current.key}", self.inner.delete, current)  # type: ignore[no-any-return]

    def get(self, key: str) -> Record | None:
        return self.inner.get(key)

    def peek(self, key: str) -> Any:
        return self.inner.peek(key)

    def scan(self, status: Status | None = None) -> Any:
        return self.inner.scan(status)

    def scan_prefix(self, prefix: str) -> Any:
        return self.inner.scan_prefix(prefix)


def _unknown() -> Any:
    raise OutcomeUnknown("the gateway timed out after the charge")


def prepare(backend: CacheBackend, scenario: str) -> None:
    """The state the scenario's transition starts from (written in the test's process)."""
    ledger = Ledger(backend)
    if scenario == "approved":
        with contextlib.suppress(ApprovalRequired):
            ledger.run(KEY, lambda: "paid", fingerprint=PLAN.fingerprint, stage=PLAN)
    elif scenario == "stale":
        now = backend.now()
        owner = Owner("dead-host", 999_999, "deadbeef")
        stale = Record(
            KEY, Status.PENDING, "fp", 1, 1, owner, 1, now - 60, now - 60, now - 30,
            history=(Event(now - 60, "claim", 1, owner.label),),
        )  # fmt: skip
        assert backend.insert(stale) is None
    elif scenario == "resolved":
        with contextlib.suppress(OutcomeUnknown):
            ledger.run(KEY, _unknown)
    elif scenario == "threshold":
        ledger.run("pay:A", lambda: "a", fingerprint="fp-pay:A", stage=_threshold_plan("pay:A"))


def happened(backend: CacheBackend, scenario: str) -> bool:
    """Whether the scenario's transition is in the store (read by the test afterwards)."""
    if scenario in ("requested", "approved"):
        try:
            state = Approvals(backend).get(request_id(KEY, PLAN.fingerprint)).state.value
        except LookupError:
            return False
        return state == ("PENDING" if scenario == "requested" else "APPROVED")
    record = backend.get(
        KEY if scenario != "threshold" else "crewai-idempotent/spend/crew/total-EUR/total"
    )
    if record is None:
        return False
    if scenario in ("uncertain", "stale"):
        return record.status is Status.UNCERTAIN
    if scenario == "resolved":
        return record.status is Status.COMMITTED
    from crewai_idempotent.ledger._results import decode

    return 0.5 in (decode(record.result).get("warned") or ())


def run(ledger_url: str, scenario: str, stop_at: int, when: str, marker: str | None) -> int:
    backend = Stepping(backend_from_url(ledger_url), stop_at, when, marker)
    ledger = Ledger(backend, lease_s=1.0)
    if scenario == "requested":
        with contextlib.suppress(ApprovalRequired):
            ledger.run(KEY, lambda: "paid", fingerprint=PLAN.fingerprint, stage=PLAN)
    elif scenario == "approved":
        Approvals(backend).approve(request_id(KEY, PLAN.fingerprint), by="ops", reason="ok")
    elif scenario == "uncertain":
        with contextlib.suppress(OutcomeUnknown):
            ledger.run(KEY, _unknown)
    elif scenario == "stale":
        with contextlib.suppress(OutcomeUncertain):
            ledger.run(KEY, lambda: "never", fingerprint="fp")
    elif scenario == "resolved":
        ledger.resolve(KEY, result="ch_7", by="ops", reason="found it at the provider")
    elif scenario == "threshold":
        ledger.run("pay:B", lambda: "b", fingerprint="fp-pay:B", stage=_threshold_plan("pay:B"))
    return backend.writes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.faults.outbox_worker")
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--scenario", required=True, choices=SCENARIOS)
    parser.add_argument("--stop-at", type=int, required=True)
    parser.add_argument("--when", choices=("before", "after"), default="before")
    parser.add_argument("--marker")
    parser.add_argument("--report")
    args = parser.parse_args(argv)
    writes = run(args.ledger, args.scenario, args.stop_at, args.when, args.marker)
    if args.report:
        Path(args.report).write_text(json.dumps({"writes": writes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
