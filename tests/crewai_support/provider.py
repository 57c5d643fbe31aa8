"""Fake providers that record every effect as one line in a file.

The file outlives the process that made the effect, so tests count charges across
retries, subprocesses and SIGKILL, never from logs.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
from pathlib import Path
from typing import Any


class FakeProvider:
    """Appends one JSON line per effect (`charge`, `send`) to `path`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def _append(self, kind: str, **fields: Any) -> str:
        receipt = f"{kind[:2]}_{secrets.token_hex(6)}"
        line = json.dumps({"kind": kind, "receipt": receipt, "pid": os.getpid(), **fields})
        with open(self.path, "a", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        return receipt

    def charge(self, amount: int, recipient: str, **fields: Any) -> str:
        return self._append("charge", amount=amount, recipient=recipient, **fields)

    def send(self, to: str, **fields: Any) -> str:
        return self._append("send", to=to, **fields)

    def effects(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        lines = self.path.read_text(encoding="utf-8").splitlines()
        found = [json.loads(line) for line in lines if line.strip()]
        return [e for e in found if kind is None or e["kind"] == kind]

    def count(self, kind: str = "charge") -> int:
        return len(self.effects(kind))

    def find(self, kind: str = "charge", **fields: Any) -> dict[str, Any] | None:
        for effect in self.effects(kind):
            if all(effect.get(k) == v for k, v in fields.items()):
                return effect
        return None
