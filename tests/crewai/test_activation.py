"""Activation: an explicit import always activates; CREWAI_IDEMPOTENT_AUTOLOAD=0 switches off
only the start-up hook, and never leaves a bare TypeError; the strict tool forms refuse to
run unguarded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent import GuardInactive, InMemoryCacheBackend, configure, install, uninstall
from tests.support.crewai.fixtures import REPO, subprocess_env
from tests.support.crewai.provider import FakeProvider

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")


def _run(program: str, **env: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", program],
        cwd=REPO,
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


CHARGE_TWICE = """
from crewai_idempotent import InMemoryCacheBackend, configure
configure(backend=InMemoryCacheBackend())
charges = []

@tool("charge", idempotent=True, idempotency_key="pay:{invoice}")
def charge(invoice: str) -> str:
    '''Charge.'''
    charges.append(invoice)
    return "ch_" + invoice

charge.run(invoice="1")
charge.run(invoice="1")
"""


@pytest.mark.slow
def test_import_activates_with_the_start_up_hook_switched_off() -> None:
    after_crewai = _run(
        "import json, crewai\nfrom crewai.tools import tool\nimport crewai_idempotent\n"
        + CHARGE_TWICE
        + "from crewai_idempotent.integration import is_installed\n"
        "print(json.dumps({'installed': is_installed(), 'charges': len(charges)}))",
        CREWAI_IDEMPOTENT_AUTOLOAD="0",
    )
    assert after_crewai == {"installed": True, "charges": 1}
    before_crewai = _run(
        "import json, crewai_idempotent\nfrom crewai.tools import tool\n"
        + CHARGE_TWICE
        + "print(json.dumps({'charges': len(charges)}))",
        CREWAI_IDEMPOTENT_AUTOLOAD="off",
    )
    assert before_crewai == {"charges": 1}


def test_switched_off_tool_options_fail_with_an_explanation() -> None:
    report = _run(
        """
import json, sys
from crewai.tools import tool, BaseTool
import crewai.tools.base_tool
report = {"loaded": "crewai_idempotent" in sys.modules}
try:
    tool("x", idempotent=True)
except TypeError as exc:
    report["error"] = str(exc)
try:
    crewai.tools.base_tool.tool("x", idempotency_key="k")
except TypeError as exc:
    report["error2"] = str(exc)

@tool("plain")
def plain(a: int) -> int:
    '''Plain.'''
    return a

report["plain"] = plain.run(a=2)
print(json.dumps(report))
""",
        CREWAI_IDEMPOTENT_AUTOLOAD="0",
    )
    assert report["loaded"] is False  # crewai was left alone
    assert "not active" in report["error"] and "import crewai_idempotent" in report["error"]
    assert "idempotency_key" in report["error2"]
    assert report["plain"] == 2


def test_the_hint_knows_every_tool_option() -> None:
    from _crewai_idempotent_autoload import OPTION_NAMES as HOOK_NAMES
    from crewai_idempotent.integration._config import OPTION_NAMES

    assert set(HOOK_NAMES) == set(OPTION_NAMES)


def test_idempotent_tool_refuses_to_run_unguarded(charges: FakeProvider) -> None:
    from crewai_idempotent import IdempotentTool

    configure(backend=InMemoryCacheBackend())

    class Charge(IdempotentTool):
        name: str = "charge_strict"
        description: str = "Charge once."
        idempotency_key: str = "strict:{invoice}"
        provider_path: str

        def _run(self, invoice: str) -> str:
            return FakeProvider(self.provider_path).charge(5, "alice", invoice=invoice)

    tool = Charge(provider_path=str(charges.path))
    assert tool.run(invoice="i-1") == tool.run(invoice="i-1")
    assert charges.count() == 1

    uninstall()
    try:
        with pytest.raises(GuardInactive, match="must only run guarded"):
            tool.run(invoice="i-2")
        with pytest.raises(GuardInactive):
            Charge(provider_path=str(charges.path))._run(invoice="i-3")
        assert charges.count() == 1
    finally:
        install()
    assert tool.run(invoice="i-2") == tool.run(invoice="i-2")
    assert charges.count() == 2

    with pytest.raises(ValueError, match="idempotent"):
        Charge(provider_path=str(charges.path), idempotent=False)


def test_idempotent_tool_async(charges: FakeProvider) -> None:
    import asyncio

    from crewai_idempotent import IdempotentTool

    configure(backend=InMemoryCacheBackend())

    class AsyncCharge(IdempotentTool):
        name: str = "charge_async_strict"
        description: str = "Charge once."
        provider_path: str

        def _run(self, invoice: str) -> str:
            raise NotImplementedError

        async def _arun(self, invoice: str) -> str:
            return FakeProvider(self.provider_path).charge(5, "bob", invoice=invoice)

    tool = AsyncCharge(provider_path=str(charges.path))
    first = asyncio.run(tool.arun(invoice="a"))
    assert asyncio.run(tool.arun(invoice="a")) == first and charges.count() == 1
    uninstall()
    try:
        with pytest.raises(GuardInactive):
            asyncio.run(tool.arun(invoice="b"))
    finally:
        install()
    assert charges.count() == 1


def test_idempotent_tool_decorator_is_always_guarded(charges: FakeProvider) -> None:
    from crewai_idempotent import idempotent_tool

    configure(backend=InMemoryCacheBackend())

    @idempotent_tool("charge_decorated", idempotency_key="dec:{invoice}")
    def charge(invoice: str) -> str:
        """Charge once."""
        return charges.charge(5, "carol", invoice=invoice)

    assert charge.run(invoice="1") == charge.run(invoice="1")
    uninstall()
    try:  # the tool carries its guard: still one charge
        assert charge.run(invoice="1") == charge.run(invoice="1")
    finally:
        install()
    assert charges.count() == 1
    with pytest.raises(ValueError, match="drop idempotent=False"):
        idempotent_tool("x", idempotent=False)


def test_strict_forms_activate_even_when_switched_off(tmp_path: Path) -> None:
    provider = tmp_path / "provider.jsonl"
    report = _run(
        f"""
