"""Running a piece of a test in a real child process, optionally as an unprivileged user.

CI runs as root, and root ignores file modes. The venv's interpreter lives under /root
(mode 0700), so `runuser -u nobody -- python` cannot even start it; instead the child is
forked from the test process and drops to `nobody` before running the code under test.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

NOBODY = 65534


def in_child(fn: Callable[[], Any], *, unprivileged: bool = False) -> dict[str, Any]:
    """Run `fn` in a forked child; return {"value": ...} or {"error": type, "message": ...}."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(read_end)
        try:
            if unprivileged and os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            reply = {"value": fn()}
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the test
            reply = {
                "error": type(exc).__name__,
                "message": str(exc),
                "traceback": traceback.format_exc(),
            }
        with os.fdopen(write_end, "w") as pipe:
            json.dump(reply, pipe, default=repr)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"child died: {status}"
    return json.loads(data)  # type: ignore[no-any-return]


def reachable(tmp_path: Path, name: str, mode: int = 0o755) -> Path:
    """A folder an unprivileged child can reach (pytest's tmp_path is private to root)."""
    for parent in (tmp_path, *tmp_path.parents):
        if parent == Path("/tmp"):
            break
        os.chmod(parent, os.stat(parent).st_mode | 0o711)
    folder = tmp_path / name
    folder.mkdir()
    os.chmod(folder, mode)
    return folder
