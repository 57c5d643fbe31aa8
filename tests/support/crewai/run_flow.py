"""Run the payment flow in a fresh interpreter: `python -m tests.support.crewai.run_flow SPEC`.

SPEC is JSON with provider (the charges file), states (the flow's SQLite persistence
file), key (the tool's key template), and optionally id (resume that flow:
`kickoff(inputs={"id": id})`) and hold (see `flows`). Prints one JSON line: the flow's
state id and its result, or the exception. The ledger comes from CREWAI_IDEMPOTENCY_URL.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .flows import payment_flow
from .provider import FakeProvider


def main(spec: dict[str, Any]) -> None:
    flow_class = payment_flow(
        FakeProvider(spec["provider"]), Path(spec["states"]), spec["key"], hold=spec.get("hold", "")
    )
    flow = flow_class()
    inputs = {"id": spec["id"]} if spec.get("id") else None
    result: dict[str, Any] = {}
    try:
        result["raw"] = flow.kickoff(inputs=inputs)
    except Exception as exc:  # noqa: BLE001 - reported to the test as data
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
    result["id"] = flow.state["id"]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
