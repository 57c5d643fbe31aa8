"""`python -m crewai_idempotent.demo_approvals [LEDGER_PATH]`: the offline approvals and
spend-cap demo that `crewai-idempotent demo-approvals` runs, without the CLI. The demo is
the integration's (integration/offline/_demo_approvals.py): this module is only its command line.
"""

from __future__ import annotations

import sys

from .integration.offline._demo_approvals import run_demo
from .integration.offline._scripted import command_line

__all__ = ["main", "run_demo"]


def main(argv: list[str] | None = None) -> int:
    return command_line(run_demo, "crewai_idempotent.demo_approvals", argv)


if __name__ == "__main__":
    sys.exit(main())
