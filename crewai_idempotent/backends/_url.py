"""Building a backend from a URL such as CREWAI_IDEMPOTENCY_URL.

Local URLs follow the conventions their users already know:

- `sqlite:` follows SQLAlchemy: `sqlite:///ledger.db` is `ledger.db` relative to the current
  directory (made absolute when the URL is read), `sqlite:////abs/ledger.db` is absolute.
- `file:` follows RFC 8089 (as browsers, curl and `Path.as_uri()` do): `file:///abs/dir` is
  the absolute folder `/abs/dir`; a file URL has no relative form, so one is refused.
- `memory://` takes nothing.

Every option a URL carries is checked: an unknown or misspelt one is refused, never
ignored. Errors are `LedgerConfigurationError` (a `ValueError`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from .._backend import CacheBackend
from .._errors import LedgerConfigurationError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _flag(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"not a yes/no value (true/false, 1/0, yes/no, on/off): {value!r}")


def _seconds(value: str) -> float:
    seconds = float(value)
    if not seconds >= 0:
        raise ValueError(f"not a number of seconds >= 0: {value!r}")
    return seconds


_SQLITE_OPTIONS: dict[str, Callable[[str], Any]] = {
    "synchronous": str,
    "busy_timeout_s": _seconds,
    "allow_insecure_path": _flag,
}
_FILE_OPTIONS: dict[str, Callable[[str], Any]] = {
    "fsync": _flag,
    "allow_insecure_path": _flag,
}


def redact(url: str) -> str:
    """`url` with any password replaced by `***` (in the user info and in a `password=`
    query parameter), for messages, logs and the CLI."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<malformed URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        if ":" in userinfo:
            user = userinfo.split(":", 1)[0]
            netloc = f"{user}:***@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(name.lower() in ("password", "passwd", "pass") for name, _ in pairs):
            query = "&".join(
                f"{quote(name)}=***"
                if name.lower() in ("password", "passwd", "pass")
                else f"{quote(name)}={quote(value)}"
                for name, value in pairs
            )
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # urlunsplit would drop the empty authority of sqlite:///x
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _options(
    url: str, query: str, known: Mapping[str, Callable[[str], Any]], scheme: str
) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in known:
            hint = ", ".join(sorted(known)) or "none"
            raise LedgerConfigurationError(
                f"{redact(url)}: unknown option {name!r} for a {scheme}: ledger (known: {hint})"
            )
        if name in options:
            raise LedgerConfigurationError(f"{redact(url)}: option {name!r} is given twice")
        try:
            options[name] = known[name](value)
        except ValueError as exc:
            raise LedgerConfigurationError(
                f"{redact(url)}: bad value for {name}: {value!r} ({exc})"
            ) from None
    return options


def sqlite_path(url: str) -> Path:
    """The absolute file a `sqlite:` URL names (SQLAlchemy's convention)."""
    parts = urlsplit(url)
    if parts.netloc:
        raise LedgerConfigurationError(
            f"{url!r}: a sqlite URL has no host ({parts.netloc!r}); write sqlite:///relative.db "
            "or sqlite:////absolute/path.db"
        )
    if not parts.path.startswith("/") or parts.path == "/":
        raise LedgerConfigurationError(
            f"{url!r} names no file (SQLAlchemy's in-memory form is not a durable ledger; "
            "use memory:// in tests); write sqlite:///relative.db or sqlite:////absolute/path.db"
        )
    text = unquote(parts.path[1:])
    if text == ":memory:":
        raise LedgerConfigurationError(
            f"{url!r} is an in-memory SQLite database, not a durable ledger; use memory:// in "
            "tests, or name a file"
        )
    path = Path(text)
    if path.is_absolute():
        return path
    absolute = Path("/", text)
    resolved = Path.cwd() / path
    if not resolved.exists() and absolute.is_file():
        # Development versions read three slashes as an absolute path: refuse rather than
        # start an empty ledger next to the one holding the receipts.
        raise LedgerConfigurationError(
            f"{url!r} names {resolved} (three slashes: relative to the current directory, as "
            f"in SQLAlchemy), which does not exist, while {absolute} does. For the existing "
            f"ledger write sqlite:///{absolute} (four slashes); to start one here, create "
            "the folder first or give the path as ./" + text
        )
    return resolved


