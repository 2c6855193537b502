"""Byte counts for humans: one formatter and one parser.

Binary units (KiB, MiB, GiB: powers of 1024) are the default everywhere memory is reported;
decimal units (kB, MB, GB: powers of 1000) where bytes sit next to GB/s bandwidths, as in the
planner's output.
"""

from __future__ import annotations

import math

from hybridllm.errors import ConfigError

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
_DECIMAL_UNITS = ("B", "kB", "MB", "GB", "TB")

_PARSE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_PARSE_HINT = "use e.g. 8GiB, 512MiB, 2GB or a plain number"


def format_bytes(n: int | float | None, digits: int = 1, *, decimal: bool = False) -> str:
    """A byte count in the largest unit that keeps it at least 1: ``1536 -> '1.5 KiB'``.

    Args:
        n: the byte count; None gives "-" (a table cell with no figure).
        digits: decimals after the point (counts under 1 KiB are whole bytes: ``'512 B'``).
        decimal: powers of 1000 (kB, MB, GB) instead of 1024 (KiB, MiB, GiB).
    """
    if n is None:
        return "-"
    base, units = (1000, _DECIMAL_UNITS) if decimal else (1024, _BINARY_UNITS)
    value = float(n)
    if abs(value) < base:
        return f"{value:.0f} B"
    for unit in units[1:]:
        value /= base
        if abs(value) < base or unit == units[-1]:
            return f"{value:.{digits}f} {unit}"
    raise AssertionError("unreachable: the last unit always returns")


def parse_bytes(value: str | int | None) -> int | None:
    """Parse a byte count with an optional unit ("8GiB", "512MB", "1.5G", 1024) into an int.

    Decimal units (kB, MB, GB) are powers of 1000, binary ones (KiB, MiB, GiB) powers of 1024.
    None stays None (no budget).

    Raises:
        ConfigError: not a number with a known unit, or negative.
    """
    if value is None or isinstance(value, int):
        if isinstance(value, int) and value < 0:
            raise ConfigError(f"byte count must be >= 0, got {value}")
        return value
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):]
    if unit not in _PARSE_UNITS or not number:
        raise ConfigError(f"invalid byte count {value!r}; {_PARSE_HINT}")
    try:
        amount = float(number)
    except ValueError:
        raise ConfigError(f"invalid byte count {value!r}; {_PARSE_HINT}") from None
    if amount < 0 or not math.isfinite(amount):
        raise ConfigError(f"byte count must be >= 0, got {value!r}")
    return int(amount * _PARSE_UNITS[unit])
