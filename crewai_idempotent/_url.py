"""Building a backend from a URL such as CREWAI_IDEMPOTENCY_URL."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, parse_qsl, unquote, urlencode, urlsplit

from ._backend import CacheBackend

_TRUE = {"1", "true", "yes", "on"}


def _sqlite(url: str) -> CacheBackend:
    from ._sqlite import SQLiteCacheBackend

    parts = urlsplit(url)
    path, options = _local_path(url), dict(parse_qsl(parts.query))
    return SQLiteCacheBackend(
        path,
        synchronous=options.get("synchronous", "FULL"),
        busy_timeout_s=float(options.get("busy_timeout_s", 5.0)),
        allow_insecure_path=options.get("allow_insecure_path", "").lower() in _TRUE,
    )


def _file(url: str) -> CacheBackend:
    from ._filelock import FileLockCacheBackend

    options = dict(parse_qsl(urlsplit(url).query))
    return FileLockCacheBackend(
        _local_path(url),
        fsync=options.get("fsync", "true").lower() in _TRUE,
        allow_insecure_path=options.get("allow_insecure_path", "").lower() in _TRUE,
    )


def _memory(url: str) -> CacheBackend:
    from ._memory import InMemoryCacheBackend

    return InMemoryCacheBackend()


def _local_path(url: str) -> Path:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{url!r}: a local ledger URL has no host; use scheme:///absolute/path")
    path = unquote(parts.path)
    if not path or path == "/":
        raise ValueError(f"{url!r} names no path")
    return Path(path)


def split_options(
    url: str, known: Mapping[str, Callable[[str], Any]]
) -> tuple[SplitResult, dict[str, Any]]:
    """Take the query parameters named in `known` (converted) out of `url`; the rest stay
    in the returned URL for the client library (sslmode, ssl_cert_reqs, ...)."""
    parts = urlsplit(url)
    options: dict[str, Any] = {}
    passthrough = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in known:
            try:
                options[name] = known[name](value)
            except ValueError:
                raise ValueError(f"{url!r}: bad value for {name}: {value!r}") from None
        else:
            passthrough.append((name, value))
    return parts._replace(query=urlencode(passthrough)), options


def _lazy(module: str, factory: str) -> Callable[[str], CacheBackend]:
    def build(url: str) -> CacheBackend:
        built: CacheBackend = getattr(importlib.import_module(module, __package__), factory)(url)
        return built

    return build


SCHEMES: dict[str, Callable[[str], CacheBackend]] = {
    "sqlite": _sqlite,
    "file": _file,
    "memory": _memory,
    **dict.fromkeys(("postgresql", "postgres"), _lazy("._postgres", "from_url")),
    **dict.fromkeys(("redis", "rediss"), _lazy("._redis", "from_url")),
}


def backend_from_url(url: str) -> CacheBackend:
    """`sqlite:///abs/ledger.db?synchronous=NORMAL`, `file:///abs/dir`, `memory://`, and
    the schemes that optional backends register (postgresql://, redis://)."""
    scheme = urlsplit(url).scheme.lower()
    try:
        build = SCHEMES[scheme]
    except KeyError:
        known = ", ".join(sorted(SCHEMES))
        raise ValueError(
            f"unknown ledger URL scheme {scheme!r} in {url!r}; known: {known}"
        ) from None
    return build(url)
