"""Run payment crews in a fresh interpreter: `python -m tests.support.crewai.run_payment SPEC`.

SPEC is JSON: {"runs": [run, ...]}; each run is a dict with
  native (bool), provider (path of the charges file), invoice, reject, fail_times,
  key (template; default: the tool name and the fingerprint of its arguments),
  lease_s, wait_s,
  hold (path: after charging, create it and sleep, to be killed there),
  reconcile (bool: look the charge up at the provider when the outcome is unknown).
Runs with `hold` start together in threads (so one SIGKILL catches all of them in the
tool); the others run one after another. One JSON line per run is printed, with the
kickoff's output or its exception. The ledger comes from CREWAI_IDEMPOTENCY_URL.

This script never imports crewai_idempotent (unless `reconcile` asks for Found/Absent):
the installed package must activate itself when crewai is imported.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

IMPORTED_BEFORE_CREWAI = "crewai_idempotent" in sys.modules

from crewai.tools import tool  # noqa: E402

from .crews import payment_crew, scripted  # noqa: E402
from .provider import FakeProvider  # noqa: E402


def _reconciler(provider: FakeProvider) -> Any:
    from crewai_idempotent import Absent, Found

    def reconcile(key: str, args: dict[str, Any]) -> Any:
        effect = provider.find("charge", invoice=args["invoice"])
        return Found(effect["receipt"]) if effect else Absent()

    return reconcile


def _charge_tool(run: dict[str, Any]) -> Any:
    provider = FakeProvider(run["provider"])
    hold = run.get("hold")
    options: dict[str, Any] = {"idempotent": True}
    for name in ("key", "lease_s", "wait_s"):
        if run.get(name) is not None:
            options["idempotency_key" if name == "key" else name] = run[name]
    if run.get("reconcile"):
        options["reconcile"] = _reconciler(provider)

    @tool("charge_card", **options)
    def charge_card(amount: int, recipient: str, invoice: str = "inv-1") -> str:
        """Charge `amount` to `recipient` for `invoice`. Returns the receipt id."""
        receipt = provider.charge(amount, recipient, invoice=invoice)
        if hold:
            Path(hold).write_text(receipt)
            time.sleep(3600)  # killed here: after the charge, before the commit
        return receipt

    return charge_card


def run_one(run: dict[str, Any]) -> dict[str, Any]:
    args = {"amount": 5, "recipient": "alice", "invoice": run.get("invoice", "inv-1")}
    llm = scripted(
        run.get("native", False), [("charge_card", args)], fail_times=run.get("fail_times", 0)
    )
    crew, _ = payment_crew([_charge_tool(run)], llm, reject=run.get("reject", 0))
    result: dict[str, Any] = {"native": run.get("native", False)}
    try:
        result["raw"] = crew.kickoff().raw
    except Exception as exc:  # noqa: BLE001 - reported to the test as data
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
    result["attempts"] = llm.attempts
    return result


def main(spec: dict[str, Any]) -> None:
    header = {
        "imported_before_crewai": IMPORTED_BEFORE_CREWAI,
        "imported_after_crewai": "crewai_idempotent" in sys.modules,
    }
    print(json.dumps(header), flush=True)
    held = [r for r in spec["runs"] if r.get("hold")]
    threads = [threading.Thread(target=run_one, args=(r,), daemon=True) for r in held]
    for thread in threads:
        thread.start()
    for run in spec["runs"]:
        if not run.get("hold"):
            print(json.dumps(run_one(run)), flush=True)
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
