"""fork() with the local backends (SQLite FULL and NORMAL, the file lock): real processes.

What Celery's prefork pool, `gunicorn --preload` and multiprocessing's `fork` start method
do to a ledger: a parent that already used it forks workers, then closes it or exits. The
child uses either the ledger object it inherited or a new one on the same file. Every
effect is counted at a fake provider: no key may be charged twice, and SQLite's
`integrity_check` must stay ok. The scenarios every backend shares run in
tests/process/test_fork_scenarios.py; what is here is particular to SQLite and the file lock.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import Ledger, LedgerUnavailable, SQLiteCacheBackend
from crewai_idempotent.ledger import _fork
from tests.support.faults.provider import Provider
from tests.support.fork import assert_sound, run_scenario
from tests.support.sqlite import Connections
from tests.support.stores import backend_factory
from tests.support.unprivileged import in_child

LOCAL = ["sqlite", "sqlite-normal", "filelock"]


@pytest.fixture(params=LOCAL)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def url(kind: str, request: pytest.FixtureRequest) -> str:
    return backend_factory(kind, request).url


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider.create(tmp_path / "effects.jsonl")


# -- refusals: where the only safe answer is no ------------------------------------------------


def test_fork_that_bypasses_the_hooks_is_refused_in_the_child(
    kind: str, url: str, tmp_path: Path, provider: Provider
) -> None:
    report = run_scenario("bypass", url, tmp_path)
    assert report["child_exit"] == 0
    child = report["child"]
    if kind.startswith("sqlite"):
        for mode in ("inherited", "new"):
            (error,) = child[mode]["errors"]
            assert "LedgerUnavailable" in error and "bypassed os.register_at_fork" in error
            assert "Open the ledger in the child after the fork" in error
        assert [e["key"] for e in provider.effects()] == ["warm-up", "parent-after"]
    else:
        # A file lock is taken on a descriptor opened for that call: the child's locks are
        # its own, so the file-lock ledger stays usable in such a child.
        assert child["inherited"]["ran"] == 1 and child["new"]["ran"] == 1
    assert report["parent_after"] == {"ran": 1, "replayed": 0, "errors": []}
    assert_sound(kind, tmp_path, provider)


@pytest.mark.parametrize("synchronous", ["FULL", "NORMAL"])
def test_operation_outliving_the_fork_wait_refuses_the_file_in_the_child(
    tmp_path: Path, provider: Provider, synchronous: str
) -> None:
    """When an operation is still running when fork() happens, its connection cannot be
    closed: the child inherits SQLite's bookkeeping for the file in an unknown state and
    must refuse the file, through the inherited object and through a new one."""
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, synchronous=synchronous, busy_timeout_s=0.2)
    ledger = Ledger(backend)
    ledger.run("before", lambda: provider.charge("before"))
    stuck = threading.Event()
    release = threading.Event()

    def running_operation(conn: sqlite3.Connection) -> None:
        stuck.set()
        release.wait(30)  # an operation that outlives the fork wait (busy timeout + 1 s)

    worker = threading.Thread(target=backend._guard, args=(running_operation,))
    worker.start()
    assert stuck.wait(10)
    try:

        def in_the_child() -> Any:
            refusals = []
            for make in (lambda: ledger, lambda: Ledger(SQLiteCacheBackend(path))):
                try:
                    make().run("in-child", lambda: provider.charge("in-child"))
                except LedgerUnavailable as exc:
                    refusals.append(str(exc))
            return refusals

        refusals = in_child(in_the_child)["value"]
    finally:
        release.set()
        worker.join()
    assert len(refusals) == 2
    assert all("still running in the parent" in r and "after the fork" in r for r in refusals)
    # The parent carries on with its own connections.
    assert ledger.run("after", lambda: provider.charge("after")).startswith("ch_")
    assert [e["key"] for e in provider.effects()] == ["before", "after"]
    ledger.close()
    assert_sound("sqlite", tmp_path, provider)


def test_fork_waits_for_a_running_operation_then_both_sides_work(
    tmp_path: Path, provider: Provider
) -> None:
    """An operation in flight in another thread at fork() finishes first (its claim is not
    lost), then the connections close; parent and child both go on with fresh ones."""
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path)
    ledger = Ledger(backend)
    ledger.run("before", lambda: provider.charge("before"))
    started, finished = threading.Event(), threading.Event()

    def slow_operation(conn: sqlite3.Connection) -> None:
        started.set()
        time.sleep(0.5)
        conn.execute("SELECT count(*) FROM idempotency_records").fetchone()
        finished.set()

    worker = threading.Thread(target=backend._guard, args=(slow_operation,))
    worker.start()
    assert started.wait(10)
    # The child is a copy of this process at the fork: if fork() waited for the operation,
    # the child's copy of `finished` is set.
    reply = in_child(
        lambda: (finished.is_set(), ledger.run("in-child", lambda: provider.charge("in-child")))
    )
    worker.join()
    waited_for_it, value = reply["value"]
    assert value.startswith("ch_"), reply
    assert waited_for_it  # the fork waited for the operation instead of cutting it off
    assert ledger.run("in-child", lambda: "again").startswith("ch_")  # a replay
    assert [e["key"] for e in provider.effects()] == ["before", "in-child"]
    ledger.close()
    assert_sound("sqlite", tmp_path, provider)


def test_closed_while_an_operation_ran_still_counts_at_the_next_fork(
    tmp_path: Path, provider: Provider
) -> None:
    """close() cannot close a connection an operation still uses; a fork after that must
    still know the file is open in the parent."""
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, busy_timeout_s=0.2)
    Ledger(backend).run("before", lambda: provider.charge("before"))
    stuck, release = threading.Event(), threading.Event()

    def running_operation(conn: sqlite3.Connection) -> None:
        stuck.set()
        release.wait(30)

    worker = threading.Thread(target=backend._guard, args=(running_operation,))
    worker.start()
    assert stuck.wait(10)
    try:
        backend.close()  # gives up waiting after busy timeout + 1 s
        with pytest.raises(LedgerUnavailable, match="is closed"):
            backend.get("before")

        def in_the_child() -> Any:
            Ledger(SQLiteCacheBackend(path)).run("in-child", lambda: provider.charge("x"))

        reply = in_child(in_the_child)
    finally:
        release.set()
        worker.join()
    assert reply.get("error") == "LedgerUnavailable", reply
    assert "after the fork" in reply["message"]
    assert [e["key"] for e in provider.effects()] == ["before"]


# -- the fork marker: how a store notices a fork without a system call ------------------------


@pytest.mark.skipif(
    not isinstance(_fork.unforked, mmap.mmap),
    reason="MADV_WIPEONFORK unavailable: the stores compare pids on every operation",
)
def test_the_fork_marker_is_zero_in_any_child_until_the_hooks_have_run() -> None:
    """SQLite asks the pid only when the marker reads 0: a child forked without the hooks
    must see 0 (the bypass scenario above then refuses the file), a child forked through
    os.fork() sees 1 again once every object has taken its new pid, the parent stays 1."""
    assert _fork.unforked[0] == 1
    read, write = os.pipe()
    libc = ctypes.CDLL(None, use_errno=True)
    pid = libc.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, bytes([_fork.unforked[0]]))
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, bytes([_fork.unforked[0]]))
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert os.read(read, 2) == bytes([0, 1])
    os.close(read)
    os.close(write)
    assert _fork.unforked[0] == 1


@pytest.mark.skipif(
    not isinstance(_fork.unforked, mmap.mmap),
    reason="MADV_WIPEONFORK unavailable: the stores compare pids on every operation",
)
def test_the_fork_marker_stays_zero_when_a_child_hook_failed() -> None:
    """An object whose child hook raised still holds its parent's state: the marker must
    keep saying "forked" so that every store goes on comparing pids."""

    class Broken:
        def before_fork(self) -> None:
            pass

        def after_fork_in_parent(self) -> None:
            pass

        def after_fork_in_child(self) -> None:
            raise RuntimeError("a child hook that fails")

    broken = Broken()
    _fork.register(broken)
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.write(write, bytes([_fork.unforked[0]]))
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert os.read(read, 1) == bytes([0])
        os.close(read)
        os.close(write)
    finally:
        _fork.unregister(broken)
    assert _fork.unforked[0] == 1


def test_a_process_forked_without_the_hooks_never_closes_what_it_inherited_when_it_forks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child forked in C inherits the parent's open connections; when it later forks
    through os.fork(), its hooks must not close them (sqlite3_close there would act on
    locks and a WAL index the parent owns): they are kept, and the file refused."""
    connections = Connections(monkeypatch)
    backend = SQLiteCacheBackend(tmp_path / "ledger.db")
    Ledger(backend).run("paid", lambda: "ch_original")
    inherited = connections.of_this_thread()[0]
    read, write = os.pipe()
    libc = ctypes.CDLL(None, use_errno=True)
    pid = libc.fork()
    if pid == 0:  # pragma: no cover - the child, forked without the hooks
        try:
            grandchild = os.fork()
            if grandchild == 0:
                os._exit(0)
            os.waitpid(grandchild, 0)
            try:
                inherited.total_changes  # noqa: B018 - raises once the connection is closed
                closed = 0
            except sqlite3.ProgrammingError:
                closed = 1
            try:
                backend.peek("paid")
                refused = 0
            except LedgerUnavailable:
                refused = 1
            os.write(write, bytes([closed, refused]))
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert os.read(read, 2) == bytes([0, 1])  # kept open, and refused
    os.close(read)
    os.close(write)
    assert backend.peek("paid") is not None  # the parent's own connections still work
    backend.close()
