"""Quantities as people write them in settings: byte sizes ('4GiB', '512MB') and URLs whose
passwords must not reach a log.

Owns ``parse_size``, ``format_size`` and ``redact_url``: pure functions, any thread.
"""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
               "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
               "tib": 2**40, "p": 10**15, "pb": 10**15, "pib": 2**50}


def parse_size(text: str) -> int | None:
    """'4GiB' -> 4294967296, '512MB' -> 512000000, '123' -> 123; None if not a size."""
    match = _SIZE_RE.match(text)
    if not match:
        return None
    unit = (match.group(2) or "").lower()
    if unit not in _SIZE_UNITS:
        return None
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(count: int) -> str:
    """4294967296 -> '4GiB', 65536 -> '64KiB'; a count that is no whole binary unit stays as is."""
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20),
                        ("KiB", 2**10)):
        if count and count % scale == 0:
            return f"{count // scale}{unit}"
    return str(count)


def redact_url(url: str) -> str:
    """A URL with its password replaced by '***'."""
    return re.sub(r"(//[^:/@]*:)[^@]*@", r"\1***@", url)
