"""A user's JSON file (a model's config.json, a calibration table, a cluster), read with errors
that name the file and what was expected of it, never a traceback; and JSON kvtier prints, strict
(:func:`strict_json`: no NaN or Infinity, which jq, Go and JavaScript refuse)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError


class _NotANumber(ValueError):
    pass


def _constant(name: str) -> float:
    # NaN passes every range check after it (each comparison is false) and comes out as a NaN
    # plan, price or rate: refused here, once for every file. Infinity is ordered, so the range
    # checks refuse it where it does not belong, and it is kept: 1e999 reads as infinity anyway,
    # and `kvtier bench prefill` writes one in a profile's fit when it drops the attention term.
    if name == "NaN":
        raise _NotANumber("NaN is not a number it can hold")
    return float(name)


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; a :class:`ConfigError` saying ``what`` the file is meant to be
    for a file that is missing, unreadable, not JSON, nested too deeply to parse, holding a NaN,
    or not an object."""
    try:
        data = json.loads(Path(path).read_text(), parse_constant=_constant)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} not found") from None
    except _NotANumber as exc:
        raise ConfigError(f"{what} {path}: {exc}") from None
    except (OSError, ValueError) as exc:   # a directory, no permission, not UTF-8, not JSON
        raise ConfigError(f"{what} {path}: not a readable JSON file ({exc})") from None
    except RecursionError:   # e.g. 100,000 '[': the parser recurses once per level
        raise ConfigError(f"{what} {path}: not a readable JSON file (nested too deeply)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path}: expected a JSON object, got {type(data).__name__}")
    return data


def json_safe(value):
    """``value`` with every float that is not finite (NaN, ±Infinity) replaced by ``None``,
    through dicts, lists and tuples: what ``json.dumps(..., allow_nan=False)`` accepts (NaN
    and Infinity are not JSON; jq, Go and JavaScript refuse them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def strict_json(value, **kw) -> str:
    """``value`` as strict JSON: a figure that is not finite is ``null`` (a bench's ratio of a
    missing measurement, say), never the ``NaN`` / ``Infinity`` Python writes by default."""
    return json.dumps(json_safe(value), allow_nan=False, **kw)
