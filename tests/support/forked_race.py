"""Start several forked processes at the same instant: the races of the ledger tests."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterable


def fork_together(bodies: Iterable[Callable[[int], None]]) -> list[int]:
    """Fork one process per body, release them all at once, return their exit codes.

    A child runs `body(gate)`; the body opens what it needs, then reads one byte from
    `gate`, which returns only when the parent has forked every child and closed the pipe:
    everyone starts together. A body that raises prints its traceback and exits 1.
    """
    read_end, write_end = os.pipe()
    pids = []
    for body in bodies:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                os.close(write_end)
                body(read_end)
                code = 0
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(read_end)
    os.close(write_end)
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
