"""What activation costs, measured in fresh interpreters.

    python bench/startup.py [--runs 60] [--import-runs 15]

1. The median wall time of `python -c pass` (the baseline, with the hook installed) and
   the median time the `.pth` line itself takes when a fresh interpreter executes it
   (importing the hook module and adding its finder): that line is all the package adds
   to interpreter start-up. Target: under 5 ms.
2. `import crewai` with the integration activated on import against the same with
   `CREWAI_IDEMPOTENT_AUTOLOAD=0`, fresh interpreters alternating, medians; and, less
   noisy, the time activation itself takes in one interpreter once crewai is imported
   (importing the integration and `install()`): what activation adds to importing
   crewai. Target: under 10 ms.
3. A call of an unflagged class tool (`tool.run(...)`) with the integration installed
   against the same call without it, in one interpreter, installing and uninstalling in
   alternating rounds (best of many rounds of many calls, per call). Target: under 1 us
   extra.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
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


IMPORT_PROBE = """
import time
start = time.perf_counter()
import crewai
print(time.perf_counter() - start)
"""

# With the start-up hook off: import crewai, then time what the hook would do after it
# (import the integration, install it). The same interpreter, so no noise between runs.
ACTIVATION_PROBE = """
import time
import crewai
start = time.perf_counter()
from crewai_idempotent.integration import install
install()
print(time.perf_counter() - start)
"""

# One interpreter, installed and uninstalled in alternating rounds (uninstall() restores
# the tool's own `_run`): two interpreters differ by more than the microsecond measured.
CALL_PROBE = """
import sys, time
import crewai
import crewai_idempotent
from crewai.tools import BaseTool

class Lookup(BaseTool):
    name: str = "lookup"
    description: str = "Look a thing up."

    def _run(self, q: str) -> str:
        return q

tool = Lookup()
run = tool.run
calls = 20_000
best = {True: float("inf"), False: float("inf")}
guarded = {True: False, False: True}
for _ in range(15):
    for installed in (True, False):
        (crewai_idempotent.install if installed else crewai_idempotent.uninstall)()
        guarded[installed] = hasattr(Lookup._run, "__crewai_idempotent_guard__")
        start = time.perf_counter()
        for _ in range(calls):
            run(q="x")
        best[installed] = min(best[installed], (time.perf_counter() - start) / calls)
assert guarded == {True: True, False: False}, guarded
heavy = [m for m in ("crewai_idempotent.integration._guard", "crewai_idempotent.ledger._ledger")
         if m in sys.modules]
print(best[True], best[False], ",".join(heavy) or "-")
"""


# Installed packages run from cached bytecode; a checkout with PYTHONDONTWRITEBYTECODE
# would compile every module on every import. The probes cache bytecode in a folder of
# their own (warmed by the first probe), so the figures are an installation's.
PYCACHE = tempfile.mkdtemp(prefix="crewai-idempotent-bench-pycache-")


def _probe(code: str, autoload: bool) -> list[str]:
    env = dict(os.environ, CREWAI_IDEMPOTENT_AUTOLOAD="1" if autoload else "0")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = PYCACHE
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env
    )
    return out.stdout.split()


def activation(runs: int) -> tuple[float, float, float, float, float]:
    """Median `import crewai` (ms) on and off; median activation after crewai (ms); best
    unflagged tool call (us) on and off."""
    on, off, activate = [], [], []
    _probe(IMPORT_PROBE, True)  # fills the bytecode cache
    for _ in range(runs):  # alternate, so a busy neighbour hurts both alike
        on.append(float(_probe(IMPORT_PROBE, True)[0]))
        off.append(float(_probe(IMPORT_PROBE, False)[0]))
        activate.append(float(_probe(ACTIVATION_PROBE, False)[0]))
    call_on, call_off = [], []
    for _ in range(3):
        on_us, off_us, heavy = _probe(CALL_PROBE, False)
        assert heavy == "-", f"an unflagged tool call loaded {heavy}"
        call_on.append(float(on_us))
        call_off.append(float(off_us))
    return (
        statistics.median(on) * 1000,
        statistics.median(off) * 1000,
        statistics.median(activate) * 1000,
        min(call_on) * 1e6,
        min(call_off) * 1e6,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--import-runs", type=int, default=15)
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
    on_ms, off_ms, activate_ms, call_on, call_off = activation(args.import_runs)
    print(f"import crewai, activated / autoload off, median of {args.import_runs}: "
          f"{on_ms:.1f} / {off_ms:.1f} ms ({on_ms - off_ms:+.1f} ms, within the noise of "
          "two separate interpreters)")  # fmt: skip
    print(f"activation after import crewai (import the integration + install()), median "
          f"of {args.import_runs}: {activate_ms:.1f} ms; target < 10 ms:",
          "met" if activate_ms < 10 else "NOT met")  # fmt: skip
    print(f"unflagged tool.run(), installed / not, best per call: {call_on:.2f} / "
          f"{call_off:.2f} us: {call_on - call_off:+.2f} us; target < 1 us:",
          "met" if call_on - call_off < 1 else "NOT met")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
