"""What every command prints with: terminal-safe text, the console, times, durations, JSON,
and the ledger's errors turned into one line and an exit status.

Everything printed for people goes through `safe`: control and bidirectional-text
characters in keys, errors and receipts are shown escaped.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

from .. import IdempotencyError, InvalidIdempotencyKey, LedgerUnavailable, validate_key
from .._units import DURATION_FORMS, ago, parse_duration

if TYPE_CHECKING:
    from rich.console import Console

_UNSAFE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f"
    "\ufeff\ufff9-\ufffb\ud800-\udfff]"
)


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe(text: str, *, lines: bool = True) -> str:
    """`text` with every character that could move the cursor, change colours or reorder
    what the terminal shows (C0/C1 controls, escape, bidi overrides and isolates,
    zero-width and format characters, lone surrogates) written as `\\xNN`/`\\uNNNN`.
    Newlines and tabs stay when `lines` (multi-line text we laid out), else they too are
    escaped (one table cell)."""
    text = _UNSAFE.sub(_escape_char, text)
    if not lines:
        text = text.replace("\n", "\\n").replace("\t", "\\t")
    # Any other format character (category Cf) is escaped too.
    if not text.isascii():
        text = "".join(f"\\u{ord(c):04x}" if unicodedata.category(c) == "Cf" else c for c in text)
    return text


@contextmanager
def ledger_errors(scrub: Callable[[str], str] | None = None) -> Iterator[None]:
    """Turn the ledger's errors into one clear, terminal-safe line and exit status 1;
    `scrub` takes the ledger's password out of the message."""

    def clean(text: str) -> str:
        return safe(scrub(text) if scrub is not None else text)

    try:
        yield
    except InvalidIdempotencyKey as exc:
        raise click.BadParameter(clean(str(exc)), param_hint="KEY") from None
    except LedgerUnavailable as exc:
        raise click.ClickException(clean(f"ledger unavailable: {exc}")) from None
    except IdempotencyError as exc:
        raise click.ClickException(clean(str(exc))) from None


def check_key(key: str) -> None:
    with ledger_errors():
        validate_key(key)


UNWRAPPED_WIDTH = 100_000  # columns rich lays out for when the output is not a terminal


def console() -> Console:
    # rich costs a noticeable part of start-up: only the commands that lay out text load it.
    from rich.console import Console

    # Keys, errors and receipts are data: "[x]" or ":x:" in them must print as written.
    out = Console(highlight=False, soft_wrap=False, markup=False, emoji=False)
    if not out.is_terminal:
        # Piped or redirected, rich would wrap at 80 columns, mid-sentence, a line that a
        # program or a wider window reads whole: lines and tables stay as long as they are.
        out.soft_wrap = True
        out.width = UNWRAPPED_WIDTH
    return out


def stamp(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def when(at: float | None, now: float) -> str:
    return "-" if at is None else f"{stamp(at)} ({ago(now - at)})"


def duration(value: str | None) -> float | None:
    """`90`, `90s`, `15m`, `2h`, `7d`, `1w` as seconds."""
    if value is None:
        return None
    seconds = parse_duration(value)
    if seconds is None:
        raise click.BadParameter(f"not a duration ({DURATION_FORMS}): {value!r}")
    return seconds


def dumps(value: Any) -> str:
    """JSON for people: laid out, then made terminal-safe."""
    return safe(json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True))


def machine(value: Any, indent: int | None = 2) -> str:
    """JSON for programs: ASCII only, so no byte of it can act on a terminal either."""
    return json.dumps(value, indent=indent, ensure_ascii=True, sort_keys=True)


def machine_array(items: Iterable[Any]) -> Iterator[str]:
    """`machine(list(items))`, written element by element: the text of the same JSON
    array in pieces, so a listing of millions never holds them all. The pieces joined are
    exactly what `machine` gives the list (without the final newline)."""
    first = True
    for item in items:
        text = machine(item).replace("\n", "\n  ")
        yield ("[\n  " if first else ",\n  ") + text
        first = False
    yield "[]" if first else "\n]"
