"""Ledger errors for a person: an outage is kept on the host while the ledger cannot hold
it, and put in its outbox once it answers; a process that died meanwhile leaves it in its
spool, and the next dispatcher on the host brings it in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import (
    CacheBackend,
    Ledger,
    LedgerUnavailable,
    Record,
    SQLiteCacheBackend,
    Status,
)
from crewai_idempotent.notifications import Dispatcher, Outbox, _incidents
from tests.support.notify import Receiver

ROOT = Path(__file__).resolve().parents[2]


class _Outage(CacheBackend):
    """A store whose every operation fails while `down` is set."""

    def __init__(self, inner: CacheBackend) -> None:
        self.inner, self.down = inner, False
        self.read_first, self.host_clock = inner.read_first, inner.host_clock

    def _check(self) -> None:
        if self.down:
            raise LedgerUnavailable("the test's store is down")

    def insert(self, record: Record) -> Record | None:
        self._check()
        return self.inner.insert(record)

    def replace(self, current: Record, new: Record) -> bool:
        self._check()
        return self.inner.replace(current, new)

    def get(self, key: str) -> Record | None:
        self._check()
        return self.inner.get(key)

    def peek(self, key: str) -> Any:
        self._check()
        return self.inner.peek(key)

    def scan(self, status: Status | None = None) -> Any:
        self._check()
        return self.inner.scan(status)

    def scan_prefix(self, prefix: str) -> Any:
        self._check()
        return self.inner.scan_prefix(prefix)

    def delete(self, current: Record) -> bool:
        self._check()
        return self.inner.delete(current)

    @property
    def url(self) -> str:
        return self.inner.url  # type: ignore[attr-defined,no-any-return]


@pytest.fixture
def spool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "spool"
    monkeypatch.setenv(_incidents.SPOOL_ENV, str(folder))
    monkeypatch.setattr(_incidents, "_PROBE_S", 0.02)
    return folder


def _until(condition: Any, what: str) -> Any:
    deadline = time.monotonic() + 60
    while not (found := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return found


def test_an_outage_is_spooled_then_said_once_the_ledger_answers(
    tmp_path: Path, spool: Path
) -> None:
    store = _Outage(SQLiteCacheBackend(tmp_path / "ledger.db"))
    ledger = Ledger(store, commit_retry_s=0.01)
    store.down = True
    for n in range(3):
        with pytest.raises(LedgerUnavailable):
            ledger.run(f"k{n}", lambda: "never")
    (spooled,) = _until(lambda: list(spool.glob("*/*.json")), "no spool file")
    kept = json.loads(spooled.read_text())
    assert kept["pid"] == os.getpid() and kept["count"] >= 1 and "down" in kept["error"]
    store.down = False
    (entry,) = _until(lambda: Outbox(store).entries(), "the outage was never said")
    assert entry.type == "ledger.unavailable"
    assert entry.data["count"] == 3 and entry.data["first_at"] <= entry.data["last_at"]
    _until(lambda: not list(spool.glob("*/*.json")), "the spool file stayed")
    assert ledger.run("k0", lambda: "ran") == "ran"  # nothing had been claimed


def test_a_process_that_died_in_an_outage_is_said_by_the_next_dispatcher(
    tmp_path: Path, spool: Path
) -> None:
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path)
    script = (
        "import os, sys\n"
        "from crewai_idempotent import SQLiteCacheBackend, LedgerUnavailable\n"
        "from crewai_idempotent.notifications import _incidents\n"
        "b = SQLiteCacheBackend(sys.argv[1])\n"
        "for _ in range(4): _incidents.noted(b, LedgerUnavailable('disk full'))\n"
        "os._exit(0)  # gone before the ledger answered\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script, str(path)], env=env, timeout=120)
    assert done.returncode == 0
    assert len(list(spool.glob("*/*.json"))) == 1
    receiver = Receiver().start()
    try:
        Dispatcher(backend, [receiver.webhook()]).run_once()
        (got,) = receiver.received
        assert got["json"]["type"] == "ledger.unavailable" and got["verified"]
        assert got["json"]["data"]["error"] == "disk full"
        assert got["json"]["data"]["process"] != os.getpid()
    finally:
        receiver.stop()
    assert not list(spool.glob("*/*.json"))
