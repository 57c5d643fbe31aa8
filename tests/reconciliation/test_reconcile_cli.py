"""`crewai-idempotent reconcile`: one pass with a line per record and a summary (a progress
bar on a terminal only), --dry-run, --json, alerts on stderr, the exit status, and --watch
until SIGTERM, in a real process."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from crewai_idempotent import Ledger, SQLiteCacheBackend, Status
from crewai_idempotent.cli import main
from tests.support.crewai.fixtures import PYTHON, REPO, subprocess_env
from tests.support.reconcile import stale_claim, uncertain

IMPORT = ("--import", "tests.support.reconcile", "--no-entry-points")


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    opened = Ledger(SQLiteCacheBackend(tmp_path / "ledger.db"))
    yield opened
    opened.close()


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


def cli(url: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--ledger", url, "reconcile", *args], env={"COLUMNS": "250"})


def _fill(ledger: Ledger) -> None:
    uncertain(ledger, "pay:1", {"answer": "found"})
    uncertain(ledger, "pay:2", {"answer": "absent"})
    uncertain(ledger, "pay:3", {"answer": "unknown"})
    stale_claim(ledger.backend, "pay:4", {"answer": "found"})
    uncertain(ledger, "mail:1", reconcile=lambda k, a: None, tool="mail")  # no path: nobody asks


def test_one_pass_says_what_came_of_every_record(ledger: Ledger, url: str) -> None:
    _fill(ledger)
    done = cli(url, *IMPORT)
    assert done.exit_code == 0, done.output
    lines = done.stdout.splitlines()
    assert lines[:5] == [
        "absent     pay:2  [tests.support.reconcile:answer]",
        'found      pay:1  receipt "receipt-pay:1"  [tests.support.reconcile:answer]',
        'found      pay:4  receipt "receipt-pay:4"  [tests.support.reconcile:answer]',
        "left       mail:1  no reconciler for tool 'mail' in this sweeper: register one for "
        "the tool (--import MODULE, the 'crewai_idempotent.reconcilers' entry points) or "
        "name it by import path on the tool",
        "unknown    pay:3  the provider cannot tell yet  [tests.support.reconcile:answer]",
    ]
    assert lines[5] == (
        f"5 record(s) in {url}: 2 found, 1 absent, 1 unknown, 1 left; 2 UNCERTAIN left"
    )
    assert [ledger.get(k).status for k in ("pay:1", "pay:2", "pay:3", "pay:4")] == [  # type: ignore[union-attr]
        Status.COMMITTED, Status.FAILED, Status.UNCERTAIN, Status.COMMITTED,
    ]  # fmt: skip
    again = cli(url, *IMPORT)
    assert "backing off: its reconciler answered Unknown 1 time(s) in a row" in again.stdout


def test_without_import_a_recorded_path_is_not_followed(ledger: Ledger, url: str) -> None:
    uncertain(ledger, "pay:1")
    done = cli(url, "--no-entry-points")
    assert done.exit_code == 0
    assert "--import tests.support.reconcile" in done.stdout
    assert ledger.get("pay:1").status is Status.UNCERTAIN  # type: ignore[union-attr]


def test_a_dry_run_writes_nothing(ledger: Ledger, url: str) -> None:
    _fill(ledger)
    before = ledger.records()
    done = cli(url, *IMPORT, "--dry-run")
    assert done.exit_code == 0, done.output
    assert "would ask  pay:1  uncertain  [tests.support.reconcile:answer]" in done.stdout
    assert done.stdout.splitlines()[-1] == (f"dry run: 5 record(s) in {url}: 1 left, 4 would ask")
    assert ledger.records() == before


def test_json_for_scripts(ledger: Ledger, url: str) -> None:
    _fill(ledger)
    done = cli(url, *IMPORT, "--json", "--tool", "pay", "--alert-after", "0s")
    report = json.loads(done.stdout)
    assert report["counts"]["found"] == 2 and report["open_uncertain"] == 2
    assert {r["key"] for r in report["results"]} == {"pay:1", "pay:2", "pay:3", "pay:4"}
    (alert,) = report["alerts"]  # only the record still open: mail:1 was not looked at
    assert (alert["kind"], alert["key"], alert["id"]) == (
        "uncertain_too_long", "pay:3", "uncertain_too_long:pay:3:1",
    )  # fmt: skip
    assert "WARNING crewai_idempotent.reconciliation: uncertain_too_long: 'pay:3'" in done.stderr


def test_an_unreachable_ledger_exits_1_and_says_why() -> None:
    done = cli("redis://127.0.0.1:9/0?timeout_s=1", "--no-entry-points")
    assert done.exit_code == 1
    assert "ledger unavailable" in done.output
    assert "ERROR crewai_idempotent.reconciliation: ledger_unreachable" in done.stderr


def test_bad_usage_is_said_where_it_is_given(
    ledger: Ledger, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uncertain(ledger, "pay:1")
    missing = cli(url, "--import", "no_such_module_anywhere")
    assert missing.exit_code == 1
    assert "--import: ModuleNotFoundError: No module named 'no_such_module_anywhere'" in (
        missing.output
    )
    assert cli(url, "--timeout", "soon").exit_code == 2
    (tmp_path / "broken_reconcilers.py").write_text("def broken(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    failed = cli(url, "--import", "broken_reconcilers")
    assert failed.exit_code == 1
    assert "importing 'broken_reconcilers' failed: SyntaxError" in failed.output
    assert cli(url, "--concurrency", "0").exit_code == 2


def _reconcile(url: str, *args: str) -> list[str]:
    return [PYTHON, "-m", "crewai_idempotent.cli", "--ledger", url, "reconcile", *IMPORT, *args]


def test_watch_sweeps_until_sigterm(ledger: Ledger, url: str) -> None:
    watcher = subprocess.Popen(
        _reconcile(url, "--watch", "--interval", "0.05"),
        cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        uncertain(ledger, "pay:late", {"answer": "found"})
        deadline = time.monotonic() + 120
        while ledger.get("pay:late").status is not Status.COMMITTED:  # type: ignore[union-attr]
            assert watcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        watcher.send_signal(signal.SIGTERM)
        out, err = watcher.communicate(timeout=60)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait(30)
    assert watcher.returncode == 0, err
    assert 'found      pay:late  receipt "receipt-pay:late"' in out
    assert err.splitlines()[0].startswith(f"sweeping {url} every 0.05 s")
    assert err.splitlines()[-1] == "stopped"


def _on_a_terminal(argv: list[str]) -> str:
    """What `argv` writes to a terminal (a pseudo-terminal for its stdout and stderr)."""
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.chdir(REPO)
        os.execve(argv[0], argv, {**subprocess_env(), "COLUMNS": "120", "TERM": "xterm"})
    seen = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.waitpid(pid, 0)
    return seen.decode(errors="replace")


def test_a_progress_bar_on_a_terminal_only(ledger: Ledger, url: str) -> None:
    for n in range(30):
        uncertain(ledger, f"pay:{n}")
    shown = _on_a_terminal(_reconcile(url, "--tool", "pay"))
    assert "reconciling" in shown and "/30" in shown
    assert "30 record(s) in" in shown and "30 found" in shown
    piped = subprocess.run(
        _reconcile(url), cwd=REPO, env=subprocess_env(), capture_output=True, text=True
    )
    assert "reconciling" not in piped.stdout + piped.stderr


def test_the_sweeper_is_in_the_command_list() -> None:
    shown: Any = CliRunner().invoke(main, ["--help"])
    assert "reconcile" in shown.output


def test_show_says_what_a_sweeper_asks_with(ledger: Ledger, url: str) -> None:
    uncertain(ledger, "pay:1", tool="pay_invoice")
    shown = CliRunner().invoke(main, ["--ledger", url, "show", "pay:1"], env={"COLUMNS": "250"})
    assert (
        "reconcile    tool pay_invoice, reconciler tests.support.reconcile:answer, arguments "
        "recorded" in shown.output
    )
    cli(url, *IMPORT)
    settled = CliRunner().invoke(main, ["--ledger", url, "show", "pay:1"], env={"COLUMNS": "250"})
    assert "arguments recorded" not in settled.output  # dropped once it is COMMITTED
