"""A worker that claims and commits fresh keys until SIGTERM: each claim's latency.

    python bench/scale_claimer.py LEDGER_URL OUT.json

Prints `ready` once its first claim is done, then runs `Ledger.run` on a new key after
another (a trivial body, the store's default durability) until it is sent SIGTERM, and
writes [[wall-clock start, seconds, error or ""], ...] to OUT.json (bench/scale_measure.py):
a claim that raised (the store stayed locked past its busy timeout, say) is counted with
its latency and its error, and the worker goes on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from crewai_idempotent import Ledger, backend_from_url  # noqa: E402


def main() -> int:
    url, out = sys.argv[1:3]
    ledger = Ledger(backend_from_url(url))
    stop = False

    def stopping(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, stopping)
    tag = f"bench-claim:{os.getpid()}"
    ledger.run(f"{tag}:warm-up", lambda: "ch_ok")
    print("ready", flush=True)
    stamps: list[tuple[float, float, str]] = []
    n = 0
    while not stop:
        at, began = time.time(), time.perf_counter()
        try:
            ledger.run(f"{tag}:{n}", lambda: "ch_ok")
            failed = ""
        except Exception as exc:  # noqa: BLE001 - a claim that failed is a figure too
            failed = f"{type(exc).__name__}: {exc}"[:300]
        stamps.append((at, time.perf_counter() - began, failed))
        n += 1
    ledger.close()
    with open(out, "w") as handle:
        json.dump(stamps, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
