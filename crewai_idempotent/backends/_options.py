"""The query string of a ledger URL: every option checked by name, none ignored, and
passwords kept out of messages.

Local URLs (`sqlite:`, `file:`, `memory:`) carry only the backend's own options:
`local_options` converts them and refuses any other name, or one given twice.

A PostgreSQL or Redis URL carries two kinds: the backend's own (`table=`, `timeout_s=`,
...), converted and given to the backend, and the client library's (`sslmode=` for libpq,
`client_name=` for redis-py), left in the URL for the library to read. A name that is
neither is refused with the names that are known: a misspelt `statment_timeout_s` must
not be dropped silently, nor handed to a library that ignores it or fails obscurely on
the first call. The library's options stay in the URL byte for byte as they were written:
decoding and re-encoding them would change them (`my%20app` became `my+app`, which libpq
reads as a plus sign).

Every error is a `LedgerConfigurationError` (a `ValueError`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any
from urllib.parse import SplitResult, parse_qsl, quote, unquote, urlsplit, urlunsplit

from .._errors import LedgerConfigurationError

_PASSWORD_NAMES = ("password", "passwd", "pass")


def flag(value: str) -> bool:
    """A yes/no option; anything else is an error (a misspelt `flase` is not False)."""
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true/false, 1/0, yes/no or on/off")


def seconds(value: str) -> float:
    """A duration option: a number of seconds, zero or more."""
    number = float(value)
    if not number >= 0:
        raise ValueError(f"not a number of seconds >= 0: {value!r}")
    return number


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
        if any(name.lower() in _PASSWORD_NAMES for name, _ in pairs):
            query = "&".join(
                f"{quote(name)}=***"
                if name.lower() in _PASSWORD_NAMES
                else f"{quote(name)}={quote(value)}"
                for name, value in pairs
            )
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # urlunsplit would drop the empty authority of sqlite:///x
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def with_options(url: str, options: Mapping[str, Any]) -> str:
    """`url` with `options` added to its query (booleans as true/false), for a URL that
    names a backend as it was configured."""
    pairs = [
        f"{quote(name)}={quote(str(value).lower() if isinstance(value, bool) else str(value))}"
        for name, value in options.items()
    ]
    if not pairs:
        return url
    return url + ("&" if "?" in url else "?") + "&".join(pairs)


def local_options(
    url: str, known: Mapping[str, Callable[[str], Any]], scheme: str
) -> dict[str, Any]:
    """The options in the query of a local ledger URL, converted by `known`; an unknown
    name, a name given twice or a bad value is an error."""
    options: dict[str, Any] = {}
    for name, value in parse_qsl(urlsplit(url).query, keep_blank_values=True):
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


def split_server_options(
    url: str,
    what: str,
    ours: Mapping[str, Callable[[str], Any]],
    theirs: Collection[str],
    refused: Mapping[str, str],
) -> tuple[SplitResult, dict[str, Any]]:
    """Split the query of `url` into our options (converted by `ours`) and the client
    library's (`theirs`, kept verbatim in the returned URL parts). A name in `refused`
    gets that explanation; any other name is an error naming the known options. A name
    given twice is an error too. Messages never include the URL (it may hold a password).
    """
    error = LedgerConfigurationError
    parts = urlsplit(url)
    options: dict[str, Any] = {}
    kept: list[str] = []
    seen: set[str] = set()
    for field in parts.query.split("&") if parts.query else ():
        if not field:
            continue
        raw_name, _, raw_value = field.partition("=")
        name = unquote(raw_name)
        if name in seen:
            raise error(f"{what} URL option {name!r} is given twice")
        seen.add(name)
        if name in refused:
            raise error(f"{what} URL option {name!r} is not accepted: {refused[name]}")
        if name in ours:
            value = unquote(raw_value)
            try:
                options[name] = ours[name](value)
            except (TypeError, ValueError) as exc:
                raise error(f"bad value for {what} URL option {name}: {value!r} ({exc})") from None
        elif name in theirs:
            kept.append(field)
        else:
            raise error(
                f"unknown {what} URL option {name!r}; the ledger's options are "
                f"{', '.join(sorted(ours))}, and the client library's are "
                f"{', '.join(sorted(theirs))}"
            )
    return parts._replace(query="&".join(kept)), options


@contextlib.contextmanager
def configuration_errors() -> Iterator[None]:
    """Around a backend built from a URL: a `ValueError` from the backend's own checks
    of what the URL gave it (a negative timeout, a bad table name) is a configuration
    error too."""
    try:
        yield
    except LedgerConfigurationError:
        raise
    except ValueError as exc:
        raise LedgerConfigurationError(str(exc)) from exc
