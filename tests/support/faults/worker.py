"""A worker process that runs one guarded charge and can stop at a named point to be killed.

    python -m tests.support.faults.worker --ledger sqlite:////tmp/x/ledger.db --provider /tmp/x/fx \
        --key order-1 --pause-at after_effect --marker /tmp/x/order-1.at

The points, in the order a run reaches them:

* ``after_claim``: the claim has landed; the body has not started (a "claim" listener);
* ``before_effect``: inside the body, before the provider is charged;
* ``after_effect``: the provider was charged; the commit has not been written;
* ``after_commit``: the commit has landed; `execute` has not returned (a "commit" listener).

At ``--pause-at`` the worker writes ``--marker`` (atomically) and blocks: forever, or until
the ``--release`` file exists. Ledger listeners run synchronously in the worker's thread, so
blocking in one stops the worker exactly between two ledger steps; the lease keeper thread
keeps running, as it would in a real slow worker. ``--signal-at`` writes the marker and
carries on. ``--started FILE`` is written just before the guarded call begins (a waiter
is about to ask the ledger). The outcome is written as JSON to ``--report`` (and printed).

With ``--plan FILE`` the worker runs many keys at once, each in its own thread and each
stopping at its own point (see `run_plan`): a process that dies with many calls in flight.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crewai_idempotent import (
    Absent,
    Found,
    IdempotencyError,
    Ledger,
    OutcomeUncertain,
    Record,
    Unknown,
    backend_from_url,
    fingerprint,
)
from tests.support.faults.provider import Provider

POINTS = ("after_claim", "before_effect", "after_effect", "after_commit")


@dataclass(frozen=True)
class Spec:
    """Everything one worker run needs; also its command line (`argv`)."""

    ledger: str
    provider: str
    key: str
    report: str | None = None
    marker: str | None = None
    pause_at: str | None = None
    release: str | None = None
    signal_at: str | None = None
    reconcile: bool = False
    on_stale: str | None = None
    lease_s: float = 0.5
    wait_s: float = 30.0
    work_s: float = 0.0
    amount: int = 100
    plan: str | None = None  # a JSON file: many keys at once (`run_plan`)
    started: str | None = None  # written just before the guarded call begins

    def argv(self) -> list[str]:
        args: list[str] = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            flag = "--" + field.name.replace("_", "-")
            if isinstance(value, bool):
                if value:
                    args.append(flag)
            elif value is not None:
                args += [flag, str(value)]
        return args

    @property
    def args(self) -> dict[str, Any]:
        return tool_args(self.key, self.amount)


def tool_args(key: str, amount: int) -> dict[str, Any]:
    """The tool's arguments: what the fingerprint covers and the reconciler receives."""
    return {"order": key, "amount": amount}


def reconciler(provider: Provider, calls: list[str]) -> Any:
    """Ask the provider whether the charge for `key` happened (what a real tool would do
    with the idempotency key it passed to the provider)."""

    def reconcile(key: str, args: Any) -> Found | Absent | Unknown:
        receipts = provider.receipts(key)
        verdict: Found | Absent | Unknown
        if not receipts:
            verdict = Absent()
        elif len(receipts) == 1:
            verdict = Found(receipts[0])
        else:
            verdict = Unknown(f"the provider shows {len(receipts)} charges for {key!r}")
        calls.append(type(verdict).__name__)
        return verdict

    return reconcile


def run(spec: Spec) -> dict[str, Any]:
    """Run the guarded charge once and return what happened (also written to spec.report);
    with `spec.plan`, run every key of the plan at once (`run_plan`)."""
    if spec.plan:
        return run_plan(spec)
    for point in (spec.pause_at, spec.signal_at):
        if point is not None and point not in POINTS:
            raise ValueError(f"unknown point {point!r}; known: {', '.join(POINTS)}")
    provider = Provider(spec.provider)
    ledger = Ledger(backend_from_url(spec.ledger), lease_s=spec.lease_s, wait_s=spec.wait_s)

    def reach(key: str, point: str) -> None:
        if point == spec.signal_at:
            _mark(spec, point)
        if point == spec.pause_at:
            _mark(spec, point)
            _hold(spec.release)

    ledger.add_listener(_listener(lambda key: key == spec.key, reach))
    try:
        report = _call(spec, ledger, provider, spec.key, spec.reconcile, reach)
    finally:
        ledger.close()
    if spec.report:
        _write_atomically(Path(spec.report), json.dumps(report))
    return report


def run_plan(spec: Spec) -> dict[str, Any]:
    """Every key of the plan file ({key: {"pause_at": point or null, "reconcile": bool}})
    in a thread of its own, on one ledger. Once every pausing key has reached its point the
    marker is written ({"keys": [...]}) and they stay there until SIGKILL: one process dying
    with many calls in flight. Keys without a point run to the end; the report maps each key
    to what its call did."""
    plan: dict[str, dict[str, Any]] = json.loads(Path(str(spec.plan)).read_text("utf-8"))
    for key, step in plan.items():
        if step.get("pause_at") not in (None, *POINTS):
            raise ValueError(f"{key}: unknown point {step['pause_at']!r}")
    provider = Provider(spec.provider)
    ledger = Ledger(backend_from_url(spec.ledger), lease_s=spec.lease_s, wait_s=spec.wait_s)
    pausing = {key for key, step in plan.items() if step.get("pause_at")}
    arrived: list[str] = []
    lock = threading.Lock()

    def reach(key: str, point: str) -> None:
        if point != plan[key].get("pause_at"):
            return
        with lock:
            arrived.append(key)
            if len(arrived) == len(pausing) and spec.marker:
                note = {"pid": os.getpid(), "keys": arrived, "at": time.time()}
                _write_atomically(Path(spec.marker), json.dumps(note))
        _hold(spec.release)

    ledger.add_listener(_listener(lambda key: key in plan, reach))
    reports: dict[str, Any] = {}

    def call(key: str) -> None:
        reports[key] = _call(spec, ledger, provider, key, bool(plan[key].get("reconcile")), reach)

    threads = [threading.Thread(target=call, args=(key,), daemon=True) for key in plan]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ledger.close()
    if spec.report:
        _write_atomically(Path(spec.report), json.dumps(reports))
    return reports


