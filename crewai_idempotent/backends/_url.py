"""Which backend a ledger URL such as CREWAI_IDEMPOTENCY_URL names.

The scheme picks the backend class; the class's own `from_url` reads the rest of the URL
and refuses any option it does not know. A backend's module is imported only when a URL
names it, so a server client library is loaded (or found missing) on first use.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .._errors import LedgerConfigurationError
from ..ledger._backend import CacheBackend
from ._options import redact

#: scheme -> (module in this package, class, the extra that installs its client library)
SCHEMES: dict[str, tuple[str, str, str | None]] = {
    "sqlite": (".sqlite", "SQLiteCacheBackend", None),
    "file": (".filelock", "FileLockCacheBackend", None),
    "memory": (".memory", "InMemoryCacheBackend", None),
    "postgresql": (".postgres", "PostgresCacheBackend", "postgres"),
    "postgres": (".postgres", "PostgresCacheBackend", "postgres"),
    "redis": (".redis", "RedisCacheBackend", "redis"),
    "rediss": (".redis", "RedisCacheBackend", "redis"),
}
# The local schemes, whose URL names a file or folder on this host.
_LOCAL = ("sqlite", "file")


def _scheme(url: str) -> str:
    try:
        return urlsplit(url).scheme.lower()
    except ValueError as exc:
        raise LedgerConfigurationError(f"malformed ledger URL {redact(url)!r}: {exc}") from None


def _backend_class(scheme: str, url: str) -> Any:
    module, name, extra = SCHEMES[scheme]
    try:
        return getattr(importlib.import_module(module, __package__), name)
    except ImportError as exc:
        if extra is None:
            raise
        # The backend module's own ImportError names the extra to install.
        extra_name = f"crewai-idempotent[{extra}]"
        hint = "" if extra_name in str(exc) else f" (the '{extra_name}' extra installs it)"
        raise LedgerConfigurationError(f"{redact(url)}: {exc}{hint}") from exc


def backend_from_url(url: str) -> CacheBackend:
    """`sqlite:///relative.db`, `sqlite:////abs/ledger.db?synchronous=NORMAL`,
    `file:///abs/dir`, `memory://`, and the server schemes (postgresql://, redis://).

    `url` is the ledger URL. Raises `TypeError` for a `url` that is not a str,
    `LedgerConfigurationError` for a malformed URL, an unknown scheme or option (or a
    server backend whose client library is missing, naming the extra), and what the
    backend's constructor raises."""
    if not isinstance(url, str):
        raise TypeError(f"a ledger URL is a str, not {type(url).__name__}")
    scheme = _scheme(url)
    if scheme not in SCHEMES:
        known = ", ".join(sorted(SCHEMES))
        what = f"unknown ledger URL scheme {scheme!r}" if scheme else "no URL scheme"
        hint = (
            f"; a SQLite file is sqlite:///{url}"
            if not scheme and url.endswith((".db", ".sqlite", ".sqlite3"))
            else ""
        )
        raise LedgerConfigurationError(f"{what} in {redact(url)!r}; known: {known}{hint}")
    backend: CacheBackend = _backend_class(scheme, url).from_url(url)
    return backend


def local_path(url: str) -> Path | None:
    """The file (sqlite:) or folder (file:) a local ledger URL names, made absolute,
    without opening it; None for the other schemes."""
    scheme = _scheme(url)
    if scheme not in _LOCAL:
        return None
    path: Path = _backend_class(scheme, url).path_from_url(url)
    return path
