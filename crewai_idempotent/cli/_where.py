"""Which ledger a command works on, and how it is named on screen.

The ledger is `--ledger URL`, else `CREWAI_IDEMPOTENCY_URL`, else the embedded default
(the SQLite file the crewai integration uses). No command creates a ledger but the one
that asks to (`ledger(create=True)`: `console users add`): a path that holds none is
refused before it is opened read-write (which would make it one). A URL's password is
shown as `***`, wherever a message repeats it, and never put in a command to paste
(`command`).
"""

from __future__ import annotations

import shlex
import sqlite3
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import click

from .. import Ledger, LedgerUnavailable, backend_from_url
from ..backends._options import redact
from ..backends._url import local_path
from ..backends.sqlite import sqlite_url
from ..integration import URL_ENV, default_ledger_path
from ._output import safe

_SQLITE_HEADER = b"SQLite format 3\x00"


class Where:
    """The ledger the user named, opened on first use and closed at exit."""

    def __init__(self, url: str | None, source: str = "--ledger") -> None:
        self.url = url.strip() if url and url.strip() else None
        self.source = source if self.url is not None else "default"
        self._ledger: Ledger | None = None
        self._secrets = _secrets(self.url) if self.url else []
        self.created = False  # whether `ledger(create=True)` made a new one

    def command(self, *args: str) -> str:
        """`crewai-idempotent ARGS` as a hint to paste into the shell this command ran in:
        with `--ledger URL` when the ledger was named with --ledger (from the environment or
        the default, the pasted command finds it the same way). A URL with a password is
        never printed: the hint then says to set CREWAI_IDEMPOTENCY_URL, whose value the
        pasted command reads."""
        words = ["crewai-idempotent"]
        if self.source == "--ledger" and self.url is not None:
            if self._secrets:
                return f"`{' '.join([*words, *args])}` with {URL_ENV} set to the ledger's URL"
            words += ["--ledger", shlex.quote(self.url)]
        return f"`{' '.join([*words, *args])}`"

    @property
    def label(self) -> str:
        if self.url is None:
            return f"{sqlite_url(default_ledger_path())} (default)"
        return safe(redact(self.url))

    def scrub(self, text: str) -> str:
        """`text` with the ledger's password replaced, wherever a message repeats it."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def ledger(self, *, create: bool = False) -> Ledger:
        """The ledger, opened on first use. A path that holds nothing is refused, unless
        `create` (then `created` says whether a new ledger was made); a file or folder that
        is not a ledger is refused either way."""
        if self._ledger is None:
            self._ledger = self._open(create)
        return self._ledger

    def _open(self, create: bool) -> Ledger:
        if self.url is None:
            path = default_ledger_path()
            if create and not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                self.created = True
            elif not path.exists():
                raise click.ClickException(
                    safe(
                        f"no ledger at the default location {path} (crewai's storage folder for "
                        f"project {path.parent.name!r}, named after the current directory or "
                        f"CREWAI_STORAGE_DIR). Run from the project's directory, or pass "
                        f"--ledger URL / set {URL_ENV}"
                    )
                )
            else:
                _require_ledger_file(path, "the default location")
            url = sqlite_url(path)
        else:
            url = self.url
            self._require_existing(url, create)
        try:
            backend = backend_from_url(url)
        except ValueError as exc:
            raise click.BadParameter(self.scrub(safe(str(exc))), param_hint=self.source) from None
        except LedgerUnavailable as exc:
            raise click.ClickException(self.scrub(safe(f"ledger unavailable: {exc}"))) from None
        return Ledger(backend)

    def _require_existing(self, url: str, create: bool) -> None:
        """Refuse to create a ledger by looking at one: a typo would open an empty new one.
        With `create`, a path that holds nothing at all is let through (and made one)."""
        try:
            path = local_path(url)
        except ValueError as exc:
            raise click.BadParameter(self.scrub(safe(str(exc))), param_hint=self.source) from None
        if path is None:
            return  # servers: the backend reports an unreachable one
        if create and not path.exists():
            self.created = True
            return
        where = f"from {self.source} {self.label}"
        if urlsplit(url).scheme.lower() == "sqlite":
            _require_ledger_file(path, where)
        elif not (path / "records").is_dir():
            raise click.ClickException(
                safe(
                    f"no ledger at {path} ({where}): a file ledger is a folder holding "
                    "records/ and locks/"
                )
            )

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()


def _require_ledger_file(path: Path, where: str) -> None:
    """`path` is an existing SQLite database holding a ledger; anything else is refused
    before it is opened read-write (which would make it one)."""
    if not path.exists():
        raise click.ClickException(safe(f"no ledger at {path} ({where})"))
    try:
        with path.open("rb") as file:
            header = file.read(len(_SQLITE_HEADER))
    except OSError as exc:
        raise click.ClickException(safe(f"ledger unavailable: cannot read {path}: {exc}")) from None
    if header != _SQLITE_HEADER:
        what = "an empty file" if not header else "not a SQLite database"
        raise click.ClickException(safe(f"no ledger at {path} ({where}): it is {what}"))
    try:
        db = sqlite3.connect(f"{sqlite_url(path).replace('sqlite:', 'file:', 1)}?mode=ro", uri=True)
        try:
            found = db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'idempotency_records'"
            ).fetchone()
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        raise click.ClickException(safe(f"ledger unavailable: {path}: {exc}")) from None
    if found is None:
        raise click.ClickException(
            safe(f"no ledger at {path} ({where}): a SQLite database without a ledger table")
        )


def _secrets(url: str) -> list[str]:
    """The password a URL carries, raw and percent-encoded, longest first."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found = set()
    userinfo = parts.netloc.rpartition("@")[0]
    if ":" in userinfo:
        found.add(userinfo.split(":", 1)[1])
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name.lower() in ("password", "passwd", "pass"):
            found.add(value)
    found |= {unquote(secret) for secret in found}
    found |= {quote(secret, safe="") for secret in found}
    return sorted((s for s in found if s), key=len, reverse=True)