def _listener(mine: Callable[[str], bool], reach: Callable[[str, str], None]) -> Any:
    """Ledger events of this process's own claims and commits, as points reached."""
    me = os.getpid()

    def listener(kind: str, record: Record) -> None:
        if not mine(record.key) or record.owner is None or record.owner.pid != me:
            return
        if kind == "claim":
            reach(record.key, "after_claim")
        elif kind == "commit":
            reach(record.key, "after_commit")

    return listener


def _call(
    spec: Spec,
    ledger: Ledger,
    provider: Provider,
    key: str,
    reconcile: bool,
    reach: Callable[[str, str], None],
) -> dict[str, Any]:
    """One guarded charge of `key`; what it returned or raised, and the record it left."""
    calls: list[str] = []
    args = tool_args(key, spec.amount)

    def charge() -> str:
        reach(key, "before_effect")
        if spec.work_s:
            time.sleep(spec.work_s)
        receipt = provider.charge(key)
        reach(key, "after_effect")
        return receipt

    report: dict[str, Any] = {"key": key, "pid": os.getpid(), "started": time.time()}
    if spec.started:
        _write_atomically(Path(spec.started), json.dumps(report))
    try:
        outcome = ledger.execute(
            key,
            charge,
            fingerprint=fingerprint(args),
            args=args,
            reconcile=reconciler(provider, calls) if reconcile else None,
            on_stale=spec.on_stale,  # type: ignore[arg-type]
        )
    except IdempotencyError as exc:
        record = getattr(exc, "record", None)
        report.update(
            outcome="error",
            error_type=type(exc).__name__,
            error=str(exc),
            record=json.loads(record.to_json()) if record is not None else None,
            needs_operator=isinstance(exc, OutcomeUncertain)
            and record is not None
            and record.needs_operator,
        )
    else:
        report.update(
            outcome="replayed" if outcome.replayed else "ran",
            value=outcome.value,
            record=json.loads(outcome.record.to_json()),
        )
    report.update(reconcile_calls=calls, finished=time.time())
    return report


def _mark(spec: Spec, point: str) -> None:
    if spec.marker:
        note = json.dumps({"pid": os.getpid(), "point": point, "at": time.time()})
        _write_atomically(Path(spec.marker), note)


def _hold(release: str | None) -> None:
    if release is None:
        threading.Event().wait()  # until SIGKILL
        return
    while not os.path.exists(release):
        time.sleep(0.005)


def _write_atomically(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(text, "utf-8")
    os.replace(temp, path)


def child(spec: Spec, log: str | None = None) -> None:
    """Entry point for a worker started by a fork server: its own log, then `run`."""
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    run(spec)


def _parse(argv: list[str] | None) -> Spec:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.faults.worker", description=__doc__
    )
    parser.add_argument("--ledger", required=True, help="ledger URL (sqlite:///…, file:///…)")
    parser.add_argument("--provider", required=True, help="the fake provider's effect file")
    parser.add_argument("--key", required=True)
    parser.add_argument("--report")
    parser.add_argument("--marker")
    parser.add_argument("--pause-at", choices=POINTS)
    parser.add_argument("--release", help="with --pause-at: continue once this file exists")
    parser.add_argument("--signal-at", choices=POINTS)
    parser.add_argument("--reconcile", action="store_true")
    parser.add_argument("--on-stale", choices=("uncertain", "reconcile", "retry"))
    parser.add_argument("--lease-s", type=float, default=0.5)
    parser.add_argument("--wait-s", type=float, default=30.0)
    parser.add_argument("--work-s", type=float, default=0.0)
    parser.add_argument("--amount", type=int, default=100)
    parser.add_argument("--plan", help="a JSON file of keys to run at once (see run_plan)")
    parser.add_argument("--started", help="a file written just before the guarded call")
    return Spec(**vars(parser.parse_args(argv)))


def _sleep_where_faketime_cannot() -> None:
    """Under libfaketime with FAKETIME_DONT_FAKE_MONOTONIC (tests/process/test_clock_steps.py),
    Debian's 0.9.10 breaks `clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`, which is
    Python 3.11's `time.sleep`: it raises EINVAL (wolfcw/libfaketime#426). A real clock
    step does no such thing, so such a worker sleeps on an Event, which waits on the same
    monotonic clock through a call libfaketime leaves alone."""
    if "FAKETIME" not in os.environ:
        return
    try:
        time.sleep(0)
        time.sleep(0.0001)
    except OSError:
        time.sleep = lambda seconds: threading.Event().wait(max(seconds, 0.0)) and None


def main(argv: list[str] | None = None) -> int:
    _sleep_where_faketime_cannot()
    report = run(_parse(argv))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
