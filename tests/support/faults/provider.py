"""The fake provider every test counts effects at: one fsynced JSON line per effect in an
append-only file.

It lives outside the ledger on purpose: the ledger can be wrong about what happened, the
provider cannot. The file outlives the process that made the effect, so tests count
effects across retries, subprocesses and SIGKILL, and never in log lines.
(tests/support/crewai/provider.py's FakeProvider is the same file seen by crew tools:
charges by amount and recipient, and mails.)
"""

from __future__ import annotations

import collections
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any


class Provider:
    """Effects recorded one JSON line each: {"kind", "receipt", "pid", "at", ...fields};
    a charge for a guarded key has "key"."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls, path: str | os.PathLike[str], *, exist_ok: bool = False) -> Provider:
        """Create the (empty) effect file, durably, before any worker may charge."""
        path = Path(path)
        flags = os.O_WRONLY | os.O_CREAT | (0 if exist_ok else os.O_EXCL)
        fd = os.open(path, flags, 0o600)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
        return cls(path)

    def record(self, kind: str, **fields: Any) -> str:
        """Perform one effect of `kind` and return its receipt (what a real API returns)."""
        receipt = f"{kind[:2]}_{secrets.token_hex(8)}"
        effect = {"kind": kind, "receipt": receipt, "pid": os.getpid(), "at": time.time()}
        line = json.dumps({**effect, **fields})
        # No O_CREAT: a missing file means a broken test setup, not a provider to invent.
        # One write() of a short line with O_APPEND lands whole or not at all.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, (line + "\n").encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        return receipt

    def charge(self, key: str, **fields: Any) -> str:
        """Charge for the guarded `key`; the receipt."""
        return self.record("charge", key=key, **fields)

    def effects(self, key: str | None = None, *, kind: str | None = None) -> list[dict[str, Any]]:
        """Every effect recorded (for `key`, of `kind`, if given), in the order they happened."""
        found = []
        for number, line in enumerate(self.path.read_text("utf-8").splitlines(), 1):
            try:
                effect = json.loads(line)
            except ValueError as exc:
                raise AssertionError(f"{self.path}:{number}: torn effect line {line!r}") from exc
            if (key is None or effect.get("key") == key) and (
                kind is None or effect.get("kind") == kind
            ):
                found.append(effect)
        return found

    def receipts(self, key: str) -> list[str]:
        return [effect["receipt"] for effect in self.effects(key)]

    def counts(self) -> dict[str, int]:
        """How many charges each key has."""
        return dict(
            collections.Counter(effect["key"] for effect in self.effects() if "key" in effect)
        )
