"""One `crewai-idempotent` command, run as a person runs it, and what it cost.

    python bench/scale_cli.py REPORT.json [--trace] -- approvals ls --ledger URL

The command runs through the CLI's own entry point in this fresh interpreter; its output
goes where this process's does. Afterwards REPORT.json holds its exit status, the rows its
stores' scans read (each store's `ScanCounter`, the seam behind `scan_stats()`), this
process's peak RSS (VmHWM) and, with `--trace`, tracemalloc's peak of Python memory
while the command ran (the CLI imported first, so imports are not counted). bench/scale.py
times the whole process from the outside.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import tracemalloc
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _count_scans(read: list[int]) -> bool:
    """Count every row a store's scan reports reading, in any backend of this process."""
    try:
        from crewai_idempotent.backends import _scan
    except ImportError:
        return False
    counter = getattr(_scan, "ScanCounter", None)
    original = getattr(counter, "read", None)
    if counter is None or original is None:
        return False

    def counted(self: Any, rows: int, batches: int = 1) -> None:
        read[0] += rows
        read[1] += batches
        original(self, rows, batches)

    counter.read = counted
    return True


def _high_water_kib() -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def main() -> int:
    report, *rest = sys.argv[1:]
    trace = rest[:1] == ["--trace"]
    args = rest[rest.index("--") + 1 :]
    read = [0, 0]
    counted = _count_scans(read)
    from crewai_idempotent.cli import main as cli

    if trace:
        tracemalloc.start()
    began = time.perf_counter()
    code: Any = 0
    try:
        cli.main(args=args, prog_name="crewai-idempotent")
    except SystemExit as exit_:
        code = exit_.code
    seconds = time.perf_counter() - began
    peak = tracemalloc.get_traced_memory()[1] if trace else None
    sys.stdout.flush()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    # Not ru_maxrss: Linux carries it across fork() and exec(), so a child of a large
    # parent reports the parent's size. VmHWM is this program's own peak.
    peak_rss = _high_water_kib()
    with open(report, "w") as out:
        json.dump(
            {
                "exit": code if isinstance(code, int) else 1,
                "command_s": seconds,
                "rows": read[0] if counted else None,
                "batches": read[1] if counted else None,
                "maxrss_kib": peak_rss if peak_rss is not None else usage.ru_maxrss,
                "cpu_s": usage.ru_utime + usage.ru_stime,
                "traced_peak_bytes": peak,
            },
            out,
        )
    return code if isinstance(code, int) else 1


if __name__ == "__main__":
    sys.exit(main())
