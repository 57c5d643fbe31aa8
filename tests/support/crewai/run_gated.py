"""Run one gated payment crew in a fresh interpreter, as a worker would:
`python -m tests.support.crewai.run_gated SPEC`.

SPEC is JSON: provider (the charges file), invoice, amount_cents, memo (optional),
approvers (distinct approvers the payment needs; default 1), and mode:
  "pay"      pay_invoice needs approval (approval=True) and counts against a daily cap;
  "unknown"  record_payment charges, then loses the provider's answer (OutcomeUnknown):
             the record turns UNCERTAIN until someone resolves it.
One JSON line is printed: the kickoff's output ("raw") or its exception ("error",
"message"). The ledger comes from CREWAI_IDEMPOTENCY_URL.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from crewai.tools import tool

from crewai_idempotent import Money, OutcomeUnknown, SpendCap

from .crews import payment_crew, scripted
from .provider import FakeProvider


def _tools(spec: dict[str, Any]) -> list[Any]:
    charges = FakeProvider(spec["provider"])

    @tool(
        "pay_invoice",
        idempotent=True,
        approval=True,
        approvers=int(spec.get("approvers", 1)),
        spend=lambda args: Money(args["amount_cents"], "EUR"),
        caps=[SpendCap(5_000_00, "EUR", per="day")],
    )
    def pay_invoice(invoice: str, amount_cents: int, memo: str = "") -> str:
        """Pay `amount_cents` (euro cents) for `invoice`. Returns the payment id."""
        return charges.charge(amount_cents, "supplier", invoice=invoice)

    @tool("record_payment", idempotent=True)
    def record_payment(invoice: str, amount_cents: int, memo: str = "") -> str:
        """Record a payment at the provider. Returns the payment id."""
        charges.charge(amount_cents, "supplier", invoice=invoice)
        raise OutcomeUnknown("the provider took the payment but its answer was lost")

    return [pay_invoice, record_payment]


def main(spec: dict[str, Any]) -> None:
    args = {"invoice": spec["invoice"], "amount_cents": spec["amount_cents"]}
    if spec.get("memo") is not None:
        args["memo"] = spec["memo"]
    name = "record_payment" if spec.get("mode") == "unknown" else "pay_invoice"
    llm = scripted(True, [(name, args)])
    crew, _ = payment_crew(
        _tools(spec), llm, name="Payables", description=f"Pay invoice {spec['invoice']}."
    )
    result: dict[str, Any] = {}
    try:
        result["raw"] = crew.kickoff().raw
    except Exception as exc:  # noqa: BLE001 - reported to the test as data
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
    result["prompts"] = llm.prompts[-1:]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
