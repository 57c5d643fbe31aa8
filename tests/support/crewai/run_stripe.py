"""Run Stripe payment crews in a fresh interpreter: `python -m tests.support.crewai.run_stripe`.

SPEC, its one argument, is JSON: {"runs": [run, ...]}; each run is a dict with invoice,
amount, native (bool), lease_s, and optionally hold (a path) and when ("before" or
"after" the charge: the tool writes `hold` there and sleeps, to be killed), tool (its
name, "pay_invoice"), key (its template, "pay:{invoice}") and reconcile (false: the tool
names no reconciler). By default the tool names its reconciler by import path
(`stripe_tools.PATH`), so its claims record it for a sweeper in another process. Runs
with `hold` start together in threads; the others run one after another, one JSON line
each with the kickoff's output or its exception. The ledger comes from
CREWAI_IDEMPOTENCY_URL, the fake Stripe server from FAKE_STRIPE_URL.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

from crewai.tools import tool

from .crews import payment_crew, scripted
from .stripe_tools import PATH, pay


def _tool(run: dict[str, Any]) -> Any:
    options: dict[str, Any] = {"reconcile": PATH} if run.get("reconcile", True) else {}

    @tool(
        run.get("tool", "pay_invoice"), idempotent=True,
        idempotency_key=run.get("key", "pay:{invoice}"), lease_s=run["lease_s"], wait_s=5,
        **options,
    )  # fmt: skip
    def pay_invoice(invoice: str, amount: int, idempotency_key: str = "") -> str:
        """Charge `amount` (cents) for `invoice` through Stripe. Returns the PaymentIntent id."""
        return pay(invoice, amount, idempotency_key, run.get("hold"), run.get("when", ""))

    return pay_invoice


def run_one(run: dict[str, Any]) -> dict[str, Any]:
    args = {"invoice": run["invoice"], "amount": run["amount"]}
    llm = scripted(run.get("native", False), [(run.get("tool", "pay_invoice"), args)])
    crew, _ = payment_crew([_tool(run)], llm, description=f"Pay invoice {run['invoice']}.")
    result: dict[str, Any] = {"invoice": run["invoice"]}
    try:
        result["raw"] = crew.kickoff().raw
    except Exception as exc:  # noqa: BLE001 - reported to the test as data
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
    return result


def main(spec: dict[str, Any]) -> None:
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