import json
from crewai_idempotent import IdempotentTool, InMemoryCacheBackend, configure
from tests.support.crewai.provider import FakeProvider
configure(backend=InMemoryCacheBackend())

class Charge(IdempotentTool):
    name: str = "charge"
    description: str = "Charge once."

    def _run(self, invoice: str) -> str:
        return FakeProvider({str(provider)!r}).charge(5, "dan", invoice=invoice)

tool = Charge()
tool.run(invoice="1")
tool.run(invoice="1")
print(json.dumps({{"charges": FakeProvider({str(provider)!r}).count()}}))
""",
        CREWAI_IDEMPOTENT_AUTOLOAD="0",
    )
    assert report == {"charges": 1}


@pytest.mark.slow
def test_uninstall_drops_the_pending_import_hook(tmp_path: Path) -> None:
    """Before crewai is imported, `uninstall()` leaves nothing waiting for it: the later
    `import crewai` is crewai alone, whether the start-up hook or the import set it up."""
    probe = """
import json, sys
import crewai_idempotent
from crewai_idempotent.integration import is_installed
waiting = [f for f in sys.meta_path if getattr(f, "_crewai_idempotent_hook", False)]
crewai_idempotent.uninstall()
import crewai
from crewai.tools import tool
report = {"waiting_before": len(waiting), "installed": is_installed()}
try:
    tool("x", idempotent=True)
    report["tool_kwarg"] = "accepted"
except TypeError:
    report["tool_kwarg"] = "refused"
crewai_idempotent.install()  # and an explicit install still works
report["installed_after_install"] = is_installed()
print(json.dumps(report))
"""
    expected = {
        "waiting_before": 1,
        "installed": False,
        "tool_kwarg": "refused",
        "installed_after_install": True,
    }
    assert _run(probe, CREWAI_IDEMPOTENT_AUTOLOAD="1") == expected
    assert _run(probe, CREWAI_IDEMPOTENT_AUTOLOAD="0") == expected


# What `import crewai` with the integration active must not load (activation adds under
# 10 ms): the ledger, stores, gates, tracing, and crewai's LiteAgent module.
HEAVY = (
    "crewai_idempotent.ledger._ledger",
    "crewai_idempotent.gates._approvals",
    "crewai_idempotent.gates._spend",
    "crewai_idempotent._otel",
    "crewai_idempotent.ledger._record",
    "crewai_idempotent.backends",
    "crewai_idempotent.integration._config",
    "crewai_idempotent.integration._guard",
    "crewai_idempotent.integration._gates",
    "crewai_idempotent.integration._flag",
    "crewai.lite_agent",
    "rfc8785",
)


def test_activation_loads_only_what_it_patches_in() -> None:
    report = _run(
        f"""
