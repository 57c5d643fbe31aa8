"""Every execution path x every retry source, on the installed crewai release.

The same checks `crewai-idempotent doctor --self-test` runs (integration/offline/_selftest.py):
a scripted model, a counting provider, a crew ledger next to a different process default.
Each case records its path, retry source and executor as JUnit properties: the nox
matrix's `compat_report` builds docs/compatibility.md's table from them.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent.integration.offline import _selftest
from tests.support.crewai.fixtures import PYTHON, subprocess_env
from tests.support.crewai.versions import CREWAI

pytest_plugins = ["tests.support.crewai.fixtures"]
pytestmark = pytest.mark.usefixtures("isolated_crewai")

CHECKS = _selftest.checks()


@pytest.mark.parametrize("check", CHECKS, ids=[c.label for c in CHECKS])
def test_path_and_retry_source(
    check: _selftest.Check, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    record_property("crewai", CREWAI)
    record_property("path", check.path)
    record_property("retry", check.source)
    record_property("executor", check.executor or "default")
    result = _selftest.run_check(check, tmp_path)
    assert result.passed, f"{check.label} on crewai {CREWAI}: {result.detail}"


def test_every_path_and_source_is_checked() -> None:
    covered = {(c.path, c.source) for c in CHECKS}
    expected = {
        (p, s)
        for p in _selftest.PATHS
        for s in _selftest.SOURCES
        if (p, s) not in _selftest.NOT_APPLICABLE
    }
    assert covered == expected


def test_a_check_fails_when_the_guard_is_not_in_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crewai_idempotent.integration import _guard

    def unguarded(
        target: object, options: object, tool: object, fn: Any, args: Any, kw: Any
    ) -> Any:
        return fn(*args, **kw)

    monkeypatch.setattr(_guard, "call", unguarded)
    result = _selftest.run_check(_selftest.Check("native", "guardrail"), tmp_path)
    assert not result.passed and "charges made ['inv-1', 'inv-1']" in result.detail


@pytest.mark.slow
def test_doctor_self_test_reports_every_check_as_it_finishes(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [PYTHON, "-m", "crewai_idempotent.cli", "doctor", "--self-test"],
        cwd=tmp_path,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    lines = [process.stdout.readline().rstrip("\n")]
    lines.append(process.stdout.readline().rstrip("\n"))
    # The first check's line arrives while the others still run, not all at the end.
    running_after_first = process.poll() is None
    rest, errors = process.communicate(timeout=600)
    lines += rest.splitlines()
    assert process.returncode == 0, "\n".join(lines)[-3000:] + errors[-3000:]
    assert running_after_first
    assert lines[0] == f"crewai {CREWAI}: {len(CHECKS)} checks (path x retry source [executor])"
    assert lines[1].startswith("  pass  ")
    assert sum(line.startswith("  pass  ") for line in lines) == len(CHECKS)
    assert lines[-1].startswith("self-test passed in ")
