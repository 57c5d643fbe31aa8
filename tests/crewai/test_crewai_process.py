"""Fresh interpreters: the installed package guards tools without being imported, a
kickoff in another process replays the same ledger, and the switch-off and uninstall
leave crewai exactly as it was."""

from __future__ import annotations

import json
import re
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import SQLiteCacheBackend, Status, configure, install, uninstall
from crewai_idempotent.integration import is_installed
from tests.support.crewai.crews import charge_tool, payment_crew, scripted
from tests.support.crewai.fixtures import PYTHON, REPO, subprocess_env
from tests.support.crewai.provider import FakeProvider

pytest_plugins = ["tests.support.crewai.fixtures"]

SPEC_TIMEOUT = 300  # importing crewai alone takes several seconds on a slow machine


def _run_payment(spec: dict[str, Any], **env: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [PYTHON, "-m", "tests.support.crewai.run_payment", json.dumps(spec)],
        cwd=REPO,
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=SPEC_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def second_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each path's crew kicked off here, then again in a fresh interpreter on the same
    ledger, which is named only by CREWAI_IDEMPOTENCY_URL there."""
    tmp = tmp_path_factory.mktemp("second-process")
    ledger = tmp / "ledger.db"
    previous = configure(backend=f"sqlite:///{ledger}")
    first: dict[bool, str] = {}
    try:
        for native in (False, True):
            charges = FakeProvider(tmp / f"charges-{native}.jsonl")
            args = {"amount": 5, "recipient": "alice", "invoice": f"inv-{native}"}
            charge = charge_tool(charges, idempotent=True)  # the default key
            crew, _ = payment_crew([charge], scripted(native, [("charge_card", args)]), reject=1)
            first[native] = crew.kickoff().raw
    finally:
        configure(previous)
    runs = [
        {
            "native": native,
            "provider": str(tmp / f"charges-{native}.jsonl"),
            "invoice": f"inv-{native}",
            "reject": 1,
            "fail_times": 1,
        }
        for native in (False, True)
    ]
    lines = _run_payment(
        {"runs": runs}, CREWAI_IDEMPOTENCY_URL=f"sqlite:///{ledger}", XDG_DATA_HOME=str(tmp / "xdg")
    )
    return {"tmp": tmp, "ledger": ledger, "first": first, "header": lines[0], "runs": lines[1:]}


@pytest.mark.parametrize("native", [False, True], ids=["react", "native"])
def test_fresh_process_on_the_same_ledger_replays(
    second_process: dict[str, Any], native: bool
) -> None:
    (run,) = [r for r in second_process["runs"] if r["native"] is native]
    assert "error" not in run, run
    assert run["attempts"] == 3  # guardrail retry and agent retry in the second process too
    assert run["raw"] == second_process["first"][native]  # the first process's receipt
    charges = FakeProvider(second_process["tmp"] / f"charges-{native}.jsonl")
    assert charges.count() == 1
    with SQLiteCacheBackend(second_process["ledger"]) as backend:
        assert len(list(backend.scan(Status.COMMITTED))) == 2


def test_installed_package_guards_without_being_imported(second_process: dict[str, Any]) -> None:
    header = second_process["header"]
    assert header == {"imported_before_crewai": False, "imported_after_crewai": True}


UNINSTALL_PROBE = r"""
import json, sys, types
import crewai
import crewai.tools, crewai.tools.base_tool
from crewai import Agent, Crew, Task
from crewai.lite_agent import LiteAgent
from crewai.tools import BaseTool
from crewai.tools.base_tool import Tool

report = {"loaded_by_crewai": "crewai_idempotent" in sys.modules}
try:
    crewai.tools.tool("x", idempotent=True)
    report["tool_kwarg"] = "accepted"
except TypeError:
    report["tool_kwarg"] = "refused"

def subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from subclasses(sub)

classes = [BaseTool, Tool, Crew, Task, Agent, LiteAgent, *subclasses(BaseTool)]
modules = [crewai.tools, crewai.tools.base_tool]
before = {c: dict(vars(c)) for c in classes}
before_modules = {m: dict(vars(m)) for m in modules}

import crewai_idempotent
from crewai_idempotent.integration import is_installed
report["installed_by_import"] = is_installed()
crewai_idempotent.install()
crewai_idempotent.install()
report["installed"] = is_installed()
report["changed"] = sorted(c.__name__ for c in classes if dict(vars(c)) != before[c])

class LaterTool(BaseTool):
    name: str = "later"
    description: str = "defined while installed"
    def _run(self, x: int) -> int:
        return x
original_run = LaterTool.__dict__["_run"].__crewai_idempotent_guard__

crewai_idempotent.uninstall()
report["installed_after"] = is_installed()
report["restored"] = all(
    set(vars(c)) == set(before[c]) and all(vars(c)[k] is v for k, v in before[c].items())
    for c in classes
)
report["modules_restored"] = all(
    all(vars(m).get(k) is v for k, v in before_modules[m].items())
    and all(isinstance(vars(m)[k], types.ModuleType) for k in set(vars(m)) - set(before_modules[m]))
    for m in modules
)
report["later_tool_restored"] = LaterTool.__dict__["_run"] is original_run
print(json.dumps(report))
"""


def test_switched_off_and_uninstall_restores_crewai_exactly() -> None:
    done = subprocess.run(
        [PYTHON, "-c", UNINSTALL_PROBE],
        cwd=REPO,
        env=subprocess_env(CREWAI_IDEMPOTENT_AUTOLOAD="0"),
        capture_output=True,
        text=True,
        timeout=SPEC_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    changed = set(report.pop("changed"))
    assert report == {
        "loaded_by_crewai": False,  # CREWAI_IDEMPOTENT_AUTOLOAD=0: crewai imported alone
        "tool_kwarg": "refused",  # crewai's own @tool, untouched
        "installed_by_import": True,  # an explicit import activates; the switch is start-up only
        "installed": True,
        "installed_after": False,
        "restored": True,
        "modules_restored": True,
        "later_tool_restored": True,
    }
    # install() did change these (and crewai's own class tools, whose _run it guards)
    assert {"Agent", "BaseTool", "Crew", "LiteAgent", "Task"} <= changed


def test_uninstall_then_install_in_process(tmp_path: Path) -> None:
    import crewai.tools
    from crewai.tools.base_tool import BaseTool

    assert is_installed()
    patched_init = BaseTool.__init__
    uninstall()
    try:
        assert not is_installed()
        assert "__init__" not in vars(BaseTool)
        with pytest.raises(TypeError):
            crewai.tools.tool("x", idempotent=True)
    finally:
        install()
    assert is_installed() and BaseTool.__init__ is not patched_init
    charges = FakeProvider(tmp_path / "charges.jsonl")
    configure(backend=f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        charge = charge_tool(charges, idempotent=True)
        charge.run(amount=1, recipient="bob")
        charge.run(amount=1, recipient="bob")
    finally:
        configure(None)
    assert charges.count() == 1


@pytest.mark.parametrize("version", ["1.9.9", "1.16.0", "2.0.0", "nightly"])
def test_untested_crewai_versions_are_named(version: str) -> None:
    from crewai_idempotent.integration import UnsupportedCrewAIVersion
    from crewai_idempotent.integration._patch import check_version

    with pytest.raises(UnsupportedCrewAIVersion, match=re.escape(f"crewai {version} is installed")):
        check_version(version)


@pytest.mark.parametrize("version", ["1.10.0", "1.14.5", "1.15.30", "1.15.31", "1.15.40rc1"])
def test_supported_crewai_versions(version: str) -> None:
    from crewai_idempotent.integration._patch import check_version

    check_version(version)


def test_untested_crewai_fails_closed_for_flagged_tools_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import crewai
    from crewai.crew import Crew
    from crewai.task import Task

    from crewai_idempotent.integration import UnsupportedCrewAIVersion

    charges = FakeProvider(tmp_path / "charges.jsonl")
    uninstall()
    try:
        monkeypatch.delenv("CREWAI_IDEMPOTENT_ALLOW_UNTESTED", raising=False)
        monkeypatch.setattr(crewai, "__version__", "1.16.0")
        with pytest.warns(RuntimeWarning, match=r"crewai 1\.16\.0 is installed") as caught:
            install()
        assert is_installed()
        # Only the option-taking patches: no kickoff boundaries, no version shims.
        assert not hasattr(Task._execute_core, "__wrapped__")
        assert not hasattr(Crew.copy, "__wrapped__")
        flagged = charge_tool(charges, idempotent=True)
        with pytest.raises(UnsupportedCrewAIVersion, match="doctor --self-test"):
            flagged.run(amount=1, recipient="bob")
        assert charges.count() == 0  # the body never ran
        plain = charge_tool(charges)
        plain.run(amount=1, recipient="bob")
        plain.run(amount=1, recipient="bob")
        assert charges.count() == 2  # unflagged: crewai's own behaviour
        uninstall()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the warning is said once per process
            install()
        assert len([w for w in caught if "1.16.0" in str(w.message)]) == 1
    finally:
        uninstall()
        monkeypatch.undo()
        install()
    assert is_installed() and hasattr(Task._execute_core, "__wrapped__")
    charge = charge_tool(charges, idempotent=True)
    configure(backend=f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        charge.run(amount=1, recipient="carol")
        charge.run(amount=1, recipient="carol")
    finally:
        configure(None)
    assert charges.count() == 3  # the full guard is back


def test_allow_untested_installs_the_full_guard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import crewai
    from crewai.task import Task

    charges = FakeProvider(tmp_path / "charges.jsonl")
    uninstall()
    try:
        monkeypatch.setenv("CREWAI_IDEMPOTENT_ALLOW_UNTESTED", "1")
        monkeypatch.setattr(crewai, "__version__", "1.17.0")
        with pytest.warns(RuntimeWarning, match="CREWAI_IDEMPOTENT_ALLOW_UNTESTED is set"):
            install()
        assert hasattr(Task._execute_core, "__wrapped__")
        configure(backend=f"sqlite:///{tmp_path / 'ledger.db'}")
        charge = charge_tool(charges, idempotent=True)
        assert charge.run(amount=1, recipient="bob") == charge.run(amount=1, recipient="bob")
        assert charges.count() == 1
    finally:
        configure(None)
        uninstall()
        monkeypatch.undo()
        install()


UNTESTED_IMPORT = r"""
import json, warnings
warnings.simplefilter("always")
from crewai_idempotent.integration import _patch
# Stands for a crewai outside the supported range (older, or a newer minor).
_patch.is_tested = _patch.is_supported = lambda version: False
with warnings.catch_warnings(record=True) as caught:
    import crewai  # activates the integration through the import hook
from crewai.tools import tool
from crewai_idempotent.integration import UnsupportedCrewAIVersion
calls = []

@tool("charge_card", idempotent=True)
def charge_card(amount: int) -> str:
    "Charge."
    calls.append(amount)
    return "ch_1"

@tool("lookup")
def lookup(amount: int) -> str:
    "Look up."
    calls.append(-amount)
    return "ok"

try:
    charge_card.run(amount=5)
    refused = False
except UnsupportedCrewAIVersion:
    refused = True
said = [str(w.message) for w in caught if "crewai-idempotent" in str(w.message)]
print(json.dumps({"refused": refused, "plain": lookup.run(amount=1), "calls": calls,
                  "warnings": said}))
"""


def test_import_crewai_never_breaks_on_an_untested_release() -> None:
    done = subprocess.run(
        [PYTHON, "-c", UNTESTED_IMPORT],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=SPEC_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["refused"] and report["plain"] == "ok" and report["calls"] == [-1]
    assert len(report["warnings"]) == 1 and "doctor --self-test" in report["warnings"][0]


WHEEL_PROBE = r"""
import json, os, site, sys
site.addsitedir(sys.argv[1])  # the wheel's site dir: its .pth files run, as at start-up
sys.path.append(sys.argv[2])  # crewai and the other dependencies, no .pth files run
hooked = any(getattr(f, "_crewai_idempotent_hook", False) for f in sys.meta_path)
imported_early = "crewai_idempotent" in sys.modules
from crewai.tools import tool

calls = []

@tool("charge_card", idempotent=True)
def charge_card(amount: int) -> str:
    '''Charge.'''
    calls.append(amount)
    return f"ch_{len(calls)}"

first, second = charge_card.run(amount=5), charge_card.run(amount=5)
import crewai_idempotent
print(json.dumps({"hooked": hooked, "imported_early": imported_early, "calls": len(calls),
                  "same": first == second, "from": crewai_idempotent.__file__}))
"""


@pytest.mark.slow
def test_regular_wheel_install_activates_on_crewai_import(tmp_path: Path) -> None:
    import site
    import zipfile

    built = subprocess.run(
        [PYTHON, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(REPO)],
        capture_output=True,
        text=True,
        timeout=SPEC_TIMEOUT,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("crewai_idempotent-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"crewai_idempotent_autoload.pth", "_crewai_idempotent_autoload.py"} <= names
    target = tmp_path / "site"
    installed = subprocess.run(
        [PYTHON, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=SPEC_TIMEOUT,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]

    env = subprocess_env(CREWAI_IDEMPOTENCY_URL=f"sqlite:///{tmp_path / 'ledger.db'}")
    env.pop("PYTHONPATH")  # only the wheel may provide crewai_idempotent
    dependencies = site.getsitepackages()[0]
    done = subprocess.run(
        [PYTHON, "-S", "-c", WHEEL_PROBE, str(target), dependencies],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=SPEC_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["from"].startswith(str(target))
    assert report | {"from": None} == {
        "hooked": True,
        "imported_early": False,
        "calls": 1,
        "same": True,
        "from": None,
    }
