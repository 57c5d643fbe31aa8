"""Group commit: the synced writes of concurrent threads share one fsync, and nothing else
changes (`crewai_idempotent/backends/sqlite/_group.py`, docs/backends.md "Durability").

Real threads on real files. To put writes in one batch for sure, the tests hold SQLite's
write lock from another connection: the first caller then waits inside SQLite, alone, and
every later one queues behind it; when the lock is let go, the first commits alone and the
queue commits as one batch. `strace` counts the WAL syncs and orders them against a marker
each body writes; the fake provider counts charges.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import Ledger, LedgerUnavailable, SQLiteCacheBackend, Status
from crewai_idempotent.backends.sqlite import SQLiteStats
from crewai_idempotent.backends.sqlite import _group as _sqlite_group
from crewai_idempotent.ledger._record import Event, Owner, Record
from tests.support.faults.provider import Provider
from tests.support.sqlite import Connections
from tests.support.unprivileged import in_child

# -- strace: syncs against bodies ----------------------------------------------------------

WORKER = textwrap.dedent(
    """
    import os, sqlite3, sys, threading, time
    from crewai_idempotent import Ledger, SQLiteCacheBackend

    path, mode, hold = sys.argv[1], sys.argv[2], sys.argv[5] == "hold"
    threads, per = int(sys.argv[3]), int(sys.argv[4])
    backend = SQLiteCacheBackend(path, synchronous=mode, busy_timeout_s=60)
    ledger = Ledger(backend)
    ready, go = threading.Barrier(threads + 1), threading.Barrier(threads + 1)

    def body(key):
        os.write(2, b"BODY " + key.encode() + b"\\n")
        return key

    def work(t):
        ledger.run(f"warm-{t}", lambda: "warm")  # this thread's connections, before the count
        ready.wait()
        go.wait()
        for i in range(per):
            key = f"gckey{t:02d}x{i:02d}"
            assert ledger.run(key, lambda key=key: body(key)) == key

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    ready.wait()
    if hold:
        blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        blocker.execute("BEGIN IMMEDIATE")
    os.write(2, b"BEGIN\\n")
    go.wait()
    if hold:
        # One caller waits for the lock inside SQLite; every other one queues behind it.
        deadline = time.monotonic() + 60
        while backend.stats().queued < threads - 1:
            assert time.monotonic() < deadline, "the callers never queued"
            time.sleep(0.001)
        blocker.close()
    for w in workers:
        w.join()
    os.write(2, b"END\\n")
    """
)

_LINE = re.compile(r"^(\d+)\s+(.*)$")
_RESUMED = re.compile(r"^<\.\.\. \w+ resumed>(.*)$")
_KEY = re.compile(r"gckey\d\dx\d\d")


def _calls(text: str) -> Iterator[tuple[int, int, str]]:
    """Each system call of an `strace -f` log as (entry, return, call): the line indexes
    where it started and returned, the text of a call split by other threads' calls
    (`<unfinished ...>`, `<... resumed>`) joined again."""
    pending: dict[str, tuple[int, str]] = {}  # pid -> its unfinished call
    for index, raw in enumerate(text.splitlines()):
        match = _LINE.match(raw)
        if match is None:
            continue
        pid, line = match.groups()
        if line.endswith("<unfinished ...>"):
            pending[pid] = (index, line.removesuffix("<unfinished ...>"))
        elif (resumed := _RESUMED.match(line)) is not None and pid in pending:
            entry, head = pending.pop(pid)
            yield entry, index, head + resumed.group(1)
        else:
            yield index, index, line


class Trace:
    """What the worker did to the WAL, in order: which keys each write carried, when each
    sync started and returned, and when each body started."""

    def __init__(self, text: str) -> None:
        self.first_write: dict[str, int] = {}  # key -> return of the first WAL write holding it
        self.syncs: list[tuple[int, int]] = []  # (entry, return) of every WAL sync
        self.bodies: dict[str, int] = {}  # key -> entry of its body's marker
        wal_fds: set[int] = set()
        began = ended = None
        for entry, done, call in _calls(text):
            if (opened := re.match(r'openat\(.*"[^"]*-wal", .*\) += (\d+)$', call)) is not None:
                wal_fds.add(int(opened.group(1)))
            elif (closed := re.match(r"close\((\d+)\)", call)) is not None:
                wal_fds.discard(int(closed.group(1)))
            elif (synced := re.match(r"f(?:data)?sync\((\d+)", call)) is not None:
                if int(synced.group(1)) in wal_fds:
                    self.syncs.append((entry, done))
            elif (written := re.match(r"pwrite64\((\d+), ", call)) is not None:
                if int(written.group(1)) in wal_fds:
                    for key in _KEY.findall(call):
                        self.first_write.setdefault(key, done)
            elif marker := re.match(r'write\(2, "(BEGIN|END|BODY (gckey\d\dx\d\d))\\n"', call):
                if marker.group(1) == "BEGIN":
                    began = entry
                elif marker.group(1) == "END":
                    ended = entry
                else:
                    self.bodies[marker.group(2)] = entry
        assert began is not None and ended is not None, "the worker never marked its run"
        self.syncs = [(entry, done) for entry, done in self.syncs if began < entry < ended]

    def claim_sync(self, key: str) -> tuple[int, int]:
        """The first WAL sync started after the key's claim reached the WAL: the one that
        made the claim durable; it must have returned before the body started."""
        written, body = self.first_write[key], self.bodies[key]
        assert written < body, f"{key}: the body started before its claim was written"
        after = [sync for sync in self.syncs if sync[0] > written]
        assert after, f"{key}: no WAL sync after its claim was written"
        sync = min(after)
        assert sync[1] < body, f"{key}: the body started before the claim's sync returned"
        return sync


def _traced(tmp_path: Path, mode: str, threads: int, per: int, hold: bool) -> Trace:
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    trace, path = tmp_path / f"trace-{mode}.txt", tmp_path / f"{mode}.db"
    done = subprocess.run(
        ["strace", "-f", "-qq", "-s", "5000", "-o", str(trace),
         "-e", "trace=openat,close,pwrite64,fsync,fdatasync,write",
         sys.executable, "-c", WORKER, str(path), mode, str(threads), str(per),
         "hold" if hold else "free"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0 and "ptrace" in done.stderr.lower():
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr[-3000:]
    found = Trace(trace.read_text())
    keys = {f"gckey{t:02d}x{i:02d}" for t in range(threads) for i in range(per)}
    assert set(found.bodies) == keys  # every body ran, once
    with SQLiteCacheBackend(path) as backend:  # and every claim is in the ledger, committed
        for key in keys:
            record = backend.get(key)
            assert record is not None and record.status is Status.COMMITTED, key
    return found


@pytest.mark.parametrize("mode", ["FULL", "CLAIMS"])
def test_threads_claiming_at_once_share_one_sync(tmp_path: Path, mode: str) -> None:
    threads = 16
    trace = _traced(tmp_path, mode, threads, 1, hold=True)
    keys = sorted(trace.bodies)
    # The caller that met the lock commits alone; the fifteen queued behind it, in one.
    assert len({trace.claim_sync(key) for key in keys}) == 2
    # Without grouping: a sync per claim, and in FULL one per commit too.
    assert len(trace.syncs) < (2 * threads if mode == "FULL" else threads)
    if mode == "CLAIMS":
        assert len(trace.syncs) == 2  # commits ride the next claim's sync, as alone


@pytest.mark.parametrize("mode", ["FULL", "CLAIMS"])
def test_no_body_starts_before_the_sync_of_its_claim(tmp_path: Path, mode: str) -> None:
    # Free-running threads: batches form as they happen to; every claim is checked.
    trace = _traced(tmp_path, mode, threads=8, per=4, hold=False)
    for key in trace.bodies:
        trace.claim_sync(key)


def test_one_thread_still_syncs_each_write_alone(tmp_path: Path) -> None:
    trace = _traced(tmp_path, "FULL", threads=1, per=8, hold=False)
    assert len({trace.claim_sync(key) for key in trace.bodies}) == 8
    assert len(trace.syncs) == 16  # claim and commit, each its own


# -- in-process batches ------------------------------------------------------------------------


def _claim(key: str, token: int = 1) -> Record:
    now = time.time()
    owner = Owner("group-host", 1000 + token, f"{token:08x}")
    return Record(
        key=key, status=Status.PENDING, fingerprint="", token=token, revision=1, owner=owner,
        attempts=1, created_at=now, updated_at=now, lease_expires_at=now + 300,
        history=(Event(now, "claim", token, owner.label),),
    )  # fmt: skip


def _until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """The arguments of every write that went to a leader's batch, one list per batch."""
    seen: list[list[Any]] = []
    commit = _sqlite_group._commit

    def recording(conn: sqlite3.Connection, batch: list[Any], timeout_s: float) -> None:
        seen.append([member.args for member in batch])
        commit(conn, batch, timeout_s)

    monkeypatch.setattr(_sqlite_group, "_commit", recording)
    return seen


