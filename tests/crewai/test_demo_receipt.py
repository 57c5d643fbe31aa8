"""`crewai-idempotent demo --receipt FILE` (and `demo-approvals --receipt FILE`): the
reproduction receipt, with the unguarded control; and what the demos leave on the machine.

The demos run as the README runs them: the command, in a fresh process, here with a home
and a temp folder that start empty.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import types
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from crewai_idempotent.cli import main as cli
from tests.support.crewai.fixtures import subprocess_env
from tests.support.unprivileged import in_child


def _demo(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    """Run `crewai-idempotent ARGS` with an empty home and temp folder; the result, the
    home and the temp folder."""
    home, temp = tmp_path / "home", tmp_path / "temp"
    home.mkdir()
    temp.mkdir()
    env = subprocess_env(HOME=str(home), TMPDIR=str(temp), COLUMNS="400")
    for name in ("XDG_DATA_HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME", "CREWAI_STORAGE_DIR"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-m", "crewai_idempotent.cli", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done, home, temp


def _left(home: Path, said: str) -> list[str]:
    """The files under `home` that the demo's output does not say it leaves."""
    (line,) = [line for line in said.splitlines() if line.startswith("left behind: ")] or [""]
    named = [Path(word.rstrip(",")) for word in line.split() if word.startswith(str(home))]
    return [
        str(path)
        for path in sorted(home.rglob("*"))
        if path.is_file() and not any(path.is_relative_to(folder) for folder in named)
    ]


def _versions(receipt: dict[str, Any]) -> None:
    assert receipt["schema"] == "crewai-idempotent.receipt/1"
    versions = receipt["versions"]
    assert versions["crewai"] == metadata.version("crewai")
    assert versions["crewai_idempotent"] == metadata.version("crewai-idempotent")
    assert versions["python"] == platform.python_version()
    assert versions["platform"] == platform.platform()


def test_the_demo_leaves_nothing_but_what_it_names(tmp_path: Path) -> None:
    done, home, temp = _demo(tmp_path, "demo")
    assert "charges at the fake provider: 1" in done.stdout
    assert not list(home.rglob("latest_kickoff_task_outputs.db"))  # crewai's, for the run
    assert _left(home, done.stdout) == []
    assert os.listdir(temp) == []  # the ledger, and crewai's lock files
    assert os.listdir(tmp_path) == ["home", "temp"]  # the current directory too


def test_the_receipt_shows_one_charge_guarded_and_one_per_retry_without(tmp_path: Path) -> None:
    target = tmp_path / "receipt.json"
    done, home, temp = _demo(tmp_path, "demo", "--receipt", str(target))
    assert f"receipt written to {target}" in done.stdout
    receipt = json.loads(target.read_text())
    _versions(receipt)
    action = receipt["action"]
    assert action["tool"] == "charge_card" and action["idempotency_key"].startswith("charge:INV-")
    assert len(action["fingerprint"]) == 64 and int(action["fingerprint"], 16) >= 0
    guarded, unguarded = receipt["runs"]["guarded"], receipt["runs"]["unguarded"]

    # The counts come from the providers' own lists: one charge, and one per call without.
    assert guarded["effects"]["count"] == len(guarded["effects"]["charges"]) == 1
    assert guarded["tool_calls"] == unguarded["tool_calls"] == 3
    assert unguarded["effects"]["count"] == len(unguarded["effects"]["charges"]) == 3
    assert {c["invoice"] for c in unguarded["effects"]["charges"]} == {
        action["arguments"]["invoice"]
    }
    assert len({c["receipt"] for c in unguarded["effects"]["charges"]}) == 3
    assert guarded["effects"]["charges"][0]["idempotency_key"] == action["idempotency_key"]
    assert receipt["verdict"] == {
        "guarded_effects": 1,
        "unguarded_effects": 3,
        "duplicates_prevented": 2,
    }

    # The timeline: the charge and its effect, a failure after it and before the task is
    # accepted, crewai's retry, the call again; the same steps in both runs.
    events = [step["event"] for step in guarded["timeline"]]
    assert events == [step["event"] for step in unguarded["timeline"]]
    assert events == [
        "tool_call", "tool_result", "failure_injected",
        "retry", "tool_call", "tool_result", "failure_injected",
        "retry", "tool_call", "tool_result", "acknowledged",
    ]  # fmt: skip
    results = [s for s in guarded["timeline"] if s["event"] == "tool_result"]
    assert [s["guard"] for s in results] == ["executed", "replayed", "replayed"]
    assert [s["effect"] for s in results] == ["a new charge", "no new charge", "no new charge"]
    assert [s["provider_charges_after"] for s in results] == [1, 1, 1]
    control = [s for s in unguarded["timeline"] if s["event"] == "tool_result"]
    assert [s["provider_charges_after"] for s in control] == [1, 2, 3]
    assert [s["guard"] for s in control] == [None, None, None]
    failures = [s for s in guarded["timeline"] if s["event"] == "failure_injected"]
    assert ["guardrail" in f["how"] for f in failures] == [True, False]
    assert "RuntimeError" in failures[1]["how"]

    assert _left(home, done.stdout) == [] and os.listdir(temp) == []


