"""The house rules that tools can check: ruff clean, formatted, and typed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_ruff_finds_nothing() -> None:
    done = _run("ruff", "check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_code_is_formatted() -> None:
    done = _run("ruff", "format", "--check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_package_type_checks() -> None:
    done = _run("mypy")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_all_extra_holds_every_optional_backend_and_integration() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    users = set(extras) - {"all", "test", "bench"}  # the others are for working on this
    assert users == {
        "postgres", "redis", "otel", "stripe", "http", "notify", "apprise", "console",
        "passkeys",
    }, "a new extra: add it to [all] too"  # fmt: skip
    # An extra may share a requirement with another (httpx: the verifiers and the channels).
    assert sorted(extras["all"]) == sorted({dep for name in users for dep in extras[name]})
