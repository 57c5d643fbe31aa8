"""Shared fixtures. Every backend joins the conformance suite through `make_backend`."""

from __future__ import annotations

import os

# Offline and quiet before anything imports crewai.
os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("CREWAI_DISABLE_TRACKING", "true")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")
os.environ.setdefault("CREWAI_TESTING", "true")
os.environ.setdefault("OPENAI_API_KEY", "sk-fake-not-used")

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from crewai_idempotent import (
    CacheBackend,
    FileLockCacheBackend,
    InMemoryCacheBackend,
    SQLiteCacheBackend,
)
from tests.servers import postgres_factory, postgres_server, redis_factory, redis_server  # noqa: F401

# Backends that persist across processes; the in-memory one joins only in-process tests.
DURABLE_BACKENDS = ["sqlite", "sqlite-normal", "filelock", "postgres", "redis"]
ALL_BACKENDS = ["memory", *DURABLE_BACKENDS]
if os.environ.get("CONFORMANCE_BACKENDS"):  # patches/verify.sh: crewAI core's store alone
    ALL_BACKENDS = os.environ["CONFORMANCE_BACKENDS"].split(",")


class BackendFactory:
    """Opens (or re-opens) one store. `url` reopens the same store in another process."""

    def __init__(self, url: str, open_: Callable[[], CacheBackend]) -> None:
        self.url = url
        self._open = open_

    def __call__(self) -> CacheBackend:
        return self._open()


def backend_factory(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Callable[[], CacheBackend]:
    """A zero-argument callable (with a `.url`) that opens the same store of `kind`."""
    if kind == "memory":
        shared = InMemoryCacheBackend()
        return BackendFactory("memory://", lambda: shared)
    if kind == "sqlite":
        path = tmp_path / "ledger.db"
        return BackendFactory(f"sqlite:///{path}", lambda: SQLiteCacheBackend(path))
    if kind == "sqlite-normal":
        path = tmp_path / "ledger.db"
        return BackendFactory(
            f"sqlite:///{path}?synchronous=NORMAL",
            lambda: SQLiteCacheBackend(path, synchronous="NORMAL"),
        )
    if kind == "sqlite-claims":  # synchronous=CLAIMS: claims synced, commits lazily
        path = tmp_path / "ledger.db"
        return BackendFactory(
            f"sqlite:///{path}?synchronous=CLAIMS",
            lambda: SQLiteCacheBackend(path, synchronous="CLAIMS"),
        )
    if kind == "filelock":
        folder = tmp_path / "ledger"
        return BackendFactory(f"file://{folder}", lambda: FileLockCacheBackend(folder))
    if kind in EXTRA_FACTORIES:
        return EXTRA_FACTORIES[kind](tmp_path, request)
    raise ValueError(kind)


# Later backends (PostgreSQL, Redis) register here: kind -> (tmp_path, request) -> factory.
EXTRA_FACTORIES: dict[str, Callable[[Path, pytest.FixtureRequest], Callable[[], CacheBackend]]] = {}
EXTRA_FACTORIES.update(postgres=postgres_factory, redis=redis_factory)


@pytest.fixture(params=ALL_BACKENDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def factory(
    backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Callable[[], CacheBackend]:
    return backend_factory(backend_kind, tmp_path, request)


@pytest.fixture
def open_backend(factory: Callable[[], CacheBackend]) -> Iterator[Callable[[], CacheBackend]]:
    opened: list[CacheBackend] = []

    def open_() -> CacheBackend:
        backend = factory()
        opened.append(backend)
        return backend

    yield open_
    for backend in opened:
        backend.close()


@pytest.fixture
def backend_url(factory: Callable[[], CacheBackend]) -> str:
    """A URL that reopens the test's store (for child processes)."""
    return str(getattr(factory, "url"))  # noqa: B009 - factories from EXTRA_FACTORIES too


@pytest.fixture
def backend(open_backend: Callable[[], CacheBackend]) -> CacheBackend:
    return open_backend()
