"""Audit log: one JSON object per line for every admin operation and authentication failure.

Lines are written and flushed one at a time under a lock (thread safe); the
file is opened in append mode so several runs accumulate. Tokens are never
logged, only the first 8 hex digits of their SHA-256 (enough to tell tokens
apart, useless to an attacker).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from kvtier.private_files import FILE_MODE


class AuditLog:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file = None
        if path:  # 0600: the lines name tenants, peers and token digests
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
            self._file = os.fdopen(fd, "a", encoding="utf-8")  # closed in close()
        self.records = 0

    def write(self, event: str, **fields: Any) -> None:
        record = {"ts": round(time.time(), 6), "event": event, **fields}
        line = json.dumps(record, default=str, separators=(",", ":"))
        with self._lock:
            self.records += 1
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
