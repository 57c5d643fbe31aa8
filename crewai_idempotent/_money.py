"""Amounts of money as people read them: ISO 4217 minor units, one rule for every message.

Its own module because the errors print money (`SpendCapExceeded`) and every other part
may raise them: the spend caps, the CLI and the demos format amounts with the same rule,
and `_errors` can import it without importing anything that raises.
"""

from __future__ import annotations

__all__ = ["exponent", "format_money"]

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
