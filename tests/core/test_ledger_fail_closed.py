"""Fail closed: when the claim cannot be persisted the body never runs, and the error says why."""

from __future__ import annotations

import os
import resource
import signal
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import (
    CacheBackend,
    FileLockCacheBackend,
    InMemoryCacheBackend,
    Ledger,
    LedgerUnavailable,
    SQLiteCacheBackend,
    Status,
    backend_from_url,
)

from ..support.clock import ClockedBackend, ManualClock
from ..support.unprivileged import NOBODY, in_child, reachable


class Counter:
    """The fake provider: one line per real execution, in a file any user may append to."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(mode=0o777, exist_ok=True)
        os.chmod(folder, 0o777)
        self.path = folder / "effects.txt"

    def body(self, key: str) -> Callable[[], str]:
        def run() -> str:
            with open(self.path, "a") as f:
                f.write(key + "\n")
            return f"receipt-{key}"

        return run

    def lines(self) -> list[str]:
        return self.path.read_text().split() if self.path.exists() else []


@pytest.fixture
def counter(tmp_path: Path) -> Counter:
    return Counter(tmp_path / "provider")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand files to another user")
def test_sqlite_read_only_ledger_file(tmp_path: Path, counter: Counter) -> None:
    folder = reachable(tmp_path, "ro")
    path = folder / "ledger.db"
    with SQLiteCacheBackend(path) as backend:
        Ledger(backend).run("existing", counter.body("existing"))
    os.chmod(path, 0o644)  # root owns the file; nobody may only read it
    os.chown(folder, NOBODY, NOBODY)

    def attempt() -> Any:
        ledger = Ledger(SQLiteCacheBackend(path))
        replay = ledger.run("existing", counter.body("existing"))  # reads still work
        return [replay, ledger.run("new-charge", counter.body("new-charge"))]

    reply = in_child(attempt, unprivileged=True)
    assert reply["error"] == "LedgerUnavailable", reply
    assert "read-only" in reply["message"] and str(path) in reply["message"]
    assert counter.lines() == ["existing"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand files to another user")
def test_filelock_read_only_ledger_folder(tmp_path: Path, counter: Counter) -> None:
    folder = reachable(tmp_path, "ro") / "ledger"
    Ledger(FileLockCacheBackend(folder)).run("existing", counter.body("existing"))
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)

    def attempt() -> Any:
        ledger = Ledger(FileLockCacheBackend(folder))
        return ledger.run("new-charge", counter.body("new-charge"))

    reply = in_child(attempt, unprivileged=True)
    assert reply["error"] == "LedgerUnavailable", reply
    assert "permission denied" in reply["message"]
    assert counter.lines() == ["existing"]


def test_sqlite_corrupt_ledger_file(tmp_path: Path, counter: Counter) -> None:
    path = tmp_path / "ledger.db"
    path.write_bytes(b"this is not a database, it is a shopping list\n" * 200)
    os.chmod(path, 0o600)
    with pytest.raises(LedgerUnavailable, match="corrupt") as info:
        Ledger(SQLiteCacheBackend(path)).run("charge", counter.body("charge"))
    assert str(path) in str(info.value)
    assert counter.lines() == []
    assert path.read_bytes().startswith(b"this is not a database")  # nothing overwritten


def test_filelock_corrupt_record_file(tmp_path: Path, counter: Counter) -> None:
    backend = FileLockCacheBackend(tmp_path / "ledger")
    ledger = Ledger(backend)
    ledger.run("charge", counter.body("charge"))
    (record_file,) = (tmp_path / "ledger" / "records").rglob("*.json")
    record_file.write_text('{"v": 1, "key": "charge", "status": "COMM')
    with pytest.raises(LedgerUnavailable, match="corrupt"):
        ledger.run("charge", counter.body("charge"))
    assert counter.lines() == ["charge"]


def _run_until_the_limit(make_backend: Callable[[], CacheBackend], limit: int, counter: Counter):  # type: ignore[no-untyped-def]
    def attempt() -> Any:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        ledger = Ledger(make_backend(), commit_retry_s=0.2)
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        returned = []
        for i in range(5000):
            key = f"charge-{i:04d}"
            try:
                returned.append((key, ledger.run(key, counter.body(key))))
            except LedgerUnavailable as exc:
                return {"returned": returned, "failed_key": key, "message": str(exc)}
        return {"returned": returned, "failed_key": None, "message": ""}

    # The effects file is written by the same child, so keep it short: one short line each.
    return in_child(attempt)


@pytest.mark.parametrize("kind", ["sqlite", "filelock"])
def test_write_limit_hit_mid_claim(tmp_path: Path, counter: Counter, kind: str) -> None:
    if kind == "sqlite":
        path = tmp_path / "ledger.db"
        SQLiteCacheBackend(path).close()
        reply = _run_until_the_limit(lambda: SQLiteCacheBackend(path), 256 * 1024, counter)
    else:
        folder = tmp_path / "ledger"
        FileLockCacheBackend(folder)
        reply = _run_until_the_limit(lambda: FileLockCacheBackend(folder), 200, counter)
    result = reply["value"]
    assert result["failed_key"] is not None, "the limit was never hit"
    assert "file size limit" in result["message"]
    ran = counter.lines()
    assert result["failed_key"] not in ran  # the claim that hit the limit never ran its body
    assert sorted(ran) == sorted(key for key, _ in result["returned"])  # each ran once
    assert len(ran) == len(set(ran))


def test_symlinked_ledger_path_is_refused(tmp_path: Path, counter: Counter) -> None:
    real = tmp_path / "real.db"
    SQLiteCacheBackend(real).close()
    link = tmp_path / "ledger.db"
    link.symlink_to(real)
    with pytest.raises(LedgerUnavailable, match="symlink"):
        SQLiteCacheBackend(link)
    with pytest.raises(LedgerUnavailable, match="symlink"):
        backend_from_url(f"sqlite:///{link}")
    folder_link = tmp_path / "ledger-dir"
    (tmp_path / "real-dir").mkdir(mode=0o700)
    folder_link.symlink_to(tmp_path / "real-dir")
    with pytest.raises(LedgerUnavailable, match="symlink"):
        FileLockCacheBackend(folder_link)
    backend = SQLiteCacheBackend(link, allow_insecure_path=True)  # documented escape hatch
    assert Ledger(backend).run("k", counter.body("k")) == "receipt-k"


@pytest.mark.parametrize("mode", [0o777, 0o775])  # sticky: tests/backends/test_file_trust.py
def test_folder_writable_by_others_is_refused(tmp_path: Path, counter: Counter, mode: int) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, mode)
    with pytest.raises(LedgerUnavailable, match="writable by group or others"):
        SQLiteCacheBackend(folder / "ledger.db")
    with pytest.raises(LedgerUnavailable, match="writable by group or others"):
        FileLockCacheBackend(folder)
    assert not (folder / "ledger.db").exists()
    SQLiteCacheBackend(folder / "ledger.db", allow_insecure_path=True).close()


def test_new_ledger_file_and_folder_are_private(tmp_path: Path) -> None:
    path = tmp_path / "fresh" / "nested" / "ledger.db"
    SQLiteCacheBackend(path, create_parents=True).close()
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(path.parent).st_mode & 0o777 == 0o700
    folder = tmp_path / "files"
    Ledger(FileLockCacheBackend(folder)).run("k", lambda: 1)
    assert os.stat(folder).st_mode & 0o777 == 0o700
    for item in folder.rglob("*"):
        assert os.stat(item).st_mode & 0o077 == 0, item


def test_database_locked_past_busy_timeout(tmp_path: Path, counter: Counter) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger(SQLiteCacheBackend(path, busy_timeout_s=0.3))
    ledger.run("before", counter.body("before"))
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(LedgerUnavailable, match=r"locked past the busy timeout \(0.3 s\)"):
            ledger.run("during", counter.body("during"))
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert ledger.run("during", counter.body("during")) == "receipt-during"
    assert counter.lines() == ["before", "during"]


def test_any_backend_exception_fails_closed(counter: Counter) -> None:
    class Broken(InMemoryCacheBackend):
        def insert(self, record: Any) -> Any:
            raise ConnectionResetError("peer went away")

    with pytest.raises(LedgerUnavailable, match="ConnectionResetError: peer went away"):
        Ledger(Broken()).run("k", counter.body("k"))
    assert counter.lines() == []


def test_commit_that_cannot_be_stored_returns_the_receipt_and_never_reruns(
    counter: Counter,
) -> None:
    class FailsAfterClaim(InMemoryCacheBackend):
        broken = False

        def replace(self, current: Any, new: Any) -> bool:
            if self.broken:
                raise OSError("disk vanished")
            return super().replace(current, new)

    backend = FailsAfterClaim()
    clock = ManualClock()
    # The commit retries for commit_retry_s and the lease lapses, both on the moved clock.
    ledger = Ledger(ClockedBackend(backend, clock), lease_s=5.0, commit_retry_s=1.0, clock=clock)

    def charge() -> str:
        backend.broken = True
        return counter.body("k")()

    assert ledger.run("k", charge) == "receipt-k"  # the effect happened: the caller learns it
    backend.broken = False
    record = backend.get("k")
    assert record is not None and record.status is Status.PENDING
    clock.advance(6.0)
    with pytest.raises(Exception, match="uncertain"):
        ledger.run("k", counter.body("k"))
    assert counter.lines() == ["k"]


def test_claim_stored_but_unanswered_is_released_as_never_started(counter: Counter) -> None:
    class LosesTheReply(InMemoryCacheBackend):
        lose = True

        def insert(self, record: Any) -> Any:
            held = super().insert(record)
            if self.lose:
                self.lose = False
                raise ConnectionResetError("connection lost after the server stored the claim")
            return held

    backend = LosesTheReply()
    ledger = Ledger(backend)
    with pytest.raises(LedgerUnavailable, match="ConnectionResetError"):
        ledger.run("k", counter.body("k"))
    record = backend.get("k")
    assert record is not None and record.status is Status.FAILED
    assert "never started" in (record.error or "")
    assert counter.lines() == []
    assert ledger.run("k", counter.body("k")) == "receipt-k"  # not stuck, not uncertain
    assert counter.lines() == ["k"]


def test_result_that_is_not_utf8_still_commits_and_replays_exactly(tmp_path: Path) -> None:
    ledger = Ledger(SQLiteCacheBackend(tmp_path / "ledger.db"))
    name = b"invoice-\xff.pdf".decode("utf-8", "surrogateescape")  # a lone surrogate
    assert ledger.run("file", lambda: {"sent": name}) == {"sent": name}
    assert ledger.get("file").status is Status.COMMITTED  # type: ignore[union-attr]
    assert ledger.run("file", lambda: "again") == {"sent": name}
