"""Ledger file trust: a ledger file another user can change is a body that runs twice.

Pre-existing files are checked the way new ones are created (owner, mode, type); a ledger
deleted or replaced under a running process is refused instead of silently starting an
empty one; a sticky shared folder such as /tmp is accepted only for a file this user
created. Cases about other users run as `nobody` (CI runs as root, which ignores modes).
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import (
    FileLockCacheBackend,
    Ledger,
    LedgerUnavailable,
    SQLiteCacheBackend,
)
from tests.support.faults.provider import Provider
from tests.support.unprivileged import NOBODY, in_child, reachable

OTHER_USER = 12345  # neither root nor nobody: "another local user"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand files to others")


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    provider = Provider.create(tmp_path / "effects.jsonl")
    if os.geteuid() == 0:
        os.chown(provider.path, NOBODY, NOBODY)  # unprivileged children charge too
    return provider


@pytest.fixture
def live_wal(tmp_path: Path) -> Iterator[Path]:
    """A ledger with a committed key whose -wal and -shm exist (a connection holds them)."""
    path = tmp_path / "ledger.db"
    Ledger(SQLiteCacheBackend(path)).run("paid", lambda: "ch_original")
    holder = sqlite3.connect(path)
    holder.execute("SELECT count(*) FROM idempotency_records").fetchone()
    assert Path(f"{path}-wal").exists() and Path(f"{path}-shm").exists()
    yield path
    holder.close()


# -- pre-existing files ------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["", "-wal", "-shm"])
@pytest.mark.parametrize("mode", [0o660, 0o606, 0o666])
def test_sqlite_file_writable_by_others_is_refused(
    live_wal: Path, provider: Provider, suffix: str, mode: int
) -> None:
    os.chmod(f"{live_wal}{suffix}", mode)
    with pytest.raises(LedgerUnavailable, match="writable by group or others") as info:
        Ledger(SQLiteCacheBackend(live_wal)).run("new", lambda: provider.charge("new"))
    assert f"{live_wal}{suffix}" in str(info.value)
    assert provider.effects() == []
    # The documented override still opens it.
    ledger = Ledger(SQLiteCacheBackend(live_wal, allow_insecure_path=True))
    assert ledger.run("paid", lambda: provider.charge("paid")) == "ch_original"
    ledger.close()


@needs_root
@pytest.mark.parametrize("suffix", ["", "-wal", "-shm"])
def test_sqlite_file_owned_by_another_user_is_refused(
    live_wal: Path, provider: Provider, suffix: str
) -> None:
    os.chown(f"{live_wal}{suffix}", OTHER_USER, OTHER_USER)
    with pytest.raises(LedgerUnavailable, match=f"owned by uid {OTHER_USER}"):
        Ledger(SQLiteCacheBackend(live_wal)).run("new", lambda: provider.charge("new"))
    assert provider.effects() == []


@needs_root
def test_unprivileged_user_refuses_a_ledger_another_user_owns(
    tmp_path: Path, provider: Provider
) -> None:
    folder = reachable(tmp_path, "mine", 0o700)
    os.chown(folder, NOBODY, NOBODY)
    path = folder / "ledger.db"

    def create() -> Any:
        return Ledger(SQLiteCacheBackend(path)).run("paid", lambda: "ch_original")

    assert in_child(create, unprivileged=True) == {"value": "ch_original"}
    os.chown(path, OTHER_USER, OTHER_USER)  # e.g. planted before the folder was locked down

    def attempt() -> Any:
        return Ledger(SQLiteCacheBackend(path)).run("paid", lambda: provider.charge("paid"))

    reply = in_child(attempt, unprivileged=True)
    assert reply.get("error") == "LedgerUnavailable", reply
    assert f"owned by uid {OTHER_USER}" in reply["message"]
    assert provider.effects() == []


@needs_root
def test_file_lock_files_another_user_owns_or_may_write_are_refused(
    tmp_path: Path, provider: Provider
) -> None:
    folder = tmp_path / "ledger"
    ledger = Ledger(FileLockCacheBackend(folder))
    ledger.run("paid", lambda: provider.charge("paid"))
    (record,) = (folder / "records").rglob("*.json")
    (lock,) = (folder / "locks").glob("*")  # the key's shard of lock files

    os.chmod(record, 0o666)
    with pytest.raises(LedgerUnavailable, match=r"record file .* writable by group or others"):
        Ledger(FileLockCacheBackend(folder)).run("paid", lambda: provider.charge("paid"))
    os.chmod(record, 0o600)
    os.chown(folder / "records", OTHER_USER, OTHER_USER)
    with pytest.raises(LedgerUnavailable, match=f"owned by uid {OTHER_USER}"):
        FileLockCacheBackend(folder)
    os.chown(folder / "records", 0, 0)

    def touch_under_the_lock() -> None:  # a transition takes the key's lock
        backend = FileLockCacheBackend(folder)
        held = backend.get("paid")
        assert held is not None
        backend.replace(held, held.evolve(None, updated_at=held.updated_at + 1))

    os.chmod(lock, 0o777)
    with pytest.raises(LedgerUnavailable, match=r"ledger folder .* writable by group or others"):
        touch_under_the_lock()
    os.chmod(lock, 0o700)
    (lock_file,) = lock.glob("*.lock")
    os.chown(lock_file, OTHER_USER, OTHER_USER)
    with pytest.raises(LedgerUnavailable, match=rf"lock file .* owned by uid {OTHER_USER}"):
        touch_under_the_lock()
    os.chown(lock_file, 0, 0)
    touch_under_the_lock()  # all trusted again
    assert [e["key"] for e in provider.effects()] == ["paid"]  # nothing ran again


# -- deleted or replaced under a running process -----------------------------------------------


def test_sqlite_ledger_deleted_under_a_running_process_is_refused(
    tmp_path: Path, provider: Provider
) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger(SQLiteCacheBackend(path))
    ledger.run("paid", lambda: provider.charge("paid"))
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    with pytest.raises(LedgerUnavailable, match="was deleted"):
        ledger.run("paid", lambda: provider.charge("paid"))
    with pytest.raises(LedgerUnavailable, match="was deleted"):
        ledger.run("new", lambda: provider.charge("new"))
    assert not path.exists()  # not silently recreated empty
    assert [e["key"] for e in provider.effects()] == ["paid"]


def test_sqlite_ledger_replaced_under_a_running_process_is_refused(
    tmp_path: Path, provider: Provider
) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger(SQLiteCacheBackend(path))
    ledger.run("paid", lambda: provider.charge("paid"))
    SQLiteCacheBackend(tmp_path / "empty.db").close()
    os.replace(tmp_path / "empty.db", path)  # an empty ledger in its place
    with pytest.raises(LedgerUnavailable, match="was replaced"):
        ledger.run("paid", lambda: provider.charge("paid"))
    assert [e["key"] for e in provider.effects()] == ["paid"]


def test_sqlite_ledger_deleted_before_a_new_connection_is_not_recreated(
    tmp_path: Path, provider: Provider
) -> None:
    """A thread that opens its first connection after the deletion must not recreate the
    file either (SQLite would create it 0644; the backend opens it mode=rw)."""
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path)
    Ledger(backend).run("paid", lambda: provider.charge("paid"))
    path.unlink()
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):
        backend._open()
    assert not path.exists()


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_file_lock_ledger_deleted_or_replaced_is_refused(
    tmp_path: Path, provider: Provider, how: str
) -> None:
    folder = tmp_path / "ledger"
    ledger = Ledger(FileLockCacheBackend(folder))
    ledger.run("paid", lambda: provider.charge("paid"))
    shutil.rmtree(folder)
    if how == "replaced":
        FileLockCacheBackend(folder)  # a fresh, empty ledger folder at the same path
    with pytest.raises(LedgerUnavailable, match=f"was {how}"):
        ledger.run("paid", lambda: provider.charge("paid"))
    assert [e["key"] for e in provider.effects()] == ["paid"]


def test_file_lock_temporary_files_stay_out_of_the_shard_folders(
    tmp_path: Path, provider: Provider, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The shard folders grow with the ledger; the claim's and the commit's temporary files
    # are made and removed in a small folder of their own (the 1M-record scale figure).
    folder = tmp_path / "ledger"
    backend = FileLockCacheBackend(folder)
    written: list[Path] = []
    write_temp = backend._write_temp

    def recording(final: Path, record: Any) -> Path:
        written.append(write_temp(final, record))
        return written[-1]

    monkeypatch.setattr(backend, "_write_temp", recording)
    assert (
        Ledger(backend).run("paid", lambda: provider.charge("paid"))
        == provider.effects()[0]["receipt"]
    )
    assert len(written) == 2  # the claim and the commit
    assert {path.parent for path in written} == {folder / "tmp"}
    assert list((folder / "tmp").iterdir()) == []
    assert [p.suffix for p in (folder / "records").rglob("*") if p.is_file()] == [".json"]

    # A folder an older version made has no tmp/: its records replay without one (a look
    # at a read-only copy needs none), and the first write makes a private one.
    shutil.rmtree(folder / "tmp")
    older = Ledger(FileLockCacheBackend(folder))
    assert older.run("paid", lambda: provider.charge("x")) == provider.effects()[0]["receipt"]
    assert not (folder / "tmp").exists()
    older.run("new", lambda: provider.charge("new"))
    assert stat.S_IMODE((folder / "tmp").stat().st_mode) == 0o700
    assert [e["key"] for e in provider.effects()] == ["paid", "new"]


# -- sticky shared folders (/tmp) --------------------------------------------------------------


@needs_root
def test_sticky_shared_folder_accepts_a_file_this_user_creates(
    tmp_path: Path, provider: Provider
) -> None:
    shared = reachable(tmp_path, "tmp", 0o1777)  # root-owned, world-writable, sticky

    def attempt() -> Any:
        ledger = Ledger(SQLiteCacheBackend(shared / "mine.db"))
        first = ledger.run("k", lambda: provider.charge("k"))
        again = Ledger(SQLiteCacheBackend(shared / "mine.db")).run("k", lambda: "no")
        return [first == again, stat.S_IMODE(os.stat(shared / "mine.db").st_mode)]

    assert in_child(attempt, unprivileged=True) == {"value": [True, 0o600]}
    assert os.stat(shared / "mine.db").st_uid == NOBODY
    assert len(provider.effects()) == 1


@needs_root
@pytest.mark.parametrize("planted", ["file", "symlink", "wal"])
def test_sticky_shared_folder_refuses_what_another_user_planted(
    tmp_path: Path, provider: Provider, planted: str
) -> None:
    shared = reachable(tmp_path, "tmp", 0o1777)
    path = shared / "mine.db"
    if planted == "file":
        SQLiteCacheBackend(path, allow_insecure_path=True).close()
        os.chmod(path, 0o644)
        os.chown(path, OTHER_USER, OTHER_USER)
        expected = f"owned by uid {OTHER_USER}"
    elif planted == "symlink":
        (shared / "elsewhere.db").touch()
        path.symlink_to(shared / "elsewhere.db")
        expected = "symlink"
    else:
        Path(f"{path}-wal").touch(mode=0o644)
        os.chown(f"{path}-wal", OTHER_USER, OTHER_USER)
        expected = f"wal file .* owned by uid {OTHER_USER}"

    def attempt() -> Any:
        return Ledger(SQLiteCacheBackend(path)).run("k", lambda: provider.charge("k"))

    reply = in_child(attempt, unprivileged=True)
    assert reply.get("error") == "LedgerUnavailable", reply
    assert re.search(expected, reply["message"]), reply["message"]
    assert provider.effects() == []


@needs_root
@pytest.mark.parametrize("mode, owner", [(0o777, 0), (0o1777, OTHER_USER)])
def test_shared_folder_that_is_not_safely_sticky_is_refused(
    tmp_path: Path, provider: Provider, mode: int, owner: int
) -> None:
    """World-writable without the sticky bit (anyone may rename the file away), or sticky
    but owned by another user (who may still delete anything in it)."""
    shared = reachable(tmp_path, "tmp", mode)
    os.chown(shared, owner, owner)

    def attempt() -> Any:
        return Ledger(SQLiteCacheBackend(shared / "mine.db")).run("k", lambda: "ran")

    reply = in_child(attempt, unprivileged=True)
    assert reply.get("error") == "LedgerUnavailable", reply
    assert not (shared / "mine.db").exists()


def test_file_lock_ledger_folder_itself_must_be_private_even_if_sticky(tmp_path: Path) -> None:
    folder = tmp_path / "ledger"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    with pytest.raises(LedgerUnavailable, match="writable by group or others"):
        FileLockCacheBackend(folder)
    FileLockCacheBackend(folder / "inside")  # a private folder inside a sticky one is fine