@contextlib.contextmanager
def _write_lock(path: Path) -> Iterator[sqlite3.Connection]:
    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        yield blocker
    finally:
        blocker.close()


def _one_batch(
    backend: SQLiteCacheBackend, calls: list[Callable[[], Any]], *, then: Callable[[], None]
) -> list[Any]:
    """Run `calls` in threads as one batch; what each returned or raised. `then` lets the
    batch go (it ends the write lock held by the caller)."""
    results: list[Any] = [None] * len(calls)

    def plug_in() -> None:
        with contextlib.suppress(LedgerUnavailable):  # a test may make every write fail
            backend.insert(_claim("plug"))

    plug = threading.Thread(target=plug_in)
    plug.start()
    _until(lambda: backend.stats().writing, "the plug never ran")

    def call(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as exc:  # noqa: BLE001 - the test looks at each one
            results[i] = exc

    workers = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
    for worker in workers:
        worker.start()
    _until(lambda: backend.stats().queued == len(calls), "the calls never queued")
    then()
    for thread in (plug, *workers):
        thread.join(60)
        assert not thread.is_alive()
    return results


def test_racing_for_one_key_in_one_batch_inserts_it_once(
    tmp_path: Path, batches: list[list[Any]]
) -> None:
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, busy_timeout_s=60)
    backend.get("warm-up")
    calls = [lambda token=token: backend.insert(_claim("same", token)) for token in range(1, 13)]
    with _write_lock(path) as blocker:
        results = _one_batch(backend, calls, then=blocker.close)
    assert [len(batch) for batch in batches] == [12]  # all twelve in one transaction
    winners = [token for token, got in enumerate(results, 1) if got is None]
    assert len(winners) == 1, results
    holders = [got for got in results if got is not None]
    assert all(isinstance(h, Record) and h.token == winners[0] for h in holders), holders
    stored = backend.get("same")
    assert stored is not None and stored.token == winners[0]
    backend.close()


