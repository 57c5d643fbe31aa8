"""A payment flow with `@persist`, as the flow tests run it in this process and in a
fresh one (`run_flow`): its first step kicks off a crew whose guarded tool charges the
fake provider, its second ships what was paid for.

`hold` (a path): the second step writes the flow's state id and the receipt there, as
JSON, and sleeps, to be killed after the charge is committed and the first step's state
is persisted. The tool's key is a template (`pay:{flow}:{invoice}` in the docs).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from crewai.flow.flow import Flow, listen, start
from crewai.flow.persistence import SQLiteFlowPersistence, persist

from .crews import charge_tool, payment_crew, scripted
from .provider import FakeProvider

INVOICE = {"amount": 5, "recipient": "alice", "invoice": "inv-flow"}


def payment_flow(
    provider: FakeProvider, states: Path, key: str, *, native: bool = True, hold: str = ""
) -> type[Flow]:  # type: ignore[type-arg]
    """A Flow class persisting its state in the SQLite file `states`."""
    charge = charge_tool(provider, idempotent=True, idempotency_key=key)

    @persist(SQLiteFlowPersistence(str(states)))
    class PaymentFlow(Flow):  # type: ignore[type-arg]
        @start()
        def pay(self) -> str:
            crew, _ = payment_crew([charge], scripted(native, [("charge_card", INVOICE)]))
            return str(crew.kickoff().raw)

        @listen(pay)
        def ship(self, receipt: str) -> str:
            if hold:
                Path(hold).write_text(json.dumps({"id": self.state["id"], "receipt": receipt}))
                time.sleep(3600)  # killed here: the charge committed, the flow not done
            return receipt

    return PaymentFlow
