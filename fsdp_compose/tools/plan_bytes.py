"""Byte counts in words and back: size() writes them for people (the planner's peaks, budgets
and traffic), parse_size() reads a size as people write it ("64MiB", "64MB", "2048")."""

from __future__ import annotations

import re
from decimal import Decimal


def size(nbytes: float) -> str:
    """Bytes in the largest binary unit (up to GiB) that keeps a number of at least 1."""
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


_POWERS = {"k": (10, 3), "m": (20, 6), "g": (30, 9), "t": (40, 12)}  # of 2 with "i", else of 10
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(i?)(b?)|(b?))\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """"64MiB" (64 x 2^20), "64MB" (64 x 10^6), "2048" or "2048B" as bytes, in any case.
    ValueError for anything else, and for a unit without its B ("64M", "64Mi"): ambiguous."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (e.g. 64MiB = 64 x 2^20 bytes, 64MB = 64 x "
                         "10^6 bytes, 2048 = 2048 bytes)")
    number, unit, binary, b = match[1], (match[2] or "").lower(), match[3], match[4]
    if not unit:
        return int(Decimal(number))
    two, ten = _POWERS[unit]
    if not b:
        decimal = unit if unit == "k" else unit.upper()
        raise ValueError(f"an ambiguous size: {text!r}; say {number}{unit.upper()}iB (2^{two} "
                         f"bytes) or {number}{decimal}B (10^{ten} bytes)")
    return int(Decimal(number) * (2**two if binary else 10**ten))
