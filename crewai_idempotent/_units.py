"""Money and time in the units people use: ISO 4217 minor units ("1,200.00 EUR"), spans
of time as an operator types them ("15m", "2h") and reads them ("3 min ago").

One module because each is a rule every reader of the ledger shares (the errors print
money, the CLI and the console both print ages and read durations) and none of those
readers may import another: `_errors` imports this and nothing else of the package, and
this imports nothing of it.
"""

from __future__ import annotations

import re

__all__ = ["ago", "exponent", "format_money", "parse_duration"]

# ISO 4217's minor units (the currency's exponent) where they are not 2 (the list's
# 2024 amendments). Codes without minor units (XAU, XDR, ...) are counted as 0.
_EXPONENTS = {
    **dict.fromkeys(
        ("BIF", "CLP", "DJF", "GNF", "ISK", "JPY", "KMF", "KRW", "PYG", "RWF", "UGX", "UYI",
         "VND", "VUV", "XAF", "XOF", "XPF", "XAG", "XAU", "XBA", "XBB", "XBC", "XBD", "XDR",
         "XPD", "XPT", "XSU", "XTS", "XUA", "XXX"),
        0,
    ),
    **dict.fromkeys(("BHD", "IQD", "JOD", "KWD", "LYD", "OMR", "TND"), 3),
    **dict.fromkeys(("CLF", "UYW"), 4),
}  # fmt: skip


def exponent(currency: str) -> int:
    """How many digits of an amount are minor units: 2 for EUR, 0 for JPY, 3 for KWD."""
    return _EXPONENTS.get(currency, 2)


def format_money(amount: int, currency: str) -> str:
    """An amount in minor units as people read it: 120000 EUR is "1,200.00 EUR", 1200 JPY
    is "1,200 JPY", 1500 KWD is "1.500 KWD". Every place that prints money uses this."""
    places = exponent(currency)
    sign = "-" if amount < 0 else ""
    major, minor = divmod(abs(amount), 10**places)
    text = f"{major:,}" + (f".{minor:0{places}d}" if places else "")
    return f"{sign}{text} {currency}"


def ago(seconds: float) -> str:
    """How long ago a moment `seconds` back was, to the unit people would say: "40 s ago",
    "12 min ago", "5 h ago", "3 d ago"; a negative `seconds` is ahead ("in 12 min")."""
    future = seconds < 0
    seconds = abs(seconds)
    if seconds < 90:
        text = f"{seconds:.0f} s"
    elif seconds < 90 * 60:
        text = f"{seconds / 60:.0f} min"
    elif seconds < 48 * 3600:
        text = f"{seconds / 3600:.0f} h"
    else:
        text = f"{seconds / 86400:.0f} d"
    return f"in {text}" if future else f"{text} ago"


_SECONDS_PER = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d|w)?\s*")
DURATION_FORMS = "90, 90s, 15m, 2h, 7d, 1w"


def parse_duration(text: str) -> float | None:
    """`text` (`90`, `90s`, `15m`, `2h`, `7d`, `1w`) as seconds; None if it is not one."""
    match = _DURATION.fullmatch(text or "")
    if match is None:
        return None
    return float(match.group(1)) * _SECONDS_PER[match.group(2) or "s"]
