"""Parsing and printing of byte sizes and parameter counts.

Used by the spec models, the CLI and the planner's output. Pure; no torch.
"""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

# Decimal (SI) and binary (IEC) suffixes, plus the Kubernetes quantity spellings (Gi, Mi).
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "p": 10**15,
    "pb": 10**15,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
    "pi": 2**50,
    "pib": 2**50,
}

_COUNT_UNITS: dict[str, int] = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}

# Upper bounds, far beyond any real volume or model (8 PiB, a quadrillion parameters), that
# a double holds exactly: JSON tools compare bounds as floats.
MAX_SIZE = 2**53
MAX_COUNT = 10**15


def _any_case(unit: str) -> str:
    return "".join(f"[{c.upper()}{c.lower()}]" for c in unit)


def _units_pattern(units: dict[str, int]) -> str:
    return "|".join(_any_case(u) for u in sorted(units, key=len, reverse=True) if u)


# The spellings schemas advertise (JSON Schema regexes: no flags, so units in either case
# are spelt out). Every string they match parses to a value within bounds; the parsers
# accept a little more (exponents, e.g. 13e9) for people writing files by hand.
SIZE_PATTERN = rf"^[0-9]{{1,3}}(\.[0-9]{{1,3}})? ?({_units_pattern({u: n for u, n in _SIZE_UNITS.items() if u[:1] != 'p'})})?$"
COUNT_PATTERN = rf"^[1-9][0-9]{{0,2}}(\.[0-9]{{1,3}})? ?({_units_pattern(_COUNT_UNITS)})?$"

GiB = 2**30
MiB = 2**20


def parse_size(value: str | int | float) -> int:
    """Parse '24GiB', '2TB', '512Mi', '0' or a plain number into bytes.

    Raises ValueError with the accepted spellings when the text is not a size.
    """
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{value!r} is not a size: use a number with an optional unit such as 24GiB, 512Mi, 2TB or 0")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{value!r} bytes is not a whole number: use e.g. 500Gi, or a number of bytes")
        return _bounded(value, MAX_SIZE, "size")
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"{value!r} is not a size: use a number with an optional unit such as 24GiB, 512Mi, 2TB or 0"
        )
    return _bounded(float(match.group(1)) * _SIZE_UNITS[unit], MAX_SIZE, "size")


def _bounded(value: float, limit: int, what: str) -> int:
    if not value <= limit:  # also inf and nan (1e400)
        raise ValueError(f"{what} {value!r} is beyond {limit:.3g}")
    return int(value)


def parse_count(value: str | int | float) -> int:
    """Parse a parameter count such as '13B', '13e9', '125M' or 7000000000."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{value!r} is not a parameter count: use e.g. 13B, 13e9, 350M or 7000000000")
    if isinstance(value, int | float):
        if value <= 0:
            raise ValueError(f"count must be positive, got {value}")
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{value!r} is not a whole number of parameters: use e.g. 13B or 7000000000")
        return _bounded(value, MAX_COUNT, "count")
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _COUNT_UNITS:
        raise ValueError(f"{value!r} is not a parameter count: use e.g. 13B, 13e9, 350M or 7000000000")
    count = _bounded(float(match.group(1)) * _COUNT_UNITS[unit], MAX_COUNT, "count")
    if count <= 0:
        raise ValueError(f"count must be positive, got {value!r}")
    return count


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1.5 GiB, 320 MiB, 0 B."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def format_count(n: float) -> str:
    """Human-readable parameter count: 13.0B, 125.0M."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(int(n))
