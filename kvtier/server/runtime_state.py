"""Runtime admin changes (quotas, TTLs) kept across restarts in one small JSON file.

The admin API changes quotas and TTLs at run time; a restart must not silently
undo them. Each change rewrites ``<state_dir>/runtime.json`` atomically (temp
file, fsync, rename, directory fsync; mode 0600). At start the server applies it
*over* the config file: a runtime override wins, including an override that
removed a limit (stored as ``null``). To go back to the config file's value,
set it again through the admin API or delete the file while the server is down.

Format (version 1)::

    {"version": 1,
     "quota": {"acme": 1048576, "globex": null},
     "tenant_ttl_s": {"acme": 3600},
     "namespace_ttl_s": [["acme", "scratch", 600], ["globex", "tmp", null]]}
"""

from __future__ import annotations

import json
import math
import os
import threading

from kvtier.errors import ConfigError
from kvtier.private_files import make_private_dirs

FILE_NAME = "runtime.json"
_VERSION = 1


class RuntimeState:
    """The persisted overrides; ``path`` None keeps them in memory only (no disk_dir / state_dir)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.quota: dict[str, int | None] = {}
        self.tenant_ttl_s: dict[str, float | None] = {}
        self.namespace_ttl_s: dict[tuple[str, str], float | None] = {}
        if path is not None and os.path.exists(path):
            self._load(path)

    def _load(self, path: str) -> None:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            if not isinstance(doc, dict) or doc.get("version") != _VERSION:
                raise ValueError(f"expected version {_VERSION}")
            self.quota = {str(o): _opt_int(v) for o, v in doc.get("quota", {}).items()}
            self.tenant_ttl_s = {str(o): _opt_float(v) for o, v in doc.get("tenant_ttl_s", {}).items()}
            self.namespace_ttl_s = {(str(o), str(n)): _opt_float(v) for o, n, v in doc.get("namespace_ttl_s", [])}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"runtime overrides {path!r} are unreadable ({exc}); fix or remove the file "
                f"(the config file's quotas and TTLs then apply)"
            ) from None

    # -- changes (each one persisted before it returns) -------------------------------------
    def set_quota(self, owner: str, quota: int | None) -> None:
        with self._lock:
            before = self.quota.copy()
            self.quota[owner] = quota
            try:
                self._save()
            except BaseException:
                self.quota = before  # not saved: not changed (the caller reports the error)
                raise

    def set_ttl(self, owner: str, ttl_s: float | None, namespace: str | None) -> None:
        with self._lock:
            tenant_before, ns_before = self.tenant_ttl_s.copy(), self.namespace_ttl_s.copy()
            if namespace is None:
                self.tenant_ttl_s[owner] = ttl_s
            else:
                self.namespace_ttl_s[(owner, namespace)] = ttl_s
            try:
                self._save()
            except BaseException:
                self.tenant_ttl_s, self.namespace_ttl_s = tenant_before, ns_before
                raise

    def _save(self) -> None:
        if self.path is None:
            return
        doc = {
            "version": _VERSION,
            "quota": self.quota,
            "tenant_ttl_s": self.tenant_ttl_s,
            "namespace_ttl_s": [[o, n, v] for (o, n), v in sorted(self.namespace_ttl_s.items())],
        }
        directory = os.path.dirname(self.path) or "."
        make_private_dirs(directory)
        temp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, json.dumps(doc, indent=1, sort_keys=True).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, self.path)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the rename itself survives a power cut
        finally:
            os.close(dfd)


def _opt_int(v) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"a quota is a non-negative integer or null, got {v!r}")
    return v


def _opt_float(v) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        # NaN would make the sweeper expire every block of the owner: refuse to start instead
        raise ValueError(f"a TTL is a finite non-negative number or null, got {v!r}")
    return float(v)
