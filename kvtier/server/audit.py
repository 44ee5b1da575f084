"""Audit log: one JSON object per line for every admin operation, authentication failure and refused
admin request.

Lines are written and flushed one at a time under a lock (thread safe); the
file is opened in append mode so several runs accumulate. It is created 0600;
one that exists is refused at start unless it is a regular file of the server's
user that nobody else may read or write, and a symbolic link there is never
followed (:func:`kvtier.private_files.open_private_log`). Tokens are never
logged, only the first 8 hex digits of their SHA-256 (enough to tell tokens
apart, useless to an attacker). Refusals a logged-in client can repeat at will
(:meth:`AuditLog.write_refusal`) are audited the first few per principal and
window (:class:`RefusalWindows`: 3 a minute), the rest counted into one
``refusals_suppressed`` line, and each line carries bounded fields (the caller's
part: :func:`kvtier.server.admin.admin_request_fields` keeps an ADMIN frame's
command and argument names, about 1 KB at most), so that a flood, however it is
paced, cannot fill the disk.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, NamedTuple

from kvtier.private_files import open_private_log

#: what a refused audit log's error says to do (besides chmod 600)
AUDIT_LOG_FIX = "point audit_log at another path (a rotated log: logrotate's `create 0600`)"

#: refusals audited per principal and window; the rest of the window's are counted
REFUSALS_PER_WINDOW = 3
REFUSAL_WINDOW_S = 60.0


class Suppressed(NamedTuple):
    """A window that ended with refusals not audited."""

    principal: str
    count: int
    window_s: float


class RefusalWindows:
    """Refusals per principal in fixed windows: the first ``per_window`` of a window are audited, the
    others counted, and a window that ended with some counted is handed back once by :meth:`ended`.
    A principal is a configured tenant or the admin (bounded by the configuration), and a window is
    forgotten once it ended. Not thread safe (the audit log holds a lock)."""

    def __init__(self, per_window: int = REFUSALS_PER_WINDOW, window_s: float = REFUSAL_WINDOW_S) -> None:
        self.per_window = per_window
        self.window_s = window_s
        #: principal → [window start (monotonic), refusals audited in it, refusals counted]
        self._windows: dict[str, list] = {}

    def charge(self, principal: str, now: float) -> bool:
        """Count one refusal of ``principal``'s; whether it is audited. (Call :meth:`ended` first: a
        window past its end is started anew here, and its count lost.)"""
        window = self._windows.get(principal)
        if window is None or now - window[0] >= self.window_s:
            window = self._windows[principal] = [now, 0, 0]
        if window[1] < self.per_window:
            window[1] += 1
            return True
        window[2] += 1
        return False

    def ended(self, now: float | None = None) -> list[Suppressed]:
        """The windows that ended by ``now`` (None: all of them, the log closing) with refusals not
        audited; every window that ended is forgotten."""
        done = [p for p, w in self._windows.items() if now is None or now - w[0] >= self.window_s]
        return [Suppressed(p, w[2], self.window_s) for p in done if (w := self._windows.pop(p))[2]]


class AuditLog:
    def __init__(self, path: str | None, *, refusals: RefusalWindows | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file = None
        if path:
            fd = open_private_log(path, "audit_log", AUDIT_LOG_FIX, "its lines name tenants, peers and token digests")
            self._file = os.fdopen(fd, "a", encoding="utf-8")  # closed in close()
        self.records = 0
        self._refusals = RefusalWindows() if refusals is None else refusals

    def write(self, event: str, **fields: Any) -> None:
        with self._lock:
            self._write_locked(event, fields)

    def _write_locked(self, event: str, fields: dict) -> None:
        record = {"ts": round(time.time(), 6), "event": event, **fields}
        line = json.dumps(record, default=str, separators=(",", ":"))
        self.records += 1
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()

    def write_refusal(self, principal: str, event: str, **fields: Any) -> bool:
        """:meth:`write`, for a request refused to ``principal`` (a tenant, or the admin token): the
        first few of a window only (the others counted into one ``refusals_suppressed`` line, written
        once the window ended, at the next refusal of anyone or when the log closes); returns whether
        it was written. ``fields`` must be bounded (no client data uncut)."""
        now = time.monotonic()
        with self._lock:
            self._write_suppressed_locked(self._refusals.ended(now))
            audited = self._refusals.charge(principal, now)
            if audited:
                self._write_locked(event, fields)
        return audited

    def _write_suppressed_locked(self, windows: list[Suppressed]) -> None:
        for w in windows:
            self._write_locked("refusals_suppressed", {"principal": w.principal, "suppressed": w.count,
                                                       "window_s": w.window_s})

    def close(self) -> None:
        with self._lock:
            self._write_suppressed_locked(self._refusals.ended())
            if self._file is not None:
                self._file.close()
                self._file = None
