"""The processes of the many-sweepers test:
`python -m tests.support.reconcile_swarm_worker ROLE URL DIR`.

`sweeper`: waits for DIR/go, then sweeps the ledger at URL again and again until DIR/stop
appears, and prints one JSON line: every (key, outcome) its passes wrote (found, absent,
unknown) or lost to another writer (overtaken). `owner`: claims `owned:1` and holds it,
its lease (`lease_s` 1) renewed by its keeper, until DIR/release appears; then commits
and prints its outcome.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from crewai_idempotent import Ledger, backend_from_url
from crewai_idempotent.reconciliation import Report, Sweeper


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 600
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} never appeared")
        time.sleep(0.005)


def sweeper(url: str, folder: Path) -> None:
    sweeper = Sweeper(url, trust=["tests"], entry_points=False, channels=[], concurrency=4)
    wrote: list[tuple[str, str]] = []
    stop = threading.Event()

    def watch_for_stop() -> None:
        _wait_for(folder / "stop")
        stop.set()

    def keep(report: Report) -> None:
        assert report.error is None, report.error
        wrote.extend(
            (r.key, r.outcome)
            for r in report.results
            if r.outcome in ("found", "absent", "unknown", "overtaken", "error")
        )

    threading.Thread(target=watch_for_stop, daemon=True).start()
    _wait_for(folder / "go")
    sweeper.watch(0.02, stop=stop, on_report=keep)
    sweeper.close()
    print(json.dumps({"wrote": wrote, "by": sweeper.by}), flush=True)


def owner(url: str, folder: Path) -> None:
    ledger = Ledger(backend_from_url(url), lease_s=1.0)

    def body() -> str:
        (folder / "owning").write_text("")
        _wait_for(folder / "release")
        return "the owner's receipt"

    options = ledger._call_options(None, None, None, "tests.support.reconcile:answer", None)
    outcome: Any = ledger._execute("owned:1", body, options.of_call("fp", {"answer": "absent"}))
    print(json.dumps({"value": outcome.value, "replayed": outcome.replayed}), flush=True)
    ledger.close()


if __name__ == "__main__":
    role, url, folder = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    {"sweeper": sweeper, "owner": owner}[role](url, folder)
