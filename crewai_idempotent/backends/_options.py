"""The query string of a PostgreSQL or Redis ledger URL: our options, and the client
library's, checked by name.

Two kinds of option share the query string: the backend's own (`table=`, `timeout_s=`,
...), converted and given to the backend, and the client library's (`sslmode=` for libpq,
`client_name=` for redis-py), left in the URL for the library to read. A name that is
neither is refused with the names that are known: a misspelt `statment_timeout_s` must
not be dropped silently, nor handed to a library that ignores it or fails obscurely on
the first call.

The library's options stay in the URL byte for byte as they were written: decoding and
re-encoding them would change them (`my%20app` became `my+app`, which libpq reads as a
plus sign).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

from .._errors import LedgerConfigurationError


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
    given twice is an error too. Errors are LedgerConfigurationError; messages never
    include the URL (it may hold a password).
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


def flag(value: str) -> bool:
    """A yes/no option; anything else is an error (a misspelt `flase` is not False)."""
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true/false, 1/0, yes/no or on/off")
