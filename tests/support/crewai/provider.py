"""The fake provider as crew tools see it: charges by amount and recipient, and mails.

The effects go to the one fake provider every test counts at (tests/support/faults/provider.py):
one fsynced line per effect in a file that outlives the process that made it, so tests
count charges across retries, subprocesses and SIGKILL, never from logs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.support.faults.provider import Provider


class FakeProvider:
    """Records `charge` and `send` effects at the provider file `path` (created on first use
    by any process: crews in subprocesses open it by path)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._provider = Provider(self.path)

    def _record(self, kind: str, **fields: Any) -> str:
        if not self.path.exists():
            Provider.create(self.path, exist_ok=True)
        return self._provider.record(kind, **fields)

    def charge(self, amount: int, recipient: str, **fields: Any) -> str:
        return self._record("charge", amount=amount, recipient=recipient, **fields)

    def send(self, to: str, **fields: Any) -> str:
        return self._record("send", to=to, **fields)

    def effects(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return self._provider.effects(kind=kind)

    def count(self, kind: str = "charge") -> int:
        return len(self.effects(kind))

    def find(self, kind: str = "charge", **fields: Any) -> dict[str, Any] | None:
        for effect in self.effects(kind):
            if all(effect.get(k) == v for k, v in fields.items()):
                return effect
        return None
