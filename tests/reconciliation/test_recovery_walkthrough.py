"""docs/recovery.md, followed top to bottom on a fresh ledger folder.

The page's five records are made the way they arise, by real worker processes against a
SQLite ledger in a fresh folder: `charge:order-1043` committed; `charge:order-1045` whose
tool reported an unknown outcome; `charge:order-1042` whose owner was killed (SIGKILL)
after charging and which a later call found stale; `charge:order-1041`, a killed owner's
stale claim; `charge:order-1044`, whose owner was frozen (SIGSTOP) past its lease, taken
over, and committed late (needs operator). Then every command the page prints (each
```text block's `$ ` lines) runs as printed, in order, in a shell in that folder, with the
ledger named by CREWAI_IDEMPOTENCY_URL, and what the page says of each holds: the exit
status, the records and states its tables show, and the lines that do not depend on
timing. `myapp.payments`, which the sweeper's commands import, is a module in the folder
whose reconciler looks the charge up at the fake provider.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import Ledger, OutcomeUncertain, OutcomeUnknown, Status, backend_from_url
from tests.support.faults import launch
from tests.support.faults.provider import Provider
from tests.support.faults.worker import Spec

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "recovery.md"
BLOCK = re.compile(r"^```text\n(.*?)^```", re.S | re.M)
LEASE_S = 1.0
pytestmark = pytest.mark.slow

PAYMENTS = '''\
"""The shop's reconciler, as docs/recovery.md's sweeper commands import it."""

import json
import os

from crewai_idempotent import Absent, Found
from crewai_idempotent.reconciliation import register


def find_charge(key, args):
    with open(os.environ["SHOP_PROVIDER"], encoding="utf-8") as effects:
        charges = [json.loads(line) for line in effects if line.strip()]
    found = [c for c in charges if c.get("key") == key and c.get("kind") == "charge"]
    return Found(found[0]["receipt"]) if found else Absent()


register("charge", find_charge)  # the records' key prefix: their claims name no tool
'''


def commands() -> list[list[str]]:
    """The `$ ` lines of each ```text block of the page, in order, as printed."""
    found = []
    for block in BLOCK.finditer(PAGE.read_text("utf-8")):
        lines = [line[2:] for line in block.group(1).splitlines() if line.startswith("$ ")]
        if lines:
            found.append(lines)
    return found


class Shop:
    """The fresh ledger folder and the workers that fill it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.url = f"sqlite:///{folder / 'ledger.db'}"
        self.provider = Provider.create(folder / "provider.jsonl")
        self.ledger = Ledger(backend_from_url(self.url))
        self.procs: list[launch.Proc] = []

    def start(self, role: str, key: str, **options: Any) -> launch.Proc:
        spec = Spec(
            ledger=self.url, provider=str(self.provider.path), key=key,
            report=str(self.folder / f".{role}.json"), marker=str(self.folder / f".{role}.at"),
            lease_s=LEASE_S, **options,
        )  # fmt: skip
        proc = launch.start(spec, "exec", self.folder / f".{role}.log")
        self.procs.append(proc)
        return proc

    def killed_at(self, role: str, key: str, point: str) -> None:
        proc = self.start(role, key, pause_at=point)
        launch.wait_for_marker(proc)
        proc.kill()
        proc.wait(30)

    def stale(self, key: str) -> None:
        deadline = time.monotonic() + 60
        while not self.ledger.is_stale(self.ledger.get(key)):  # type: ignore[arg-type]
            assert time.monotonic() < deadline, f"the lease on {key!r} did not lapse"
            time.sleep(0.01)

    def fill(self) -> None:
        self.ledger.run("charge:order-1043", lambda: self.provider.charge("charge:order-1043"))

        def lost() -> str:
            self.provider.charge("charge:order-1045")
            raise OutcomeUnknown("the provider did not answer")

        with pytest.raises(OutcomeUnknown):  # recorded UNCERTAIN, raised as it was
            self.ledger.run("charge:order-1045", lost)

        self.killed_at("w1042", "charge:order-1042", "after_effect")
        self.killed_at("w1041", "charge:order-1041", "before_effect")
        key = "charge:order-1042"
        self.stale(key)
        with pytest.raises(OutcomeUncertain):  # a later call finds its owner gone
            self.ledger.run("charge:order-1042", _never, fingerprint=self.fingerprint_of(key))

        key = "charge:order-1044"
        release = self.folder / ".release-1044"
        frozen = self.start("w1044a", key, pause_at="before_effect", release=str(release))
        launch.wait_for_marker(frozen)
        frozen.signal(signal.SIGSTOP)
        launch.wait_stopped(frozen.pid)
        self.stale(key)
        launch.finish(self.start("w1044b", key, on_stale="retry"))
        release.touch()
        frozen.signal(signal.SIGCONT)
        launch.finish(frozen)
        self.stale("charge:order-1041")
        states = {
            r.key: (r.status, r.needs_operator)
            for r in self.ledger.records()
            if r.key.startswith("charge:")  # not the outbox's entries for them
        }
        assert states == {
            "charge:order-1041": (Status.PENDING, False),
            "charge:order-1042": (Status.UNCERTAIN, False),
            "charge:order-1043": (Status.COMMITTED, False),
            "charge:order-1044": (Status.UNCERTAIN, True),
            "charge:order-1045": (Status.UNCERTAIN, False),
        }

    def fingerprint_of(self, key: str) -> str:
        record = self.ledger.get(key)
        assert record is not None
        return record.fingerprint

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.signal(signal.SIGCONT)
                proc.kill()
        self.ledger.close()


def _never() -> str:  # pragma: no cover - a stale claim without a reconciler runs nothing
    raise AssertionError("the body ran over a stale claim")


@pytest.fixture
def shop(tmp_path: Path) -> Iterator[Shop]:
    folder = tmp_path / "shop2"
    folder.mkdir(mode=0o700)
    (folder / "myapp").mkdir()
    (folder / "myapp" / "__init__.py").write_text("")
    (folder / "myapp" / "payments.py").write_text(PAYMENTS)
    made = Shop(folder)
    try:
        made.fill()
        yield made
    finally:
        made.close()


def _shell(shop: Shop) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    bin_dir = str(Path(sys.executable).parent)  # where crewai-idempotent is installed
    env.update(
        CREWAI_IDEMPOTENCY_URL=shop.url, SHOP_PROVIDER=str(shop.provider.path), COLUMNS="200",
        PATH=os.pathsep.join([bin_dir, env.get("PATH", "")]),
    )  # fmt: skip
    return env


def _run(line: str, shop: Shop) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", line], cwd=shop.folder, env=_shell(shop), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip


def _table(out: str) -> dict[str, str]:
    """KEY -> STATUS of an `ls` table."""
    rows = {}
    for line in out.splitlines()[1:]:
        match = re.match(r"(\S+:\S+)\s{2,}(.+?)\s{2,}\d+\s", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def _fact(out: str, name: str) -> str:
    """The value of a `show` line (`status     UNCERTAIN`)."""
    for line in out.splitlines():
        if line.startswith(name + " "):
            return line[len(name) :].strip()
    raise AssertionError(f"no {name!r} line in:\n{out}")


def _watch(line: str, shop: Shop) -> subprocess.CompletedProcess[str]:
    """A watch runs until SIGTERM: once it says it is sweeping, stop it as an operator
    would; it finishes the pass in progress and exits. Its output unbuffered (the
    environment, not the command), to read that line as it is said."""
    watch = subprocess.Popen(
        ["bash", "-c", f"exec {line}"], cwd=shop.folder,
        env={**_shell(shop), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert watch.stderr is not None
        ready, _, _ = select.select([watch.stderr], [], [], 120)  # a hang guard
        assert ready, "the watch never started"
        first = watch.stderr.readline()
        assert first.startswith(f"sweeping {shop.url} every 30 s; stop with SIGTERM"), first
        watch.send_signal(signal.SIGTERM)
        out, err = watch.communicate(timeout=120)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(30)
    assert err.splitlines()[-1] == "stopped", err
    return subprocess.CompletedProcess(line, watch.returncode, out, first + err)


def test_the_runbook_runs_top_to_bottom_as_printed(shop: Shop) -> None:
    everything = [line for block in commands() for line in block]
    doctor, *rest = everything
    assert doctor == "crewai-idempotent doctor"
    result = _run(doctor, shop)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _fact(result.stdout, "source") == "CREWAI_IDEMPOTENCY_URL"
    reachable = _fact(result.stdout, "reachable")
    assert reachable.endswith("; 1 pending (1 stale), 3 uncertain, 1 flagged for an operator"), (
        reachable
    )

    seen: list[str] = [doctor]
    last: subprocess.CompletedProcess[str] | None = None
    for line in rest:
        seen.append(line)
        if line == "echo $?":  # what the page says the command before it exits with
            assert last is not None and last.returncode == 1, (seen[-2], last)
            continue
        last = _watch(line, shop) if "--watch" in line else _run(line, shop)
        _holds(line, last, shop)
    assert len(seen) == len(everything)


def _holds(line: str, result: subprocess.CompletedProcess[str], shop: Shop) -> None:
    """What docs/recovery.md says of `line`, printed at that point of the page."""
    out = result.stdout
    said = (line, out, result.stderr)
    if line.startswith("ps "):  # no line but the header: the owner is gone
        assert out.split()[:3] == ["PID", "STAT", "CMD"], said  # a pid 16435 here may exist
        return
    if "charge:order-1043 --absent" in line or "show charge:order-9999" in line:
        assert result.returncode == 1, said
        return
    if line.startswith("crewai-idempotent verify --trusted-keys"):
        # Every history verifies; each resolution made without a signature is named.
        named = {row.split(": ")[0] for row in out.splitlines()}
        assert named == {f"'charge:order-{n}'" for n in (1041, 1042, 1044, 1045)}, said
        assert result.returncode == 1 and all(": unsigned: " in row for row in out.splitlines())
        return
    assert result.returncode == 0, said
    if line.startswith("crewai-idempotent keys "):
        pass  # a key file and its line in trusted_keys: what verify --trusted-keys reads
    elif line.startswith("crewai-idempotent resolve charge:order-1042") and "--key" in line:
        assert out.splitlines()[0].startswith("signed by alice@example.com (key SHA256:"), said
        assert out.splitlines()[1].startswith("resolved 'charge:order-1042' as absent"), said
    elif line.startswith("crewai-idempotent verify --against"):
        assert result.stderr.endswith(": every history verifies\n"), said
    elif line == "crewai-idempotent ls":
        assert _table(out) == {
            "charge:order-1043": "COMMITTED", "charge:order-1042": "UNCERTAIN",
            "charge:order-1045": "UNCERTAIN", "charge:order-1044": "UNCERTAIN (needs operator)",
            "charge:order-1041": "PENDING (stale)",
        }, said  # fmt: skip
        assert out.splitlines()[-1] == f"5 record(s) in {shop.url}", said
    elif line.startswith("crewai-idempotent ls --status uncertain --json"):
        assert sorted(r["key"] for r in json.loads(out)) == [
            "charge:order-1042", "charge:order-1044", "charge:order-1045",
        ], said  # fmt: skip
    elif line.startswith("crewai-idempotent ls --status uncertain"):
        assert set(_table(out)) == {"charge:order-1042", "charge:order-1044", "charge:order-1045"}
    elif line.startswith("crewai-idempotent ls --stale"):
        assert _table(out) == {"charge:order-1041": "PENDING (stale)"}, said
    elif line.startswith("crewai-idempotent ls --needs-operator"):
        assert _table(out) == {"charge:order-1044": "UNCERTAIN (needs operator)"}, said
    elif line.startswith("crewai-idempotent ls --tool charge --older-than 1h"):
        assert _table(out) == {}, said  # everything was touched in the last minutes
    elif line.startswith("crewai-idempotent export"):
        exported = (shop.folder / "uncertain.jsonl").read_text("utf-8").splitlines()
        assert len(exported) == 3 and all(json.loads(r)["history"] for r in exported)
    elif line == "crewai-idempotent show charge:order-1042":
        assert _fact(out, "status") == "UNCERTAIN", said
        assert "stopped renewing its lease" in _fact(out, "error"), said
    elif line.startswith("crewai-idempotent resolve charge:order-1045"):
        assert out.strip() == (
            "resolved 'charge:order-1045' as happened: COMMITTED (token 1); every later call "
            'replays "ch_0156c464e2fb6eb6"'
        ), said
    elif line.startswith("crewai-idempotent resolve charge:order-1042"):
        assert out.strip() == (
            "resolved 'charge:order-1042' as absent: FAILED; the next attempt runs the operation"
        ), said
    elif line == "crewai-idempotent show charge:order-1044":
        assert _fact(out, "status") == "UNCERTAIN (needs operator)", said
        assert _fact(out, "needs operator") == "yes: two executions may have happened", said
    elif line.startswith("crewai-idempotent resolve charge:order-1044"):
        assert "was flagged because two executions may have happened" in out, said
        assert "resolved 'charge:order-1044' as happened: COMMITTED (token 2)" in out, said
    elif line == "crewai-idempotent reconcile --import myapp.payments":
        # What is still open by now: the stale claim of 1041, charged by nobody.
        assert out.splitlines()[0].startswith("absent     charge:order-1041  "), said
    elif line.startswith("crewai-idempotent reconcile"):
        pass  # a watch's pass, a rehearsal and a script's pass: they run; nothing is left
    else:
        raise AssertionError(f"docs/recovery.md has a command this test does not know: {line}")
