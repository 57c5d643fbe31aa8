"""What the crewAI integration adds to a guarded call, measured in one run.

    python bench/tool_call.py [--mode NORMAL] [--calls 2000] [--rounds 5] [--dir DIR]

Six loops in one interpreter, run in alternating blocks of 25 calls (a noisy neighbour
hits every loop alike), CPU time per call (user + system, this process): the fastest of a
round's blocks, then the median of the rounds:

1. plain: `BaseTool.run` of an unflagged class tool: crewAI's own dispatch.
2. ledger, fresh key / replay: `Ledger.run(key, fn, fingerprint=...)` on a SQLite ledger,
   a new key per call (claim + commit), then every key again (the stored receipt). The
   keys and fingerprints are the ones the guard derives for the same calls (the tool's
   name and the SHA-256 of its arguments), made before the clock starts: the store's
   work depends on the key's length, and deriving the key is the integration's work.
   Also, for the fresh key, the ledger with crewAI's dispatch of the unflagged tool as its
   body (`ledger around plain`): the store's statements with crewAI's code between them,
   as in a guarded call, apart from the guard itself. Not part of the ratio.
3. guarded, fresh key / replay: the same class tool flagged `idempotent=True`, called
   through `BaseTool.run` with new arguments per call (so a new default key), then with
   every call's arguments again.

Both rows use one ledger: the guard's own (`configure(backend=...)`, then the `Ledger`
the guard opens on it), so the two differ by the integration alone and not by a second
file and connection competing for the caches.

The integration's overhead is guarded / (plain + ledger), fresh and replay: what the
guard costs beyond crewAI's dispatch and the ledger it drives. Telemetry is off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")

BLOCK = 25


def _cpu() -> float:
    return time.process_time()


def _per_call(loops: dict[str, Callable[[int], Any]], calls: int) -> dict[str, float]:
    """CPU seconds per call of each loop, run in alternating blocks of BLOCK calls: the
    fastest block's, as `timeit` advises. Load on a shared machine only ever adds time
    (another process evicting the caches, sharing the core), so the least disturbed block
    is the closest reading of what a call costs; every loop is read the same way."""
    spent: dict[str, list[float]] = {name: [] for name in loops}
    for start in range(0, calls, BLOCK):
        stop = min(start + BLOCK, calls)
        for name, loop in loops.items():
            begin = _cpu()
            for i in range(start, stop):
                loop(i)
            spent[name].append((_cpu() - begin) / (stop - start))
    return {name: min(blocks) for name, blocks in spent.items()}


def _round(tag: str, plain: Any, guarded: Any, ledger: Any, calls: int) -> dict[str, float]:
    """One round: the fresh-key loops side by side, then the replays of the same calls."""
    from crewai_idempotent import fingerprint

    name = guarded.name
    digests = [
        fingerprint({"tool": name, "args": {"invoice_id": f"{tag}-L{i}", "amount_cents": i}})
        for i in range(calls)
    ]
    keys = [f"{name}:{digest}" for digest in digests]

    def receipt(i: int) -> str:
        return f"ch_{i}"

    def ledger_call(i: int) -> Any:
        return ledger.run(keys[i], lambda: receipt(i), fingerprint=digests[i])

    # The same claim and commit with crewAI's dispatch of the unflagged tool as the body:
    # where the guarded call runs it. Not in the ratio; it shows what running crewAI's
    # code between the store's statements costs the store (caches), apart from the guard.
    around_digests = [
        fingerprint({"tool": name, "args": {"invoice_id": f"{tag}-A{i}", "amount_cents": i}})
        for i in range(calls)
    ]
    around_keys = [f"{name}:{digest}" for digest in around_digests]

    def ledger_around_plain(i: int) -> Any:
        return ledger.run(
            around_keys[i],
            lambda: plain.run(invoice_id=f"{tag}-A{i}", amount_cents=i),
            fingerprint=around_digests[i],
        )

    fresh = _per_call(
        {
            "plain": lambda i: plain.run(invoice_id=f"{tag}-{i}", amount_cents=i),
            "ledger fresh": ledger_call,
            "ledger around plain": ledger_around_plain,
            "guarded fresh": lambda i: guarded.run(invoice_id=f"{tag}-{i}", amount_cents=i),
        },
        calls,
    )
    replay = _per_call(
        {
            "ledger replay": ledger_call,
            "guarded replay": lambda i: guarded.run(invoice_id=f"{tag}-{i}", amount_cents=i),
        },
        calls,
    )
    return {**fresh, **replay}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="NORMAL", choices=["FULL", "NORMAL", "CLAIMS"])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the ledger files go (a local disk)")
    options = parser.parse_args()
    mode = options.mode

    from crewai.tools import BaseTool

    import crewai_idempotent
    from crewai_idempotent import SQLiteCacheBackend, configure
    from crewai_idempotent.integration._ledgers import ledger_for

    class Plain(BaseTool):
        name: str = "plain_payment"
        description: str = "Charge an invoice (unguarded)."

        def _run(self, invoice_id: str, amount_cents: int) -> str:
            return f"ch_{invoice_id}_{amount_cents}"

    class Guarded(BaseTool):
        name: str = "send_payment"
        description: str = "Charge an invoice."
        idempotent: bool = True

        def _run(self, invoice_id: str, amount_cents: int) -> str:
            return f"ch_{invoice_id}_{amount_cents}"

    folder = Path(tempfile.mkdtemp(prefix="tool-call-", dir=options.dir))
    rows: dict[str, list[float]] = {}
    for round_no in range(options.rounds):
        backend = SQLiteCacheBackend(folder / f"ledger-{round_no}.db", synchronous=mode)
        configure(backend=backend)
        try:
            ledger = ledger_for(backend)
            measured = _round(f"r{round_no}", Plain(), Guarded(), ledger, options.calls)
        finally:
            configure(None)
            backend.close()
        for name, value in measured.items():
            rows.setdefault(name, []).append(value)

    median = {name: statistics.median(values) * 1e6 for name, values in rows.items()}
    print(f"crewai_idempotent {crewai_idempotent.__file__}")
    print(f"SQLite synchronous={options.mode}, {options.calls} calls x {options.rounds} rounds")
    print(f"{'':28} {'CPU us per call':>16}")
    rows_shown = ("plain", "ledger fresh", "ledger around plain", "ledger replay")
    for name in (*rows_shown, "guarded fresh", "guarded replay"):
        print(f"{name:28} {median[name]:16.1f}")
    fresh_ratio = median["guarded fresh"] / (median["plain"] + median["ledger fresh"])
    replay_ratio = median["guarded replay"] / (median["plain"] + median["ledger replay"])
    print(f"{'overhead, fresh key':28} {fresh_ratio:16.2f}  (guarded / (plain + ledger))")
    print(f"{'overhead, replay':28} {replay_ratio:16.2f}")
    around = median["guarded fresh"] / median["ledger around plain"]
    print(f"{'guarded / ledger around plain':28} {around:16.2f}  (fresh key, not the target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
