"""Audit log: one JSON object per line for every admin operation, authentication failure and refused
admin request.

Lines are written and flushed one at a time under a lock (thread safe); the
file is opened in append mode so several runs accumulate. Tokens are never
logged, only the first 8 hex digits of their SHA-256 (enough to tell tokens
apart, useless to an attacker). Refusals a logged-in client can repeat at will
(:meth:`AuditLog.write_refusal`) are audited a few per burst and principal, as
failed logins are per address, so that a flood cannot fill the disk.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from kvtier.private_files import FILE_MODE
from kvtier.server.admission import LoginLimiter


class AuditLog:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file = None
        if path:  # 0600: the lines name tenants, peers and token digests
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
            self._file = os.fdopen(fd, "a", encoding="utf-8")  # closed in close()
        self.records = 0
        # refusals per principal: a token bucket as for failed logins (its first few per burst audited)
        self._refusals = LoginLimiter()
        self._refusals_lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        record = {"ts": round(time.time(), 6), "event": event, **fields}
        line = json.dumps(record, default=str, separators=(",", ":"))
        with self._lock:
            self.records += 1
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()

    def write_refusal(self, principal: str, event: str, **fields: Any) -> bool:
        """:meth:`write`, for a request refused to ``principal`` (a tenant, or the admin token):
        only the first few of a burst of them; returns whether it was written."""
        with self._refusals_lock:
            audited = self._refusals.failed(principal)
        if audited:
            self.write(event, **fields)
        return audited

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