import json, sys
import crewai
from crewai.tools import BaseTool
from crewai_idempotent.integration import is_installed
active = is_installed()
heavy = [m for m in {HEAVY!r} if m in sys.modules]

class Lookup(BaseTool):
    name: str = "lookup"
    description: str = "Look a thing up."

    def _run(self, q: str) -> str:
        return q

answer = Lookup().run(q="x")  # an unflagged tool: still nothing of the guard
print(json.dumps({{
    "active": active,
    "heavy": heavy,
    "guarded_run": hasattr(Lookup._run, "__crewai_idempotent_guard__"),
    "answer": answer,
    "heavy_after_call": [m for m in {HEAVY!r} if m in sys.modules],
}}))
""",
        CREWAI_IDEMPOTENT_AUTOLOAD="1",
    )
    assert report == {
        "active": True,
        "heavy": [],
        "guarded_run": True,
        "answer": "x",
        "heavy_after_call": [],
    }


@pytest.mark.slow
def test_lite_agent_is_patched_when_its_module_is_imported() -> None:
    """crewai.lite_agent is left to load when used; its kickoff gets the boundary then, and
    not after uninstall()."""
    report = _run(
        """
import json, sys
import crewai, crewai_idempotent
report = {"loaded_at_activation": "crewai.lite_agent" in sys.modules}
from crewai.lite_agent import LiteAgent
report["patched"] = "kickoff" in vars(LiteAgent) and hasattr(LiteAgent.kickoff, "__wrapped__")
crewai_idempotent.uninstall()
report["restored"] = not hasattr(LiteAgent.kickoff, "__wrapped__")
print(json.dumps(report))
""",
        CREWAI_IDEMPOTENT_AUTOLOAD="0",
    )
    assert report == {"loaded_at_activation": False, "patched": True, "restored": True}
    untouched = _run(
        """
import json
import crewai, crewai_idempotent
crewai_idempotent.uninstall()
from crewai.lite_agent import LiteAgent
print(json.dumps({"patched": hasattr(LiteAgent.kickoff, "__wrapped__")}))
""",
        CREWAI_IDEMPOTENT_AUTOLOAD="0",
    )
    assert untouched == {"patched": False}


def test_every_public_name_imports() -> None:
    report = _run(
        """
import json, sys
import crewai_idempotent
names = crewai_idempotent.__all__
namespace = {}
exec("from crewai_idempotent import *", namespace)
missing = [n for n in names if n not in namespace]
import crewai_idempotent.integration as integration
missing += [n for n in integration.__all__ if not hasattr(integration, n)]
print(json.dumps({"missing": missing, "count": len(names)}))
""",
    )
    assert report["missing"] == [] and report["count"] > 40


def test_the_start_up_hook_imports_nothing_of_the_package() -> None:
    """Activation runs one way: package -> integration -> hook module. The hook reaches
    the integration only through the entry-point string the .pth hands it."""
    import ast

    hook = REPO / "_crewai_idempotent_autoload.py"
    imported = [
        alias.name if isinstance(node, ast.Import) else str(node.module)
        for node in ast.walk(ast.parse(hook.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert imported and not [name for name in imported if name.startswith("crewai_idempotent")]
    pth = (REPO / "crewai_idempotent_autoload.pth").read_text()
    assert '"crewai_idempotent.integration:install"' in pth


def test_unsupported_crewai_version_is_an_idempotency_error() -> None:
    import pickle

    from crewai_idempotent import IdempotencyError
    from crewai_idempotent.integration import UnsupportedCrewAIVersion

    error = UnsupportedCrewAIVersion("crewai 9.0 is installed")
    assert isinstance(error, IdempotencyError) and isinstance(error, RuntimeError)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is UnsupportedCrewAIVersion and str(copy) == str(error)


def test_importing_the_package_alone_loads_no_asyncio_and_no_ledger() -> None:
    report = _run(
        f"""
import json, sys
import crewai_idempotent
print(json.dumps({{
    "asyncio": "asyncio" in sys.modules,
    "crewai": "crewai" in sys.modules,
    "heavy": [m for m in {HEAVY!r} if m in sys.modules],
}}))
""",
        CREWAI_IDEMPOTENT_AUTOLOAD="0",
    )
    assert report == {"asyncio": False, "crewai": False, "heavy": []}
