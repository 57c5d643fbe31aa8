"""The offline payment demo behind `crewai-idempotent demo`."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from crewai_idempotent import FileLockCacheBackend, SQLiteCacheBackend, Status
from crewai_idempotent.demo import main, run_demo
from crewai_idempotent.integration import default_ledger_path

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")


def _console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    # Like the CLI's console: markup off, so the demo must ask for it where it wants it.
    console = Console(file=buffer, width=200, color_system=None, highlight=False, markup=False)
    return console, buffer


def test_demo_charges_once_on_a_throwaway_ledger(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CREWAI_IDEMPOTENCY_URL", "mysql://not/consulted")  # the demo's own ledger
    console, buffer = _console()

    assert run_demo(console=console) == 0

    text = buffer.getvalue()
    lines = [line.strip() for line in text.splitlines() if "charge_card(invoice=" in line]
    assert [line.split(")")[1].split()[0] for line in lines] == ["executed", "replayed", "replayed"]
    assert len({line.rsplit("-> ", 1)[1] for line in lines}) == 1  # one receipt, three times
    assert "guardrail rejected" in text and "retries the agent" in text
    assert "charges at the fake provider: 1" in text
    assert "[/]" not in text and "[bold" not in text  # styles applied, not printed
    (said,) = [line for line in text.splitlines() if line.startswith("ledger: ")]
    assert "(a throwaway ledger, deleted when the demo ends;" in said
    assert "crewai-idempotent --ledger URL demo" in said
    folder = Path(said.split("sqlite:///", 1)[1].split(" ", 1)[0]).parent
    assert folder.name.startswith("crewai-idempotent-demo-") and not folder.exists()
    assert not default_ledger_path().exists()  # the user's real ledger is left alone


def test_demo_on_a_ledger_url(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'kept'}"
    console, buffer = _console()
    assert run_demo(ledger_url=url, console=console) == 0
    assert f"ledger: {url} (given with --ledger)" in buffer.getvalue()
    with FileLockCacheBackend(tmp_path / "kept") as backend:
        (record,) = backend.scan(Status.COMMITTED)
    assert record.key.startswith("charge:INV-")


def test_demo_on_a_given_ledger_and_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = tmp_path / "demo.db"
    assert main([str(ledger)]) == 0
    assert main([str(ledger)]) == 0  # a new invoice each run: it charges again, once
    out = capsys.readouterr().out
    assert out.count("charges at the fake provider: 1") == 2
    with SQLiteCacheBackend(ledger) as backend:
        assert len(list(backend.scan(Status.COMMITTED))) == 2
    assert not default_ledger_path().exists()


def test_demo_refuses_an_unsafe_ledger_folder(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    console, buffer = _console()
    assert run_demo(str(shared / "demo.db"), console=console) == 1
    assert "writable by group or others" in buffer.getvalue()
