"""Fixtures for the crewai tests; test modules import the ones they use."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crewai_idempotent.integration import _config, _ledgers

from .provider import FakeProvider

REPO = Path(__file__).resolve().parents[3]


def _forget_ledgers() -> None:
    """No process default; the ledgers opened from URLs and default paths closed and
    forgotten, and the "which ledger" announcements said again."""
    _config.configure(None)
    running = sys.modules.get("crewai_idempotent.notifications._inprocess")
    if running is not None:
        running.stop_all()  # their threads use the ledgers closed below
    with _ledgers._lock:
        for backend in [*_ledgers.url_backends.values(), *_ledgers.default_backends.values()]:
            with contextlib.suppress(Exception):  # closing is best effort here
                backend.close()
        _ledgers.url_backends.clear()
        _ledgers.default_backends.clear()
        _ledgers.announced.clear()
    _config.forget_settings()  # tools resolved their ledger among the ones just closed


@pytest.fixture
def isolated_crewai(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    """crewai's storage folder (and so the default ledger) inside tmp_path; no process
    default, no ledger URL from the environment."""
    data = tmp_path / "xdg-data"
    monkeypatch.setenv("XDG_DATA_HOME", str(data))
    # crewai's memory storage would read CREWAI_STORAGE_DIR as a path relative to cwd.
    monkeypatch.delenv("CREWAI_STORAGE_DIR", raising=False)
    monkeypatch.delenv("CREWAI_IDEMPOTENCY_URL", raising=False)
    monkeypatch.delenv("CREWAI_IDEMPOTENCY_NOTIFY", raising=False)
    # crewai locks each SQLite file it keeps with a lock file in the temp folder, named by
    # the file's path and never removed: a test's files are new each time, so its locks
    # go in pytest's own folders with them (beside tmp_path, whose contents tests check).
    temp = tmp_path_factory.mktemp("crewai-locks")
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    _forget_ledgers()
    yield data
    _forget_ledgers()


@pytest.fixture(params=[False, True], ids=["react", "native"])
def native(request: pytest.FixtureRequest) -> bool:
    """Both tool-calling paths: ReAct text, and native function calling."""
    return bool(request.param)


@pytest.fixture
def charges(tmp_path: Path) -> FakeProvider:
    """The fake payment provider: one line per charge in a file."""
    return FakeProvider(tmp_path / "provider.jsonl")


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a fresh interpreter: offline, with the repo importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(
        CREWAI_DISABLE_TELEMETRY="true",
        CREWAI_DISABLE_TRACKING="true",
        OTEL_SDK_DISABLED="true",
        CREWAI_TRACING_ENABLED="false",
        CREWAI_TESTING="true",
        OPENAI_API_KEY="sk-fake-not-used",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        # The test's temp folder (inside tmp_path under isolated_crewai): crewai's lock files.
        TMPDIR=tempfile.gettempdir(),
    )
    env.update(extra)
    return env


PYTHON = sys.executable


class EventLog:
    """Every idempotency event emitted while the `events` fixture is active."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def __call__(self, source: Any, event: Any) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list[Any]:
        from crewai.events.event_bus import crewai_event_bus

        crewai_event_bus.flush()
        return [e for e in self.events if isinstance(e, kind)]


@pytest.fixture
def idem_events() -> Iterator[EventLog]:
    from crewai.events.event_bus import crewai_event_bus

    from crewai_idempotent.integration.events import EVENT_TYPES

    log = EventLog()
    with crewai_event_bus.scoped_handlers():
        for kind in EVENT_TYPES:
            crewai_event_bus.register_handler(kind, log)
        yield log
        crewai_event_bus.flush()
