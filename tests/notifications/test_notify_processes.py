"""The outbox across real processes and SIGKILL:

- a process SIGKILLed at every store write of a transition (before it, and after it): the
  entry exists if and only if the transition does, and only such entries are delivered;
- `crewai-idempotent notify --watch` SIGKILLed mid-delivery: after a restart the entry is
  delivered again, with the same delivery id;
- two dispatcher processes (and on PostgreSQL two "hosts", one of them an hour ahead)
  never send one entry at once, and send every entry.

On SQLite and PostgreSQL (whose server runs as an unprivileged user, tests/support/servers.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import backend_from_url
from crewai_idempotent.notifications import Dispatcher, Outbox, alert
from tests.support.faults import outbox_worker
from tests.support.notify import Receiver
from tests.support.servers import ON_CI

ROOT = Path(__file__).resolve().parents[2]
TYPES = {
    "requested": "approval.requested", "approved": "approval.approved",
    "uncertain": "record.uncertain", "stale": "record.uncertain",
    "resolved": "record.resolved", "threshold": "spend.threshold",
}  # fmt: skip


@pytest.fixture(params=["sqlite", "postgres"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _wait_for(path: Path, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> bool:
    """True once `path` exists; False if the process ended first (a hang guard)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            return False
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {path.name} in {timeout} s:\n{log.read_text()[-2000:]}")
        time.sleep(0.01)
    return True


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL


# -- SIGKILL at every write of a transition ------------------------------------------------


@pytest.mark.parametrize("scenario", outbox_worker.SCENARIOS)
def test_a_kill_at_any_write_leaves_the_entry_iff_the_transition(
    factory: Any, scenario: str, tmp_path: Path
) -> None:
    receiver = Receiver().start()
    kinds = TYPES[scenario]
    tried = 0
    try:
        for stop_at in range(1, 20):
            for when in ("before", "after"):
                fresh = _fresh(factory, tmp_path / f"{stop_at}-{when}")
                backend = backend_from_url(fresh)
                outbox_worker.prepare(backend, scenario)
                marker, report = tmp_path / f"at-{stop_at}-{when}", tmp_path / f"r-{stop_at}-{when}"
                log = tmp_path / f"log-{stop_at}-{when}"
                with open(log, "wb") as out:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "tests.support.faults.outbox_worker",
                         "--ledger", fresh, "--scenario", scenario,
                         "--stop-at", str(stop_at), "--when", when,
                         "--marker", str(marker), "--report", str(report)],
                        cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                    )  # fmt: skip
                stopped = _wait_for(marker, proc, log)
                if stopped:
                    _kill(proc)
                else:
                    assert proc.wait(60) == 0, log.read_text()[-3000:]
                    writes = json.loads(report.read_text())["writes"]
                    assert writes == stop_at - 1, (writes, stop_at)
                happened = outbox_worker.happened(backend, scenario)
                live = [e for e in Outbox(backend).entries() if e.type == kinds]
                assert len(live) == (1 if happened else 0), (stop_at, when, happened, live)
                # Only entries whose transition happened are ever delivered.
                receiver.received.clear()
                Dispatcher(backend, [receiver.webhook(types=kinds)]).run_once()
                assert sorted(receiver.ids()) == sorted(e.id for e in live), (stop_at, when)
                backend.close()
                tried += 1
                if not stopped:
                    return  # every write of the transition was a kill point
        raise AssertionError("the transition made more writes than the test tried")
    finally:
        receiver.stop()
        assert tried >= 3


def _fresh(factory: Any, folder: Path) -> str:
    """A new store of the test's kind: a new SQLite file, or a new PostgreSQL table."""
    if factory.url.startswith("sqlite"):
        folder.mkdir()
        return f"sqlite:///{folder / 'ledger.db'}"
    import uuid
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(factory.url)
    query = dict(parse_qsl(parts.query))
    query["table"] = f"ledger_{uuid.uuid4().hex[:16]}"
    return urlunsplit(parts._replace(query=urlencode(query)))


# -- the dispatcher killed mid-delivery ----------------------------------------------------


