"""Sweeping the console's ended sessions reads the sessions, not the ledger: counted through
the store's `scan_stats()`, never timed."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the console extra is not installed")

from crewai_idempotent import Record, SQLiteCacheBackend, Status
from crewai_idempotent.console._sessions import Sessions


def test_a_sweep_reads_only_the_sessions(tmp_path: Path) -> None:
    backend = SQLiteCacheBackend(tmp_path / "ledger.db", synchronous="NORMAL")
    try:
        now = backend.now()
        for i in range(2000):
            record = Record(f"order:{i:05d}", Status.COMMITTED, "fp", 1, 1, None, 1, now, now,
                            result={"k": i})  # fmt: skip
            assert backend.insert(record) is None
        ended = Sessions(backend, ttl_s=3600, idle_s=120)
        ended.start("alice", 1, "password")
        ended.start("bob", 1, "password")
        before = backend.scan_stats().rows
        # Seen as idle by a sweeper whose idle limit has passed for both.
        assert Sessions(backend, ttl_s=3600, idle_s=-1).sweep() == 2
        assert backend.scan_stats().rows - before == 2
    finally:
        backend.close()
