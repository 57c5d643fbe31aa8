"""Pages from templates, with every value escaped and nothing invisible.

Jinja2 escapes everything a template prints (autoescape, no `|safe` anywhere in the
templates); `shown` goes further for values a model wrote: characters that would reorder
or hide what the approver reads (bidi overrides and isolates, zero-width and other format
characters, C0/C1 controls) are shown as marked `U+202E` code points instead of acting, so
the text on the screen is the text in the ledger. Newlines and tabs stay; the stylesheet
keeps long values in scrolling boxes.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
import unicodedata
from importlib.resources import files
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup, escape

from .._units import ago, format_money


@functools.cache
def _hidden() -> re.Pattern[str]:
    """C0/C1 controls but newline and tab, lone surrogates, and every format character
    (Unicode category Cf: bidi controls, zero-width joiners, tags, ...)."""
    ranges = "\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029"
    planes = (*range(0x20000), *range(0xE0000, 0xE0080))
    formats = "".join(chr(c) for c in planes if unicodedata.category(chr(c)) == "Cf")
    return re.compile(f"[{re.escape(formats)}{ranges}]")


def text_of(value: Any) -> str:
    """An argument or receipt as people read it: a string as it is, anything else as
    indented JSON (non-JSON values by their repr)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError):
        return repr(value)


def shown(value: Any) -> Markup:
    """`value` escaped, its hidden characters made visible as marked code points."""
    text = text_of(value)
    pattern = _hidden()
    parts: list[str] = []
    last = 0
    for match in pattern.finditer(text):
        parts.append(escape(text[last : match.start()]))
        code = f"U+{ord(match.group()):04X}"
        parts.append(Markup('<span class="hidden-char" title="an invisible character">'))
        parts.append(escape(code))
        parts.append(Markup("</span>"))
        last = match.end()
    parts.append(escape(text[last:]))
    return Markup("").join(parts)


def has_hidden(value: Any) -> bool:
    return _hidden().search(text_of(value)) is not None


def stamp(at: float | None) -> str:
    if at is None:
        return "-"
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def size(value: Any) -> str:
    n = len(text_of(value))
    return f"{n:,} characters"


@functools.cache
def environment() -> Environment:
    folder = files("crewai_idempotent.console") / "templates"
    env = Environment(
        loader=FileSystemLoader(str(folder)),
        autoescape=select_autoescape(["html"], default_for_string=True, default=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        shown=shown, stamp=stamp, ago=ago, size=size, has_hidden=has_hidden, money=format_money
    )
    return env


def render(template: str, **context: Any) -> str:
    return environment().get_template(template).render(**context)