def test_racing_ledgers_in_one_batch_charge_once(tmp_path: Path, batches: list[list[Any]]) -> None:
    path = tmp_path / "ledger.db"
    provider = Provider.create(tmp_path / "effects.jsonl")
    backend = SQLiteCacheBackend(path, busy_timeout_s=60)
    backend.get("warm-up")
    # A ledger each: callers of one key in one ledger meet before the store; these do not.
    ledgers = [Ledger(backend, wait_s=60) for _ in range(10)]
    calls = [lambda ledger=ledger: ledger.run("order-7", lambda: provider.charge("order-7"))
             for ledger in ledgers]  # fmt: skip
    with _write_lock(path) as blocker:
        results = _one_batch(backend, calls, then=blocker.close)
    assert len(batches[0]) == 10
    assert len(provider.effects("order-7")) == 1
    assert results == [provider.receipts("order-7")[0]] * 10
    backend.close()


def test_a_failing_statement_fails_only_its_own_write(
    tmp_path: Path, batches: list[list[Any]]
) -> None:
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, busy_timeout_s=60)
    backend.get("warm-up")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(
        "CREATE TRIGGER poison BEFORE INSERT ON idempotency_records "
        "WHEN NEW.key = 'poison' BEGIN SELECT RAISE(ABORT, 'poisoned row'); END"
    )
    conn.close()
    keys = ["a", "b", "poison", "c", "d"]
    calls = [lambda key=key: backend.insert(_claim(key)) for key in keys]
    with _write_lock(path) as blocker:
        results = _one_batch(backend, calls, then=blocker.close)
    assert [sorted(args[0][0] for args in batch) for batch in batches] == [sorted(keys)]
    for key, got in zip(keys, results, strict=True):
        if key == "poison":
            assert isinstance(got, LedgerUnavailable) and "poisoned row" in str(got)
            assert backend.get(key) is None
        else:
            assert got is None, (key, got)
            stored = backend.get(key)
            assert stored is not None and stored.status is Status.PENDING
    backend.close()