def _notify(url: str, receiver: Receiver, log: Path, *extra: str, wrap: tuple[str, ...] = (),
            env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:  # fmt: skip
    """`crewai-idempotent notify --watch` in a process of its own (sleeping where
    libfaketime breaks time.sleep, as tests/support/faults/worker.py does)."""
    code = (
        "import sys\n"
        "from tests.support.faults.worker import _sleep_where_faketime_cannot\n"
        "_sleep_where_faketime_cannot()\n"
        "from crewai_idempotent.cli import main\n"
        "sys.exit(main())\n"
    )
    channel = receiver.webhook(timeout_s="1")
    argv = ["--ledger", url, "notify", "--watch", "--channel", channel, "--poll", "0.1s", *extra]
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*wrap, sys.executable, "-c", code, *argv], cwd=ROOT, env=_env(**(env or {})),
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


@pytest.fixture
def stopping() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The dispatcher processes a test started, killed (with their group) if still there."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # each runs in a session of its own
            proc.wait(30)


def test_a_dispatcher_killed_mid_delivery_delivers_again_with_the_same_id(
    factory: Any, tmp_path: Path, stopping: list[subprocess.Popen[bytes]]
) -> None:
    url = _fresh(factory, tmp_path / "ledger")
    backend = backend_from_url(url)
    entry = alert(backend, "alert.test", "deliver me", subject="k")
    receiver = Receiver().start()
    try:
        receiver.hold = hold = threading.Event()
        first = _notify(url, receiver, tmp_path / "first.log", "--lease", "3s", "--name", "first")
        stopping.append(first)
        assert receiver.holding.acquire(timeout=120), (tmp_path / "first.log").read_text()
        _kill(first)  # mid-delivery: the request is in, the answer never read
        receiver.hold = None
        hold.set()
        second = _notify(
            url, receiver, tmp_path / "second.log", "--lease", "3s", "--name", "second"
        )
        stopping.append(second)
        deadline = time.monotonic() + 120
        while len(receiver.received) < 2 or Outbox(backend).get(entry.id).state != "delivered":  # type: ignore[union-attr]
            assert time.monotonic() < deadline, (tmp_path / "second.log").read_text()
            time.sleep(0.05)
        assert receiver.ids() == [entry.id, entry.id]  # the same delivery id, twice
        assert all(r["verified"] for r in receiver.received)
        found = Outbox(backend).get(entry.id)
        assert found is not None and [t["by"] for t in found.log] == ["second"]
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0  # a clean stop
    finally:
        receiver.stop()
        backend.close()


# -- two dispatchers, two processes, two "hosts" -------------------------------------------


def _faketime() -> tuple[str, ...]:
    import shutil

    if shutil.which("faketime") is None:
        if ON_CI:
            pytest.fail("faketime is missing; CI=true, so this is a failure, not a skip")
        return ()
    return ("faketime", "-f", "+1h")


def test_two_dispatchers_never_send_one_entry_at_once(
    factory: Any, tmp_path: Path, stopping: list[subprocess.Popen[bytes]]
) -> None:
    url = _fresh(factory, tmp_path / "ledger")
    backend = backend_from_url(url)
    ids = [alert(backend, "alert.test", f"entry {n}").id for n in range(24)]
    receiver = Receiver().start()
    receiver.on_request = lambda got: time.sleep(0.05)  # a window for a second sender
    try:
        wrap: tuple[str, ...] = ()
        env: dict[str, str] = {}
        if "postgres" in url:
            # Another "host": its own name, and a wall clock an hour ahead. Claims are
            # judged by the server's clock, so it must take nothing over early.
            wrap, env = _faketime(), {"FAKETIME_DONT_FAKE_MONOTONIC": "1"}
        a = _notify(url, receiver, tmp_path / "a.log", "--name", "host-a")
        b = _notify(url, receiver, tmp_path / "b.log", "--name", "host-b", wrap=wrap, env=env)
        stopping += [a, b]
        deadline = time.monotonic() + 180
        while len({r["id"] for r in receiver.received}) < len(ids):
            assert time.monotonic() < deadline, (tmp_path / "b.log").read_text()[-2000:]
            time.sleep(0.05)
        time.sleep(0.5)  # both keep polling: nothing may come twice
        assert sorted(receiver.ids()) == sorted(ids)  # every entry, each once
        assert set(receiver.most_at_once.values()) == {1}  # never two senders at once
        for entry_id in ids:
            found = Outbox(backend).get(entry_id)
            assert found is not None and found.state == "delivered" and found.tries == 1
    finally:
        receiver.stop()
        backend.close()
