"""What the activation hook adds to interpreter start-up, measured in fresh interpreters.

    python bench/startup.py [--runs 60]

Prints the median wall time of `python -c pass` (the baseline, with the hook installed)
and the median time the `.pth` line itself takes when a fresh interpreter executes it
(importing the hook module and adding its finder): that line is all the package adds to
start-up. Target: under 5 ms.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

PROBE = """
import sys, time
line = open(sys.argv[1]).read()
for module in [m for m in sys.modules if "crewai_idempotent" in m]:
    del sys.modules[module]
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "_crewai_idempotent_hook", 0)]
start = time.perf_counter()
exec(line)
print(time.perf_counter() - start)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    args = parser.parse_args()
    pth = Path(sysconfig.get_paths()["purelib"]) / "crewai_idempotent_autoload.pth"
    if not pth.exists():
        print(f"{pth} is missing: install the package first (pip install -e .)")
        return 1
    startup = []
    for _ in range(args.runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        startup.append(time.perf_counter() - start)
    hook = []
    for _ in range(args.runs):
        out = subprocess.run(
            [sys.executable, "-c", PROBE, str(pth)], check=True, capture_output=True, text=True
        )
        hook.append(float(out.stdout))
    base_ms = statistics.median(startup) * 1000
    hook_ms = statistics.median(hook) * 1000
    print(f"python -c pass (hook installed), median of {args.runs}: {base_ms:7.2f} ms")
    print(f"the .pth hook in a fresh interpreter, median of {args.runs}: {hook_ms:7.2f} ms")
    print(
        f"hook / start-up: {hook_ms / base_ms:.1%}; target < 5 ms:",
        "met" if hook_ms < 5 else "NOT met",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