def test_a_failing_commit_fails_every_member(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    SQLiteCacheBackend(path).close()

    def in_the_child() -> Any:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
        backend = SQLiteCacheBackend(path, busy_timeout_s=60)
        backend.get("warm-up")
        wal = Path(f"{path}-wal")
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        calls = [lambda i=i: backend.insert(_claim(f"k{i}")) for i in range(6)]
        with _write_lock(path) as blocker:

            def let_go() -> None:
                # Statements land in the page cache; the WAL grows only at COMMIT.
                resource.setrlimit(resource.RLIMIT_FSIZE, (wal.stat().st_size, hard))
                blocker.close()

            results = _one_batch(backend, calls, then=let_go)
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        left = [i for i in range(6) if backend.get(f"k{i}") is not None]
        backend.close()
        return {"results": [repr(r) for r in results], "left": left}

    reply = in_child(in_the_child)
    assert "value" in reply, reply
    results = reply["value"]["results"]
    assert all(r.startswith("LedgerUnavailable(") and "write failed" in r for r in results)
    assert reply["value"]["left"] == []  # no write reported done, none stored


def test_a_single_thread_never_opens_a_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lone caller's write stays one autocommit statement: no BEGIN, no COMMIT.
    connections = Connections(monkeypatch)
    for mode in ("FULL", "CLAIMS"):
        backend = SQLiteCacheBackend(tmp_path / f"{mode}.db", synchronous=mode)
        ledger = Ledger(backend)
        ledger.run("warm-up", lambda: 1)
        connections.forget()
        for i in range(20):
            assert ledger.run(f"k{i}", lambda i=i: i) == i
        statements = connections.statements
        assert any(s.startswith("INSERT") for s in statements)
        assert not [s for s in statements if s.split()[0] in ("BEGIN", "COMMIT")], statements
        backend.close()


# -- fork, close, interrupts -----------------------------------------------------------------


def test_fork_while_members_wait_lets_the_batch_finish_and_the_child_start_clean(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, busy_timeout_s=60)
    ledger = Ledger(backend)
    ledger.run("warm-up", lambda: 1)
    keys = [f"k{i}" for i in range(6)]
    forked: dict[str, Any] = {}

    def in_the_child() -> Any:
        assert backend.stats() == SQLiteStats(writing=False, queued=0, closing=False)
        seen = [k for k in keys if backend.get(k) is not None]
        done: list[Any] = []
        workers = [
            threading.Thread(target=lambda i=i: done.append(ledger.run(f"child-{i}", lambda: i)))
            for i in range(4)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return {"seen": seen, "ran": sorted(done)}

    def fork_now() -> None:
        # The fork's hook waits for the members (they are inside the fork gate), so the
        # write lock must go while it waits: from another thread, a little later.
        blocker_gone = threading.Timer(0.3, blocker.close)
        blocker_gone.start()
        forked.update(in_child(in_the_child))
        blocker_gone.join()

    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN IMMEDIATE")
    results = _one_batch(backend, [lambda k=k: backend.insert(_claim(k)) for k in keys],
                         then=fork_now)  # fmt: skip
    assert results == [None] * len(keys)  # the parent's batch finished normally
    assert forked.get("value") == {"seen": keys, "ran": [0, 1, 2, 3]}, forked
    assert ledger.run("parent-after", lambda: "ok") == "ok"
    backend.close()


def test_close_waits_for_queued_members(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, busy_timeout_s=60)
    backend.get("warm-up")
    keys = [f"k{i}" for i in range(5)]
    closer = threading.Thread(target=backend.close)

    def close_then_let_go() -> None:
        closer.start()
        _until(lambda: backend.stats().closing, "close() never started")
        blocker.close()

    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN IMMEDIATE")
    results = _one_batch(backend, [lambda k=k: backend.insert(_claim(k)) for k in keys],
                         then=close_then_let_go)  # fmt: skip
    closer.join(60)
    assert results == [None] * len(keys)
    with pytest.raises(LedgerUnavailable, match="closed"):
        backend.insert(_claim("late"))
    with SQLiteCacheBackend(path) as again:
        assert all(again.get(k) is not None for k in ["plug", *keys])


class _Interrupted(Exception):
    pass


def test_a_member_interrupted_while_queued_is_dropped_and_the_group_goes_on(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, busy_timeout_s=60)
    backend.get("warm-up")

    def on_alarm(signum: int, frame: Any) -> None:
        if backend.stats().queued == 1:
            raise _Interrupted
        signal.setitimer(signal.ITIMER_REAL, 0.05)  # not queued yet: look again

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        with _write_lock(path) as blocker:
            plug = threading.Thread(target=backend.insert, args=(_claim("plug"),))
            plug.start()
            _until(lambda: backend.stats().writing, "the plug never ran")
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            with pytest.raises(_Interrupted):
                backend.insert(_claim("interrupted"))  # queued behind the plug, in this thread
            assert backend.stats().queued == 0
            blocker.close()
            plug.join(60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not backend.stats().writing  # the plug's hand-off found nobody waiting
    assert backend.get("interrupted") is None
    assert backend.insert(_claim("after")) is None
    backend.close()


def test_a_write_alone_never_joins_a_transaction_left_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Were a failed batch's ROLLBACK to fail, its connection would stay in a transaction; a
    # later write on it must still commit on its own, or it would be reported done unsaved.
    path = tmp_path / "ledger.db"
    connections = Connections(monkeypatch)
    backend = SQLiteCacheBackend(path)
    backend.get("warm-up")
    (conn,) = connections.of_this_thread()  # what a failed ROLLBACK would leave behind
    conn.execute("BEGIN")
    assert backend.insert(_claim("k")) is None
    assert not conn.in_transaction
    with SQLiteCacheBackend(path) as other:
        assert other.get("k") is not None
    backend.close()


def test_a_queued_write_waits_for_the_lock_no_longer_than_its_busy_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Queued behind a write stuck on the lock, a member must not then wait a busy timeout
    # of its own: the fork gate and close() wait for it the busy timeout plus one second.
    # What is checked is the wait SQLite is told to allow the batch (the busy timeout it
    # runs under), not how long it took: a loaded machine stretches the latter.
    path = tmp_path / "ledger.db"
    timeout = 2.0
    connections = Connections(monkeypatch)
    backend = SQLiteCacheBackend(path, busy_timeout_s=timeout)
    backend.get("warm-up")

    def call(key: str) -> str:
        with pytest.raises(LedgerUnavailable) as failed:
            backend.insert(_claim(key))
        return str(failed.value)

    with _write_lock(path):  # held throughout: every write gives up
        results = _one_batch(backend, [lambda k=k: call(k) for k in "abc"], then=lambda: None)
    for message in results:
        assert "locked past the busy timeout" in message
    # The batch ran under what was left of its members' own timeouts, counted from when
    # they arrived (already spent behind the write they queued behind), then put back:
    # alone it would have waited a whole timeout more.
    # (A connection's first statement sets the busy timeout it opens with.)
    busy = [
        int(s.split("=")[1])
        for ran in connections.runs()
        for s in ran[1:]
        if s.startswith("PRAGMA busy_timeout")
    ]
    full = int(timeout * 1000)
    assert len(busy) == 2 and busy[0] < full and busy[1] == full, connections.runs()
    # The batch's shortened wait was put back.
    opened = connections.alive()
    assert {c.execute("PRAGMA busy_timeout").fetchone()[0] for c in opened} == {full}
    assert backend.insert(_claim("after")) is None
    backend.close()


def test_fork_while_a_write_outlives_the_wait_gives_the_child_a_fresh_group(
    tmp_path: Path,
) -> None:
    # A synced write stuck (a disk that stopped answering) past the fork's wait, members
    # queued behind it: the child must not inherit a group that is busy for ever; it
    # refuses the file at once, and the parent's batch goes on when the write returns.
    path = tmp_path / "ledger.db"
    backend = SQLiteCacheBackend(path, busy_timeout_s=0.2)
    ledger = Ledger(backend)
    ledger.run("warm-up", lambda: 1)
    group = backend._group
    assert group is not None
    release = threading.Event()

    def stuck(conn: sqlite3.Connection) -> str:
        release.wait(30)
        return "written"

    writer = threading.Thread(target=backend._guard, args=(lambda c: group.run(c, stuck),))
    writer.start()
    _until(lambda: backend.stats().writing, "the stuck write never started")
    keys = [f"k{i}" for i in range(4)]
    results: dict[str, Any] = {}
    members = [
        threading.Thread(target=lambda k=k: results.update({k: backend.insert(_claim(k))}))
        for k in keys
    ]
    for member in members:
        member.start()
    _until(lambda: backend.stats().queued == len(keys), "the members never queued")

    def in_the_child() -> Any:
        with pytest.raises(LedgerUnavailable, match="still running in the parent"):
            ledger.run("in-child", lambda: "ran")
        stats = backend.stats()
        return {"busy": stats.writing, "queued": stats.queued}

    try:
        reply = in_child(in_the_child)
    finally:
        release.set()
        writer.join(30)
        for member in members:
            member.join(30)
    assert reply.get("value", {}).get("busy") is False, reply
    assert reply["value"]["queued"] == 0  # a fresh group: it refused at once, never queued
    assert results == dict.fromkeys(keys)  # the parent's batch committed every member
    assert ledger.run("after", lambda: "ok") == "ok"
    backend.close()
