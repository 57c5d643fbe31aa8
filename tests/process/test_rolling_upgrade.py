"""A rolling deployment: workers of the previous release (commit 61b49de, installed in an
environment of its own by tests/support/previous_release.py) and of this one share a
ledger, on SQLite, PostgreSQL and Redis.

- Real processes of both releases race on the same keys: every key's effect happens once
  (counted at the fake provider), a record one release failed is taken over by the other,
  and each replays what the other committed, equal.
- A ledger the previous release made and filled is opened by this one (its upgrade runs)
  while old workers go on claiming: no claim fails, every old worker goes on working, and
  one started afterwards still opens the ledger (the schema number it checks is still one
  it accepts).
- What the previous release writes after the upgrade (a record it flags for an operator,
  an approval it decides, a record it deletes) is what this release's `Ledger.select`
  finds, as `Select.apply` over a full scan says, and moves this release's change mark;
  so is what it wrote before.
- The previous release reads a ledger this one wrote: get, scan, `ls` and `approvals ls`.

SQLite runs as root with the ledger in pytest's temp folder: the interpreters live under
/root, which an unprivileged user cannot enter (tests/support/unprivileged.py).
"""

from __future__ import annotations

import contextlib
import json
import queue
import secrets
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from crewai_idempotent import (
    Approvals,
    Ledger,
    Order,
    Record,
    Select,
    Status,
    backend_from_url,
)
from crewai_idempotent.ledger._select import DOCUMENTS
from crewai_idempotent.notifications._outbox import is_entry
from tests.support import previous_release
from tests.support.faults.provider import Provider
from tests.support.previous_release import Environment
from tests.support.servers import missing

KINDS = ["sqlite", "postgres", "redis"]
APPROVALS = DOCUMENTS + "approval/"
STATES = ("PENDING", "APPROVED", "DENIED", "USED")
WAIT = 120.0  # seconds a worker may take to answer before the test gives up on it


@pytest.fixture(scope="session")
def previous() -> Environment:
    """The previous release, installed (once: cached, under a file lock)."""
    try:
        return previous_release.environment()
    except previous_release.Unavailable as exc:
        missing(str(exc))


