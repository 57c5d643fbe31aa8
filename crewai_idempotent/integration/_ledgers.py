"""The ledgers guarded calls use: opened once per URL, per default path, per backend.

`_config` decides which one a call uses (tool, crew, `configure()`, environment, default);
this module opens and keeps them. It loads with the first guarded call, not at activation;
the scheme table loads a store's module (and its client library) only for a URL naming it.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from pathlib import Path

from .._errors import LedgerConfigurationError, LedgerUnavailable
from ..backends._options import redact
from ..backends._url import backend_from_url
from ..ledger._backend import CacheBackend, mark_default, url_of
from ..ledger._ledger import Ledger
from ._compat import db_storage_path

log = logging.getLogger("crewai_idempotent")

URL_ENV = "CREWAI_IDEMPOTENCY_URL"
CHECK_REACHABLE_ENV = "CREWAI_IDEMPOTENCY_CHECK_REACHABLE"
DEFAULT_LEDGER_NAME = "crewai_idempotent.db"
_LEDGER_ATTR = "_crewai_idempotent_ledger"

_lock = threading.RLock()
# Tests close and clear these between cases (tests/support/crewai/fixtures.py).
url_backends: dict[str, CacheBackend] = {}
default_backends: dict[str, CacheBackend] = {}
announced: set[tuple[str, int]] = set()


def default_ledger_path() -> Path:
    """The embedded default: `crewai_idempotent.db` in crewai's storage folder, which
    depends on the current directory (or CREWAI_STORAGE_DIR). Nothing is created.
    Raises nothing."""
    return Path(db_storage_path()) / DEFAULT_LEDGER_NAME


def ledger_for(backend: CacheBackend) -> Ledger:
    """One Ledger per backend object, kept on the backend itself: it lives exactly as long
    as the backend (a crew's backend goes away with the crew) and shares its lease keeper
    across every call that uses it."""
    state = getattr(backend, "__dict__", None)
    if state is None:  # a backend with __slots__: a ledger per call still guards correctly
        return Ledger(backend)
    with _lock:
        ledger = state.get(_LEDGER_ATTR)
        if ledger is None:
            ledger = state[_LEDGER_ATTR] = Ledger(backend)
        return ledger


def backend_from(value: CacheBackend | str) -> CacheBackend:
    """The backend itself, or the one a URL names (opened once per URL)."""
    if isinstance(value, CacheBackend):
        return value
    with _lock:
        backend = url_backends.get(value)
        if backend is None:
            backend = url_backends[value] = backend_from_url(value)
        return backend


def default_backend() -> CacheBackend:
    # Deliberately late: a process whose ledger is a URL never loads sqlite3's store.
    from ..backends.sqlite import SQLiteCacheBackend

    path = str(default_ledger_path())
    with _lock:
        backend = default_backends.get(path)
        if backend is None:
            # crewai's storage folder: ours to make, unlike a folder named by hand.
            backend = default_backends[path] = SQLiteCacheBackend(path, create_parents=True)
            mark_default(backend)  # the CLI finds it by itself: no --ledger in hints
        return backend


def env_backend() -> CacheBackend | None:
    """The ledger CREWAI_IDEMPOTENCY_URL names, or None if it is unset or blank.

    `LedgerConfigurationError` naming the variable if it cannot be used."""
    url = os.environ.get(URL_ENV, "").strip()
    if not url:
        return None
    try:
        return backend_from(url)
    except (LedgerConfigurationError, LedgerUnavailable, ValueError, TypeError) as exc:
        raise LedgerConfigurationError(f"{URL_ENV}={redact(url)!r}: {exc}") from exc


# The server ledgers that answered a reachability check in this process.
_reached: weakref.WeakSet[CacheBackend] = weakref.WeakSet()


def reachability_checked(asked: bool | None) -> bool:
    """Whether a server ledger must answer where it is configured: `asked` if given (the
    `check_reachable` setting), else CREWAI_IDEMPOTENCY_CHECK_REACHABLE (default: yes)."""
    if asked is not None:
        return asked
    value = os.environ.get(CHECK_REACHABLE_ENV, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise LedgerConfigurationError(
        f"{CHECK_REACHABLE_ENV}={value!r}: expected 1/0, true/false, yes/no or on/off"
    )


def check_reachable(backend: CacheBackend, where: str = "") -> None:
    """A PostgreSQL or Redis ledger answers now, within its connect timeout, or this
    raises `LedgerUnavailable` (prefixed by `where` it was configured, if given); once
    per backend."""
    probe = getattr(backend, "check_reachable", None)
    if probe is None or backend in _reached:
        return
    try:
        probe()
    except LedgerUnavailable as exc:
        raise LedgerUnavailable(
            f"{where + ': ' if where else ''}the ledger {url_of(backend)} is not reachable: "
            f"{str(exc).rstrip('.?! ')} (a server ledger is checked where it is configured; "
            f"with check_reachable=False or {CHECK_REACHABLE_ENV}=0, for a process that "
            "starts before its server, the first guarded call reports it instead)"
        ) from exc
    _reached.add(backend)


def describe_default() -> str:
    path = default_ledger_path()
    return (
        f"{path} (the default: crewai's storage folder, named after the current directory "
        f"{path.parent.name!r} unless CREWAI_STORAGE_DIR is set; a crew started from another "
        f"directory uses another ledger. Set {URL_ENV} or configure(backend=...) to pin it)"
    )


def announce(source: str, backend: CacheBackend) -> None:
    """Say once per ledger and source which ledger guarded calls use."""
    with _lock:
        mark = (source, id(backend))
        if mark in announced:
            return
        announced.add(mark)
    where = describe_default() if source == "default" else f"{url_of(backend)} (from {source})"
    log.info("crewai-idempotent: guarded tool calls use the ledger %s", where)
