"""Shared fixtures. Every backend joins the conformance suite as a `store_<kind>` fixture:
`factory` opens the store of the test's `backend_kind` by asking for that fixture. What
tests import (the backend lists, `BackendFactory`) is in tests/support/stores.py."""

from __future__ import annotations

import contextlib
import os
import re

# Offline and quiet before anything imports crewai.
os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("CREWAI_DISABLE_TRACKING", "true")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")
os.environ.setdefault("CREWAI_TESTING", "true")
os.environ.setdefault("OPENAI_API_KEY", "sk-fake-not-used")
# Ledger errors are spooled on the host until the ledger answers (notifications/
# _incidents.py): the tests' outages spool here, never in the user's state folder. The
# process that made the folder removes it when it ends (the xdist workers and the test's
# child processes inherit the variable and use the same folder; a forked child runs the
# parent's exit hooks, hence the pid).
if "CREWAI_IDEMPOTENCY_SPOOL" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _spool = tempfile.mkdtemp(prefix="crewai-idempotent-spool-")
    os.environ["CREWAI_IDEMPOTENCY_SPOOL"] = _spool

    def _remove_spool(folder: str = _spool, pid: int = os.getpid()) -> None:
        if os.getpid() == pid:
            shutil.rmtree(folder, ignore_errors=True)

    atexit.register(_remove_spool)

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from crewai_idempotent import (
    CacheBackend,
    FileLockCacheBackend,
    InMemoryCacheBackend,
    SQLiteCacheBackend,
)
from tests.support.stores import ALL_BACKENDS, BackendFactory, backend_factory

if TYPE_CHECKING:
    from tests.support.servers import PostgresServer, RedisServer

# The session's throwaway servers (postgres_server, redis_server) are fixtures there; as a
# plugin, its asserts are rewritten too.
pytest_plugins = ["tests.support.servers"]


@pytest.fixture
def store_memory() -> BackendFactory:
    shared = InMemoryCacheBackend()
    return BackendFactory("memory://", lambda: shared)


@pytest.fixture
def store_sqlite(tmp_path: Path) -> BackendFactory:
    path = tmp_path / "ledger.db"
    return BackendFactory(f"sqlite:///{path}", lambda: SQLiteCacheBackend(path))


@pytest.fixture
def store_sqlite_normal(tmp_path: Path) -> BackendFactory:
    path = tmp_path / "ledger.db"
    return BackendFactory(
        f"sqlite:///{path}?synchronous=NORMAL",
        lambda: SQLiteCacheBackend(path, synchronous="NORMAL"),
    )


@pytest.fixture
def store_sqlite_claims(tmp_path: Path) -> BackendFactory:
    """synchronous=CLAIMS: claims synced, commits lazily."""
    path = tmp_path / "ledger.db"
    return BackendFactory(
        f"sqlite:///{path}?synchronous=CLAIMS",
        lambda: SQLiteCacheBackend(path, synchronous="CLAIMS"),
    )


@pytest.fixture
def store_filelock(tmp_path: Path) -> BackendFactory:
    folder = tmp_path / "ledger"
    return BackendFactory(f"file://{folder}", lambda: FileLockCacheBackend(folder))


@pytest.fixture
def store_postgres(postgres_server: PostgresServer) -> BackendFactory:
    """A fresh table per test on the session's server."""
    return BackendFactory(postgres_server.fresh_url())


@pytest.fixture
def store_redis(redis_server: RedisServer) -> BackendFactory:
    """A fresh key prefix per test on the session's server."""
    return BackendFactory(redis_server.fresh_url())


@pytest.fixture(params=ALL_BACKENDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def factory(backend_kind: str, request: pytest.FixtureRequest) -> BackendFactory:
    return backend_factory(backend_kind, request)


@pytest.fixture
def open_backend(factory: BackendFactory) -> Iterator[Callable[[], CacheBackend]]:
    opened: list[CacheBackend] = []

    def open_() -> CacheBackend:
        backend = factory()
        opened.append(backend)
        return backend

    yield open_
    for backend in opened:
        backend.close()


@pytest.fixture
def backend_url(factory: BackendFactory) -> str:
    """A URL that reopens the test's store (for child processes)."""
    return factory.url


@pytest.fixture
def backend(open_backend: Callable[[], CacheBackend]) -> CacheBackend:
    return open_backend()


@pytest.fixture(autouse=True)
def _reconcilers_stay_in_their_test() -> Iterator[None]:
    """The sweeper's registry is process-wide: a tool built in one test (recovery.md's
    pay_invoice with a Stripe verifier) would otherwise answer for the records another
    test's sweeper finds under the same tool name, against a fake server long closed."""
    from crewai_idempotent.reconciliation import _registry

    before = {**_registry._registered}, {**_registry._from_tools}
    yield
    with _registry._lock:
        _registry._registered.clear()
        _registry._registered.update(before[0])
        _registry._from_tools.clear()
        _registry._from_tools.update(before[1])


_FAKETIME_LEFTOVER = re.compile(r"(?:sem\.faketime_sem|faketime_shm)_(\d+)")


@pytest.fixture(autouse=True)
def _faketime_leaves_nothing_for_a_reused_pid() -> Iterator[None]:
    """The `faketime` command keeps a semaphore and a shared-memory segment in /dev/shm
    named by its own pid, and removes them only when it ends normally: a worker killed
    under it (the clock-step tests SIGKILL its process group) leaves them behind, and a
    later `faketime` given the same pid fails with 'sem_open: File exists' (seen once a
    long suite has wrapped the 32768 pids). A dead pid's leftovers go after each test."""
    yield
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return
    for name in names:
        found = _FAKETIME_LEFTOVER.fullmatch(name)
        if found is None:
            continue
        try:
            os.kill(int(found.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass  # alive under another user: not ours to judge


# -- running in parallel -------------------------------------------------------------------


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: twice the cores. Most of a test's time is spent waiting on what it started
    (fresh interpreters, worker processes, servers, leases to lapse), so a core serves two
    workers; PYTEST_XDIST_AUTO_NUM_WORKERS says otherwise."""
    given = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if given:
        return int(given)
    return max(2, min(2 * (os.cpu_count() or 1), 8))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long tests first, in collection order otherwise: a long one that starts last
    would keep the whole run waiting for it alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
