"""A worker's first guarded calls on a crewAI release newer than the newest tested:
`python -m tests.support.crewai.release_probe SPEC`.

SPEC is JSON: provider (the charges file), invoice, ledger (URL), cache (the verdict
folder, to see what the body saw), ready and go (barrier files: create `ready`, then
wait for `go`, so that several workers make their first call together), crew (bool: a
crew kickoff instead of a direct tool call), patience_s (how long to keep calling).

It calls until a call is allowed or refused for good (a failed self-test), and prints
one JSON line: the first refusal (its type, state and text), how many calls were
refused, and the receipt. The body records whether a passing verdict existed when it
ran: a guarded body must never run before one does.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from crewai.tools import tool

from crewai_idempotent import configure
from crewai_idempotent.integration import UnsupportedCrewAIVersion

from .crews import payment_crew, scripted
from .provider import FakeProvider


def _passing_verdicts(cache: Path) -> int:
    found = 0
    for path in cache.glob("crewai-*.json"):
        try:
            found += bool(json.loads(path.read_text())["passed"])
        except (OSError, ValueError, KeyError):
            continue
    return found


def main(spec: dict[str, Any]) -> dict[str, Any]:
    provider = FakeProvider(spec["provider"])
    cache = Path(spec["cache"])
    invoice = spec["invoice"]
    configure(backend=spec["ledger"])

    @tool("charge_card", idempotent=True)
    def charge_card(amount: int, recipient: str, invoice: str = "inv-1") -> str:
        """Charge `amount` to `recipient` for `invoice`. Returns the provider's receipt id."""
        return provider.charge(
            amount, recipient, invoice=invoice, verdicts=_passing_verdicts(cache)
        )

    def call() -> str:
        if not spec.get("crew"):
            return str(charge_card.run(amount=5, recipient="alice", invoice=invoice))
        args = {"amount": 5, "recipient": "alice", "invoice": invoice}
        crew, _ = payment_crew([charge_card], scripted(True, [("charge_card", args)]))
        return str(crew.kickoff().raw)

    Path(spec["ready"]).touch()
    while not Path(spec["go"]).exists():
        time.sleep(0.02)
    first: dict[str, Any] | None = None
    refused = 0
    ends = time.monotonic() + float(spec.get("patience_s", 300))
    while True:
        try:
            result: str | None = call()
            break
        except UnsupportedCrewAIVersion as exc:
            refused += 1
            state = getattr(exc, "state", None)
            if first is None:
                first = {"type": type(exc).__name__, "state": state, "message": str(exc)}
            last = {"type": type(exc).__name__, "state": state, "message": str(exc)}
            if state == "failed" or time.monotonic() > ends:
                return {"first": first, "last": last, "refused": refused, "result": None}
            time.sleep(0.2)
    return {"first": first, "refused": refused, "result": result}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
