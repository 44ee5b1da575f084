"""Sizes in configuration: one parser for every setting, file, variable and flag.

What each unit means (case does not matter, a space before it is allowed):

* ``KiB``, ``MiB``, ``GiB``, ``TiB`` -- binary: exact powers of 1024.
* ``KB``, ``MB``, ``GB``, ``TB`` (and ``kB``) -- decimal (SI): powers of 1000, as
  disks and network links are sold.
* ``B`` or no unit -- bytes.
* A bare ``k``, ``m``, ``g`` or ``t`` (``512M``, ``8g``) is refused: tools disagree
  on it (``dd`` and ``mount`` read 1024, Kubernetes reads 1000), and a quota or a
  pool off by 7 % is a silent surprise. The error names both spellings.

A fraction is allowed (``1.5GiB``) and rounds down to whole bytes. Integers pass
through (a TOML ``capacity = 1048576``), so do whole floats (``1e9``); booleans,
negative and fractional byte counts are refused.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from kvtier.errors import ConfigError

BINARY = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNITS = {"": 1, "b": 1, **BINARY, **DECIMAL}
#: bare prefixes whose base is a matter of convention: refused, see the module docstring
AMBIGUOUS = ("k", "m", "g", "t")

#: the largest size accepted: what a file offset (``off_t``) or a C ``int64`` holds; 8 EiB, beyond
#: any memory, disk or quota, so a larger number is a typo, and one that would overflow further on
MAX_SIZE = (1 << 63) - 1

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_EXAMPLES = "write e.g. 8GiB or 512MiB (powers of 1024), 500GB (powers of 1000) or a byte count like 1048576"


def parse_size(value: Any, what: str) -> int:
    """``"8GiB"`` → 8589934592, ``"500 GB"`` → 500000000000, ``1048576`` → 1048576.

    Raises :class:`ConfigError` naming ``what`` (the setting) and the fix.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}={value!r} is not a size; {_EXAMPLES}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(f"{what}={value!r} is not a whole number of bytes; {_EXAMPLES}")
        value = int(value)
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what}={_shown(value)}: a size cannot be negative")
        return _bounded(value, value, what)
    text = str(value)
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ConfigError(f"{what}={value!r} is not a size; {_EXAMPLES}")
    number, unit = match.group(1), match.group(2)
    if unit.lower() in AMBIGUOUS:
        raise ConfigError(
            f"{what}={value!r}: the unit {unit!r} is ambiguous (1000 or 1024?); write "
            f"{number}{unit.upper()}iB for powers of 1024 or {number}{unit.upper()}B for powers of 1000"
        )
    if unit.lower() not in UNITS:
        raise ConfigError(f"{what}={value!r}: unknown unit {unit!r}; {_EXAMPLES}")
    scale = UNITS[unit.lower()]
    try:
        exact = Fraction(number) * scale
    except ValueError:   # more digits than Python converts (sys.get_int_max_str_digits)
        raise ConfigError(f"{what}={_shown(value)} is not a size: too many digits; {_EXAMPLES}") from None
    if scale == 1 and exact.denominator != 1:
        raise ConfigError(f"{what}={value!r} is not a whole number of bytes; {_EXAMPLES}")
    return _bounded(int(exact), value, what)  # a fraction of a larger unit rounds down to whole bytes


def _bounded(nbytes: int, value: Any, what: str) -> int:
    if nbytes > MAX_SIZE:
        raise ConfigError(f"{what}={_shown(value)} is larger than any size kvtier takes (at most {MAX_SIZE} "
                          f"bytes, 8 EiB); {_EXAMPLES}")
    return nbytes


def _shown(value: Any) -> str:
    """``value`` for an error message, cut short: a number of thousands of digits is not repeated."""
    if isinstance(value, int):   # str() of an int of over 4,300 digits raises
        return str(value) if value.bit_length() <= 128 else f"<a number of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]} ({len(text)} characters)"


def finite_float(text: str) -> float:
    """An argparse ``type`` for quantities (seconds, rates, fractions): a float, NaN and infinity
    refused. ``float()`` takes "nan", which then passes every range check after it (each
    comparison is false) and comes out as a NaN plan, price or timeout."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value
