"""A user's JSON file (a model's config.json, a calibration table, a cluster), read with errors
that name the file and what was expected of it, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; a :class:`ConfigError` saying ``what`` the file is meant to be
    for a file that is missing, unreadable, not JSON or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} not found") from None
    except (OSError, ValueError) as exc:   # a directory, no permission, not UTF-8, not JSON
        raise ConfigError(f"{what} {path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path}: expected a JSON object, got {type(data).__name__}")
    return data
