"""A demo's reproduction receipt: `crewai-idempotent demo --receipt FILE` (and
`demo-approvals --receipt FILE`) write what happened as one JSON document, for a bug report
or a discussion upstream (docs/receipts.md says how to read each field).

The demo runs twice: guarded, then the same crew without the guard (the control that shows
the duplicate). Each run's timeline is what the crew did, step by step, and its effects are
read from the fake provider's own list, never from the ledger. This module only assembles
and writes the document; the demos record the steps.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA = "crewai-idempotent.receipt/1"


def unwritable(path: str) -> str | None:
    """Why a receipt cannot be written to `path`, or None if it can: said before the demo
    runs, so a bad path costs nothing. Nothing is created."""
    try:
        return _unwritable(Path(path))
    except OSError as exc:  # a folder on the way that this user may not look into
        return f"cannot look at {path}: {exc.strerror or exc}"


def _unwritable(target: Path) -> str | None:
    path = str(target)
    folder = target.parent
    if target.is_dir():
        return f"{path} is a folder; give a file name for the receipt"
    if not folder.exists():
        return f"the folder {folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if target.exists() and not os.access(target, os.W_OK):
        return f"{path} cannot be written (no write permission)"
    if not target.exists() and not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} cannot be written (no write permission)"
    return None


def versions() -> dict[str, str]:
    """The exact versions the receipt was made with (installed distributions' metadata)."""

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "crewai": installed("crewai"),
        "crewai_idempotent": installed("crewai-idempotent"),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "python_build": " ".join(sys.version.split()),
        "platform": platform.platform(),
    }


def document(demo: str, scenario: str, runs: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """The receipt: `demo` (the command), `scenario` (one sentence), the `runs` ("guarded"
    and "unguarded"), and any other top-level `fields` (the action, the verdict)."""
    return {
        "schema": SCHEMA,
        "demo": demo,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(),
        "scenario": scenario,
        **fields,
        "runs": runs,
    }


def write(path: str, receipt: dict[str, Any]) -> None:
    """Write `receipt` to `path` whole or not at all (a temporary file beside it, renamed).
    Raises OSError if it cannot be written."""
    target = Path(path)
    handle, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(receipt, out, indent=2, sort_keys=False, default=str)
            out.write("\n")
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