def file_path(url: str) -> Path:
    """The absolute folder a `file:` URL names (RFC 8089)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise LedgerConfigurationError(
            f"{url!r}: a file URL names a folder on this host; {parts.netloc!r} is read as a "
            f"host name. Write file:///absolute/dir (did you mean file:///{parts.netloc}"
            f"{parts.path}?)"
        )
    text = unquote(parts.path)
    if not text.startswith("/"):
        raise LedgerConfigurationError(
            f"{url!r}: file URLs are absolute (RFC 8089): write file:///absolute/dir, or "
            "FileLockCacheBackend('relative/dir') in code"
        )
    if text.rstrip("/") == "":
        raise LedgerConfigurationError(f"{url!r} names no folder")
    return Path(text)


def sqlite_url(path: str | os.PathLike[str]) -> str:
    """The `sqlite:` URL of `path`, made absolute."""
    return "sqlite:///" + quote(str(Path(path).absolute()), safe="/")


def file_url(path: str | os.PathLike[str]) -> str:
    """The `file:` URL of the folder `path`, made absolute."""
    return "file://" + quote(str(Path(path).absolute()), safe="/")


def local_path(url: str) -> Path | None:
    """The file or folder a local ledger URL names; None for other schemes."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == "sqlite":
        return sqlite_path(url)
    if scheme == "file":
        return file_path(url)
    return None


def _sqlite(url: str) -> CacheBackend:
    from .sqlite import SQLiteCacheBackend

    options = _options(url, urlsplit(url).query, _SQLITE_OPTIONS, "sqlite")
    path = sqlite_path(url)
    try:
        return SQLiteCacheBackend(path, **options)
    except ValueError as exc:
        raise LedgerConfigurationError(f"{url!r}: {exc}") from None


def _file(url: str) -> CacheBackend:
    from .filelock import FileLockCacheBackend

    options = _options(url, urlsplit(url).query, _FILE_OPTIONS, "file")
    return FileLockCacheBackend(file_path(url), **options)


def _memory(url: str) -> CacheBackend:
    from .memory import InMemoryCacheBackend

    parts = urlsplit(url)
    _options(url, parts.query, {}, "memory")
    if parts.netloc or parts.path.strip("/"):
        raise LedgerConfigurationError(f"{url!r}: memory:// takes no name or path")
    return InMemoryCacheBackend()


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


_EXTRAS = {".postgres": "postgres", ".redis": "redis"}


def _lazy(module: str, factory: str) -> Callable[[str], CacheBackend]:
    def build(url: str) -> CacheBackend:
        try:
            built: CacheBackend = getattr(importlib.import_module(module, __package__), factory)(
                url
            )
        except ImportError as exc:
            raise LedgerConfigurationError(
                f"{redact(url)}: this backend needs its client library ({exc}); install "
                f"'crewai-idempotent[{_EXTRAS[module]}]'"
            ) from exc
        return built

    return build


SCHEMES: dict[str, Callable[[str], CacheBackend]] = {
    "sqlite": _sqlite,
    "file": _file,
    "memory": _memory,
    **dict.fromkeys(("postgresql", "postgres"), _lazy(".postgres", "from_url")),
    **dict.fromkeys(("redis", "rediss"), _lazy(".redis", "from_url")),
}


def backend_from_url(url: str) -> CacheBackend:
    """`sqlite:///relative.db`, `sqlite:////abs/ledger.db?synchronous=NORMAL`,
    `file:///abs/dir`, `memory://`, and the server schemes (postgresql://, redis://).

    A malformed URL, an unknown scheme or option raises `LedgerConfigurationError`."""
    if not isinstance(url, str):
        raise TypeError(f"a ledger URL is a str, not {type(url).__name__}")
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError as exc:
        raise LedgerConfigurationError(f"malformed ledger URL {redact(url)!r}: {exc}") from None
    try:
        build = SCHEMES[scheme]
    except KeyError:
        known = ", ".join(sorted(SCHEMES))
        what = f"unknown ledger URL scheme {scheme!r}" if scheme else "no URL scheme"
        hint = (
            f"; for a SQLite file write sqlite:///{url}"
            if not scheme and url.endswith((".db", ".sqlite", ".sqlite3"))
            else ""
        )
        raise LedgerConfigurationError(f"{what} in {redact(url)!r}; known: {known}{hint}") from None
    try:
        return build(url)
    except LedgerConfigurationError:
        raise
    except ValueError as exc:  # a server backend's own option check
        raise LedgerConfigurationError(str(exc)) from exc