@pytest.fixture(params=KINDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh ledger of each kind, as a URL both releases open."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    server = request.getfixturevalue(f"{request.param}_server")
    return str(server.fresh_url())


@pytest.fixture
def provider(tmp_path: Path) -> Provider:
    return Provider.create(tmp_path / "provider.jsonl")


# -- worker processes ----------------------------------------------------------------------


class Worker:
    """A worker process of one release (`previous_release.serve` or `loop`): JSON lines
    in, JSON lines out, read by a thread so that a silent worker fails the test instead
    of hanging it."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._log: IO[str] = open(log, "w+")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            command, env=env, cwd=log.parent, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True, bufsize=1,
        )  # fmt: skip
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.package = Path()
        self.release = ""

    def ready(self) -> None:
        """Wait for the worker to say which release it imported."""
        said = self.receive()
        assert "ready" in said, said
        self.package = Path(said["ready"]["package"])
        self.release = said["ready"]["release"]

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:  # something printed on the worker's stdout: said, not hung on
                self.lines.put({"failed": f"a line that is not JSON: {line!r}", "traceback": ""})
        self.lines.put(None)

    def tail(self) -> str:
        self._log.flush()
        return self.log.read_text()[-4000:]

    def receive(self, timeout: float = WAIT) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            said = f"{self.log.stem} said nothing for {timeout} s:\n{self.tail()}"
            raise AssertionError(said) from None
        if line is None:
            raise AssertionError(f"{self.log.stem} ended:\n{self.tail()}")
        return line

    def send(self, op: str, **args: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()

    def __call__(self, op: str, **args: Any) -> Any:
        self.send(op, **args)
        return self.result()

    def result(self) -> Any:
        reply = self.receive()
        if "failed" in reply:
            raise AssertionError(f"{self.log.stem}: {reply['failed']}\n{reply['traceback']}")
        return reply["ok"]

    def stop(self) -> None:
        """Close its stdin: a worker ends when it has nothing more to read."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()

    def close(self) -> None:
        self.stop()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


class Workers:
    """Starts workers of either release for one test and stops them all after it."""

    def __init__(self, previous: Environment, url: str, provider: Provider, folder: Path):
        self.previous, self.url, self.provider, self.folder = previous, url, provider, folder
        self.started: list[Worker] = []

    def _args(self, mode: str, release: str, extra: tuple[str, ...]) -> list[str]:
        return [mode, self.url, "--provider", str(self.provider.path), "--release", release,
                *extra]  # fmt: skip

    def old(self, mode: str = "serve", *extra: str) -> Worker:
        """A worker of the previous release, running the package installed beside it."""
        command = self.previous.worker(*self._args(mode, "previous", extra))
        worker = self._start(command, previous_release.previous_env())
        assert worker.package == self.previous.package, worker.package
        return worker

    def new(self, mode: str = "serve", *extra: str) -> Worker:
        """A worker of this release, running this checkout."""
        command, env = previous_release.current_worker(*self._args(mode, "current", extra))
        worker = self._start(command, env)
        assert worker.package == previous_release.ROOT / "crewai_idempotent", worker.package
        return worker

    def _start(self, command: list[str], env: dict[str, str]) -> Worker:
        worker = Worker(command, env, self.folder / f"worker-{len(self.started)}.log")
        self.started.append(worker)
        worker.ready()
        return worker

    def close(self) -> None:
        for worker in self.started:
            worker.close()


@pytest.fixture
def workers(
    previous: Environment, url: str, provider: Provider, tmp_path: Path
) -> Iterator[Workers]:
    started = Workers(previous, url, provider, tmp_path)
    yield started
    started.close()


@contextlib.contextmanager
def opened(url: str) -> Iterator[Ledger]:
    """This release opens the ledger in the test's own process (on a ledger the previous
    release made, its upgrade runs)."""
    ledger = Ledger(backend_from_url(url), wait_s=60.0)
    try:
        ledger.get("the-upgrade")  # the first use connects, checks and migrates
        yield ledger
    finally:
        ledger.close()


# -- what the provider and the ledger say --------------------------------------------------


def charges(provider: Provider) -> Counter[str]:
    return Counter(e["key"] for e in provider.effects(kind="charge"))


def receipt(provider: Provider, key: str) -> str:
    """The receipt of the one charge made for `key`."""
    (only,) = (effect["receipt"] for effect in provider.effects(key, kind="charge"))
    return str(only)


def ran(answer: dict[str, Any]) -> dict[str, Any]:
    """`answer` (of `Worker.run`) says the body ran and its outcome was recorded."""
    assert answer.get("replayed") is False, answer
    return answer


def replayed(answer: dict[str, Any]) -> dict[str, Any]:
    """`answer` says the stored outcome was replayed."""
    assert answer.get("replayed") is True, answer
    return answer


def keys(records: Iterator[Record] | list[Record]) -> list[str]:
    return [record.key for record in records]


def selects(now: float) -> list[Select]:
    """The selects a person's or a watcher's reads make."""
    return [
        Select(needs_operator=True),
        Select(needs_operator=True, order=Order.NEWEST),
        *(Select(status=status) for status in Status),
        Select(status=Status.UNCERTAIN, order=Order.OLDEST),
        Select(status=Status.FAILED, order=Order.NEWEST, limit=7),
        *(Select(prefix=APPROVALS, state=state) for state in STATES),
        Select(prefix=APPROVALS, state="PENDING", order=Order.NEWEST),
        Select(prefix=APPROVALS),
        Select(prefix=DOCUMENTS),
        Select(expired_by=now),
        Select(order=Order.NEWEST, limit=25),
        Select(order=Order.OLDEST, limit=25),
    ]


def assert_selects_agree_with_a_full_scan(ledger: Ledger) -> list[Record]:
    """Every select of this release finds what `Select.apply` over a full scan finds."""
    everything = list(ledger.scan())
    for query in selects(ledger.backend.now()):
        assert keys(ledger.select(query)) == keys(query.apply(everything)), query
    return everything


def found(ledger: Ledger, query: Select) -> list[str]:
    return keys(ledger.select(query))


def approval_keys(ids: list[str]) -> list[str]:
    return sorted(APPROVALS + rid for rid in ids)


def moved(ledger: Ledger, mark: object, what: str) -> object:
    """The store's change mark (`CacheBackend.changes`) once it differs from `mark`, as it
    must after a write of any process. A store may learn of a write a moment after it
    lands (a notification): the wait is a hang guard, not a bound. A store that cannot
    tell (None) is not asked: the console re-reads its pages then."""
    if mark is None:
        return None
    deadline = time.monotonic() + WAIT
    while (now := ledger.backend.changes()) == mark:
        if time.monotonic() > deadline:
            raise AssertionError(f"the change mark stayed {mark!r} after the old release's {what}")
        time.sleep(0.02)
    return now


def drain(worker: Worker, into: list[dict[str, Any]]) -> bool:
    """Move what `worker` printed so far into `into`; False once it has ended."""
    while True:
        try:
            line = worker.lines.get_nowait()
        except queue.Empty:
            return True
        if line is None:
            return False
        into.append(line)


# -- the tests ----------------------------------------------------------------------------

ROUNDS = 30
FILL = 3000


@pytest.mark.slow
@pytest.mark.parametrize("maker", ["previous", "current"])
def test_old_and_new_workers_race_on_the_same_keys_and_replay_each_other(
    workers: Workers, provider: Provider, maker: str
) -> None:
    # One release makes the ledger; workers of the other join it (this release's first
    # use of a ledger the previous one made runs its upgrade).
    first = workers.old() if maker == "previous" else workers.new()
    ran(first("run", key="warm-up"))
    new, old = (workers.new(), first) if maker == "previous" else (first, workers.old())
    racers = [new, workers.new(), old, workers.old()]
    tag = secrets.token_hex(4)
    won: dict[str, dict[str, Any]] = {}  # the answer of the call whose body ran
    for n in range(ROUNDS):
        # Every racer calls the key at once; a third of the keys fail the first time
        # their body runs, and a racer that was waiting takes the FAILED record over.
        key, mode = f"race-{tag}-{n:03d}", ("ok", "ok", "fail-first")[n % 3]
        for racer in racers:
            racer.send("run", key=key, mode=mode)
        answers = [racer.result() for racer in racers]
        errors = [a["error"] for a in answers if "error" in a]
        assert len(errors) == (mode == "fail-first"), (key, answers)
        assert all("declined" in error for error in errors), errors
        values = [a for a in answers if "value" in a]
        winners = [a for a in values if a["replayed"] is False]
        assert len(winners) == 1, (key, answers)
        assert all(a["value"] == winners[0]["value"] for a in values), (key, answers)
        won[key] = winners[0]

    # Whoever won the races, each release fails a key the other takes over, and commits
    # one of its own.
    for one, other in ((old, new), (new, old)):
        failed = f"failed-{tag}-{one.release}"
        assert "declined" in one("run", key=failed, mode="fail").get("error", ""), failed
        taken = won[failed] = ran(other("run", key=failed))
        assert taken["token"] == 2, taken  # the FAILED record's token was 1
        won[f"own-{tag}-{one.release}"] = ran(one("run", key=f"own-{tag}-{one.release}"))
    assert {answer["by"] for answer in won.values()} == {"previous", "current"}

    # Each release replays what the other committed, equal.
    for key, answer in won.items():
        replayer = new if answer["by"] == "previous" else old
        assert replayed(replayer("run", key=key))["value"] == answer["value"], key

    counted = charges(provider)
    assert {key: counted[key] for key in won} == dict.fromkeys(won, 1)
    assert sum(counted.values()) == len(won) + 1  # and the warm-up: nothing else ran
    for key, answer in won.items():
        assert answer["value"]["receipt"] == receipt(provider, key)


def _asks(maker: Worker, count: int) -> dict[str, str]:
    """Guarded calls that each ask for an approval: {key: request id}."""
    asked = {f"pay:{n}": maker("ask", key=f"pay:{n}") for n in range(count)}
    assert all("request" in answer for answer in asked.values()), asked
    return {key: answer["request"] for key, answer in asked.items()}


def _decide(maker: Worker, asked: dict[str, str]) -> dict[str, list[str]]:
    """Decide the requests of `asked` a few of each way, and use some grants: the ids by
    the state each ends in."""
    ids = list(asked.values())
    by_state = {"USED": ids[0::4], "APPROVED": ids[1::4], "DENIED": ids[2::4],
                "PENDING": ids[3::4]}  # fmt: skip
    for rid in by_state["USED"] + by_state["APPROVED"]:
        assert maker("decide", request=rid, approve=True) == "APPROVED"
    for rid in by_state["DENIED"]:
        assert maker("decide", request=rid, approve=False) == "DENIED"
    for key, rid in asked.items():
        if rid in by_state["USED"]:  # the call again, granted: it runs and uses the grant
            ran(maker("ask", key=key))
    return by_state


def _assert_approvals(ledger: Ledger, by_state: dict[str, list[str]]) -> None:
    """This release finds each request in the state it is in, and in no other."""
    for state in STATES:
        assert found(ledger, Select(prefix=APPROVALS, state=state)) == approval_keys(
            by_state[state]
        ), state
        listed = Approvals(ledger.backend).list(state)
        assert sorted(request.id for request in listed) == sorted(by_state[state]), state


@pytest.mark.slow
def test_an_old_ledger_upgrades_in_place_while_old_workers_go_on_claiming(
    workers: Workers, provider: Provider, url: str
) -> None:
    # The previous release makes the ledger and fills it: thousands of records of every
    # outcome, records flagged for an operator, approvals in every state.
    maker = workers.old()
    filled = maker("fill", prefix="fill:", count=FILL)
    flagged = ["flag:0", "flag:1", "flag:2"]
    told = maker("fence", keys=flagged)
    assert all(answer.startswith("OutcomeUncertain") for answer in told.values()), told
    by_state = _decide(maker, _asks(maker, 8))

    # Old workers claim new keys, replay old ones and retry failed ones, on and on.
    old_keys = filled["committed"][:40]
    looping = ("--replay", json.dumps(old_keys))
    loops = [workers.old("loop", "--tag", f"loop{n}", *looping) for n in range(2)]
    said: list[list[dict[str, Any]]] = [[] for _ in loops]

    def wait_for(counts: list[int]) -> None:
        deadline = time.monotonic() + WAIT
        while True:
            alive = [drain(loop, lines) for loop, lines in zip(loops, said, strict=True)]
            if all(len(lines) >= count for lines, count in zip(said, counts, strict=True)):
                return
            if not all(alive) or time.monotonic() > deadline:
                raise AssertionError(
                    f"the old workers stopped claiming: {[len(s) for s in said]} of {counts}\n"
                    + "\n".join(loop.tail() for loop in loops)
                )
            time.sleep(0.05)

    wait_for([10, 10])
    # This release opens the ledger while they claim: its upgrade runs, and it works.
    with opened(url) as current:
        upgrade = [len(lines) for lines in said]
        value = current.run("new:0", lambda: {"receipt": provider.charge("new:0")})
        # Each old worker goes on, and one started now still opens the ledger.
        wait_for([count + 10 for count in upgrade])
        late = workers.old()
        ran(late("run", key="late:0"))
        assert replayed(late("run", key="new:0"))["value"] == value
        again = replayed(late("run", key=old_keys[0]))
        assert again["value"]["receipt"] == receipt(provider, old_keys[0])
        ran(maker("run", key="after:0"))
        for loop, lines in zip(loops, said, strict=True):
            loop.stop()
            while drain(loop, lines):
                time.sleep(0.05)

        # No claim failed, no replay differed: the only errors are the first runs the
        # loops' bodies declined on purpose, each retried by the next call.
        for lines in said:
            retries: dict[str, list[dict[str, Any]]] = {}
            for line in lines:
                if line["mode"] == "fail-first":
                    retries.setdefault(line["key"], []).append(line)
                elif line["key"] in old_keys:
                    assert replayed(line)["value"]["receipt"] == receipt(provider, line["key"])
                else:
                    ran(line)
            for pair in retries.values():
                assert len(pair) == 2 and "declined" in pair[0].get("error", ""), pair
                ran(pair[1])
        counted = charges(provider)
        assert [key for key, n in counted.items() if n != 1] == []
        assert not set(filled["failed"]) & set(counted)
        assert set(filled["committed"] + filled["retried"] + flagged) <= set(counted)

        # What the previous release wrote before the upgrade is what this release finds.
        assert_selects_agree_with_a_full_scan(current)
        assert found(current, Select(needs_operator=True)) == flagged
        assert found(current, Select(status=Status.UNCERTAIN)) == sorted(
            filled["uncertain"] + flagged
        )
        _assert_approvals(current, by_state)


@pytest.mark.slow
def test_what_the_old_release_writes_after_the_upgrade_the_new_release_selects(
    workers: Workers, provider: Provider, url: str
) -> None:
    maker = workers.old()
    filled = maker("fill", prefix="fill:", count=200)
    asked = _asks(maker, 8)
    with opened(url) as current:
        assert_selects_agree_with_a_full_scan(current)
        assert found(current, Select(needs_operator=True)) == []
        assert found(current, Select(prefix=APPROVALS, state="PENDING")) == approval_keys(
            list(asked.values())
        )
        # The previous release goes on writing: it flags records for an operator and
        # settles one, decides and uses approvals, fails, commits and deletes records.
        # Each write moves this release's change mark, or an open console page would
        # miss what old workers do.
        mark = current.backend.changes()
        told = maker("fence", keys=["flag:kept", "flag:settled"])
        assert all(answer.startswith("OutcomeUncertain") for answer in told.values()), told
        mark = moved(current, mark, "flagging records")
        assert maker("resolve", key="flag:settled") == "FAILED"
        mark = moved(current, mark, "resolving a record")
        by_state = _decide(maker, asked)
        mark = moved(current, mark, "deciding approvals")
        assert "OutcomeUnknown" in maker("run", key="late:unknown", mode="unknown")["error"]
        mark = moved(current, mark, "an uncertain call")
        ran(maker("run", key="late:expiring", ttl=600.0))
        retried = filled["failed"][0]
        assert ran(maker("run", key=retried))["status"] == "COMMITTED"
        mark = moved(current, mark, "committing")
        deleted = [filled["committed"][0], filled["uncertain"][0]]
        assert all(maker("delete", key=key) for key in deleted)
        moved(current, mark, "deleting records")

        everything = assert_selects_agree_with_a_full_scan(current)
        assert not set(deleted) & set(keys(everything))
        assert found(current, Select(needs_operator=True)) == ["flag:kept"]
        failed = found(current, Select(status=Status.FAILED))
        assert "flag:settled" in failed and retried not in failed
        assert retried in found(current, Select(status=Status.COMMITTED))
        assert found(current, Select(status=Status.UNCERTAIN)) == sorted(
            ["flag:kept", "late:unknown", *filled["uncertain"][1:]]
        )
        expiring = found(current, Select(expired_by=current.backend.now() + 3600))
        assert "late:expiring" in expiring
        _assert_approvals(current, by_state)


def _summary(record: Record) -> dict[str, Any]:
    """What the worker's `read` says of a record (previous_release._summary)."""
    return {
        "status": record.status.value, "token": record.token, "revision": record.revision,
        "needs_operator": record.needs_operator, "fingerprint": record.fingerprint,
        "result": record.result, "updated_at": record.updated_at,
    }  # fmt: skip


@pytest.mark.slow
def test_the_old_release_reads_a_ledger_the_new_release_wrote(
    workers: Workers, provider: Provider, url: str
) -> None:
    maker = workers.new()  # this release makes the ledger and writes every kind of record
    filled = maker("fill", prefix="fill:", count=300)
    flagged = ["flag:0", "flag:1"]
    maker("fence", keys=flagged)
    by_state = _decide(maker, _asks(maker, 8))
    assert maker("delete", key=filled["committed"][1])

    reader = workers.old()
    read = reader("read")
    with opened(url) as current:
        everything = list(current.scan())
        shown = [record for record in everything if not is_entry(record)]
        expected = {record.key: _summary(record) for record in everything}
        pending = Approvals(current.backend).list("pending")
        states = {request.id: request.state.value for request in Approvals(current.backend).list()}
    assert read["scan"] == expected
    assert read["get"] == expected
    assert sorted(read["ls"]) == sorted(record.key for record in shown)
    assert sorted(read["ls_needs_operator"]) == flagged
    assert sorted(read["ls_uncertain"]) == sorted(
        record.key for record in shown if record.status is Status.UNCERTAIN
    )
    assert read["approvals"] == states
    assert {state: sorted(rid for rid, s in states.items() if s == state) for state in STATES} == {
        state: sorted(by_state[state]) for state in STATES
    }
    assert sorted(read["approvals_pending"]) == sorted(request.id for request in pending)

    # It replays what this release committed, equal, and runs nothing again.
    before = charges(provider)
    for key in filled["committed"][2:12] + filled["retried"][:3]:
        again = replayed(reader("run", key=key))
        assert again["value"]["by"] == "current", again
        assert again["value"]["receipt"] == receipt(provider, key)
    assert "OutcomeUncertain" in reader("run", key=flagged[0])["error"]
    assert charges(provider) == before
