"""A fake provider whose every effect is one fsynced line in an append-only file.

It lives outside the ledger on purpose: the ledger can be wrong about what happened, the
provider cannot. Tests count effects here, never in log lines.
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
    """Charges recorded one JSON line each: {"key", "receipt", "pid", "at"}."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> Provider:
        """Create the (empty) effect file, durably, before any worker may charge."""
        path = Path(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
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

    def charge(self, key: str) -> str:
        """Perform the effect for `key` and return its receipt (what a real API returns)."""
        receipt = f"ch_{secrets.token_hex(8)}"
        line = json.dumps({"key": key, "receipt": receipt, "pid": os.getpid(), "at": time.time()})
        # No O_CREAT: a missing file means a broken test setup, not a provider to invent.
        # One write() of a short line with O_APPEND lands whole or not at all.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, (line + "\n").encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        return receipt

    def effects(self, key: str | None = None) -> list[dict[str, Any]]:
        """Every effect recorded (for `key`, if given), in the order they happened."""
        found = []
        for number, line in enumerate(self.path.read_text("utf-8").splitlines(), 1):
            try:
                effect = json.loads(line)
            except ValueError as exc:
                raise AssertionError(f"{self.path}:{number}: torn effect line {line!r}") from exc
            if key is None or effect["key"] == key:
                found.append(effect)
        return found

    def receipts(self, key: str) -> list[str]:
        return [effect["receipt"] for effect in self.effects(key)]

    def counts(self) -> dict[str, int]:
        """How many charges each key has."""
        return dict(collections.Counter(effect["key"] for effect in self.effects()))