def test_the_approvals_receipt_pays_each_invoice_once_guarded(tmp_path: Path) -> None:
    target = tmp_path / "receipt.json"
    done, home, temp = _demo(tmp_path, "demo-approvals", "--receipt", str(target))
    receipt = json.loads(target.read_text())
    _versions(receipt)
    assert receipt["demo"] == "demo-approvals"
    guarded, unguarded = receipt["runs"]["guarded"], receipt["runs"]["unguarded"]
    invoices = sorted(unguarded["effects"]["by_invoice"])
    assert len(invoices) == 4
    assert guarded["effects"]["by_invoice"] == {invoice: 1 for invoice in invoices[:3]}
    assert unguarded["effects"]["by_invoice"] == dict(zip(invoices, [2, 2, 2, 1], strict=True))
    assert receipt["verdict"]["guarded_effects"] == 3
    assert receipt["verdict"]["unguarded_effects"] == 7 == unguarded["tool_calls"]
    calls = receipt["action"]["calls"]
    assert [call["invoice"] for call in calls] == invoices
    assert all(call["idempotency_key"].startswith("pay_invoice:") for call in calls)
    steps = guarded["timeline"]
    (stop,) = [s for s in steps if s["event"] == "failure_injected"]
    assert "ApprovalRequired" in stop["how"] and stop["kickoff"] == 1
    decided = {(s["kickoff"], s["invoice"]): s["guard"] for s in steps if "guard" in s}
    assert [decided[(2, invoice)] for invoice in invoices] == [
        "replayed", "replayed", "executed", "refused",
    ]  # fmt: skip
    assert _left(home, done.stdout) == [] and os.listdir(temp) == []


# -- a receipt path that cannot be written is refused before the demo runs ---------------


@pytest.fixture
def demo_never_runs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []
    for name in ("_demo", "_demo_approvals"):
        fake = types.ModuleType(f"crewai_idempotent.integration.offline.{name}")
        fake.run_demo = lambda *args, **kwargs: calls.append((args, kwargs))  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, fake.__name__, fake)
    return calls


@pytest.mark.parametrize("command", ["demo", "demo-approvals"])
def test_a_receipt_in_a_folder_that_does_not_exist_is_refused(
    tmp_path: Path, demo_never_runs: list[Any], command: str
) -> None:
    missing = tmp_path / "no-such-folder" / "receipt.json"
    result = CliRunner().invoke(cli, [command, "--receipt", str(missing)])
    assert result.exit_code == 2, result.output
    assert f"the folder {missing.parent} does not exist" in result.output
    assert "Traceback" not in result.output and demo_never_runs == []


def test_a_receipt_that_is_a_folder_or_under_a_file_is_refused(
    tmp_path: Path, demo_never_runs: list[Any]
) -> None:
    (tmp_path / "a-file").write_text("")
    for path, said in [
        (tmp_path, "is a folder; give a file name"),
        (tmp_path / "a-file" / "receipt.json", "is not a folder"),
    ]:
        result = CliRunner().invoke(cli, ["demo", "--receipt", str(path)])
        assert result.exit_code == 2 and said in result.output, result.output
    assert demo_never_runs == []


def test_a_receipt_file_that_cannot_be_written_is_refused(demo_never_runs: list[Any]) -> None:
    # Root ignores file modes: the command runs as nobody, in a folder nobody can reach.
    folder = Path(tempfile.mkdtemp(prefix="crewai-idempotent-receipt-"))
    try:
        folder.chmod(0o755)
        read_only = folder / "receipt.json"
        read_only.write_text("{}")
        read_only.chmod(0o444)

        def invoke() -> Any:
            result = CliRunner().invoke(cli, ["demo", "--receipt", str(read_only)])
            return [result.exit_code, result.output, len(demo_never_runs)]

        code, output, ran = in_child(invoke, unprivileged=True)["value"]
        assert code == 2 and f"{read_only} cannot be written" in output, output
        assert ran == 0 and read_only.read_text() == "{}"
    finally:
        shutil.rmtree(folder)
