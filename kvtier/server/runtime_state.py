"""Runtime admin changes (quotas, TTLs) and erasures kept across restarts in one small JSON file.

The admin API changes quotas and TTLs at run time; a restart must not silently
undo them. Each change rewrites ``<state_dir>/runtime.json`` atomically (temp
file, fsync, rename, directory fsync; mode 0600). At start the server applies it
*over* the config file: a runtime override wins, including an override that
removed a limit (stored as ``null``). To go back to the config file's value,
set it again through the admin API or delete the file while the server is down.

Erasures. ``admin erase`` deletes a tenant's, namespace's or session's files,
but an older copy of them (a snapshot or backup put back, a crash between the
index forgetting a block and its file's unlink, someone who can write
``disk_dir``) still authenticates at the next start. So a server with a disk
spill records each erasure here first, as a tombstone (owner, namespace or
null, session or null, wall-clock time), and its rebuild drops every file a
tombstone covers: same owner and scope, created at or before the erasure
(:meth:`RuntimeState.erased`). Tombstones are authenticated (an HMAC under a
key from the spill secret, :meth:`~kvtier.server.spill.SpillCodec.erasure_key`):
one that was edited stops the start, naming the file. (Whoever can write
``state_dir`` can still delete them with the file, as any override: keep it
apart from ``disk_dir`` where that matters.)

They stay bounded. Per scope only the latest erasure is kept, and one that a
wider, later erasure of the same owner covers goes. After a rebuild, those
older than every file left on disk go (:meth:`RuntimeState.forget_erasures_before`):
they cover no file that is there. Past :data:`MAX_ERASURES`, the oldest half is
folded into one tombstone per owner at the latest of their times: it drops
more at the next start (blocks of the owner created before then: a cache may
lose), never less.

Format (version 1)::

    {"version": 1,
     "quota": {"acme": 1048576, "globex": null},
     "tenant_ttl_s": {"acme": 3600},
     "namespace_ttl_s": [["acme", "scratch", 600], ["globex", "tmp", null]],
     "erasures": [["acme", "chat", null, 1767225600.25], ["globex", null, "s-42", 1767225601.5]],
     "erasures_mac": "<hex HMAC-SHA256 of the compact JSON of erasures>",
     "list_high_water": 1767229200000000000}

``list_high_water``: no ``LIST`` cursor handed out is past it; a restarted
server numbers after it (:meth:`~kvtier.server.index.BlockIndex.number_after`),
so an old cursor never skips a block, even with the wall clock set back.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import threading

from kvtier.errors import ConfigError
from kvtier.private_files import make_private_dirs

FILE_NAME = "runtime.json"
_VERSION = 1
#: tombstones kept at most (a few hundred KB of JSON, rewritten at each erasure); past it, folded
MAX_ERASURES = 4096

#: an erasure's scope: (owner, namespace or None: all, session or None: all)
Scope = tuple[str, str | None, str | None]


class RuntimeState:
    """The persisted overrides; ``path`` None keeps them in memory only (no disk_dir / state_dir)."""

    def __init__(self, path: str | None, *, erasure_key: bytes | None = None) -> None:
        """``erasure_key`` authenticates the erasure records (a server with a disk spill); without
        it they are neither read nor recorded, only kept in the file as they are."""
        self.path = path
        self._lock = threading.Lock()
        self.quota: dict[str, int | None] = {}
        self.tenant_ttl_s: dict[str, float | None] = {}
        self.namespace_ttl_s: dict[tuple[str, str], float | None] = {}
        self._erasure_key = erasure_key
        #: scope → wall-clock time of its latest erasure
        self._erasures: dict[Scope, float] = {}
        self._kept_erasures: tuple[list, str] | None = None  # (records, tag) not ours to check
        #: no LIST cursor handed out is past it (see the module's docstring)
        self.list_high_water = 0
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
            if "erasures" in doc:
                self._load_erasures(doc["erasures"], doc.get("erasures_mac"))
            mark = doc.get("list_high_water", 0)
            if isinstance(mark, bool) or not isinstance(mark, int) or not 0 <= mark < 1 << 63:
                raise ValueError(f"list_high_water is a non-negative integer, got {mark!r}")
            self.list_high_water = mark
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"runtime overrides {path!r} are unreadable ({exc}); fix or remove the file "
                f"(the config file's quotas and TTLs then apply)"
            ) from None

    def _load_erasures(self, records, tag) -> None:
        if not isinstance(records, list) or not isinstance(tag, str):
            raise ValueError("erasures must be a list with its erasures_mac")
        if self._erasure_key is None:
            self._kept_erasures = (records, tag)
            return
        if not hmac.compare_digest(self._erasures_mac(records), tag):
            raise ValueError("its erasure records do not authenticate under this server's spill secret (edited, "
                             "or written under another master key or server.secret; without them, erased blocks "
                             "in disk_dir may come back)")
        for owner, namespace, session, at in records:
            if not (isinstance(owner, str) and isinstance(namespace, (str, type(None)))
                    and isinstance(session, (str, type(None))) and isinstance(at, (int, float))
                    and not isinstance(at, bool) and math.isfinite(at)):
                raise ValueError(f"an erasure is [owner, namespace or null, session or null, time], got "
                                 f"{[owner, namespace, session, at]!r}")
            self._erasures[(owner, namespace, session)] = float(at)

    def _erasures_mac(self, records: list) -> str:
        body = json.dumps(records, separators=(",", ":"), ensure_ascii=True).encode()
        return hmac.new(self._erasure_key, body, hashlib.sha256).hexdigest()

    # -- erasures ----------------------------------------------------------------------------
    def erased(self, owner: str, namespace: str, session: str, created_wall: float) -> bool:
        """Whether an erasure covers a block of ``owner`` in ``namespace`` and ``session``
        created at ``created_wall`` (at or before the erasure). Four lookups, whatever the count."""
        erasures = self._erasures
        if not erasures:
            return False
        scopes = [(owner, None, None), (owner, namespace, None)]
        if session:  # ("": no session; the index lists no such session, and erasing it erases nothing)
            scopes += [(owner, None, session), (owner, namespace, session)]
        for scope in scopes:
            at = erasures.get(scope)
            if at is not None and created_wall <= at:
                return True
        return False

    def erasures(self) -> dict[Scope, float]:
        """A copy: scope → time of its latest erasure."""
        return dict(self._erasures)

    def record_erasure(self, owner: str, namespace: str | None, session: str | None, erased_at: float) -> None:
        """Persist a tombstone for ``owner``'s blocks (one namespace, one session, or all of them)
        created at or before ``erased_at`` (wall clock); kept only once written (rolled back and
        the error raised otherwise). A server without an erasure key records nothing."""
        if self._erasure_key is None:
            return
        with self._lock:
            before = self._erasures.copy()
            scope = (owner, namespace, session)
            self._erasures[scope] = max(erased_at, self._erasures.get(scope, erased_at))
            self._erasures = _compacted(self._erasures)
            try:
                self._save()
            except BaseException:
                self._erasures = before
                raise

    def forget_erasures_before(self, oldest_wall: float) -> int:
        """Drop the tombstones older than ``oldest_wall``, the creation of the oldest block left on
        disk after a rebuild: they cover none of them. Returns how many went (persisted; an error
        writing keeps them and is raised)."""
        with self._lock:
            before = self._erasures
            kept = {scope: at for scope, at in before.items() if at >= oldest_wall}
            if len(kept) == len(before):
                return 0
            self._erasures = kept
            try:
                self._save()
            except BaseException:
                self._erasures = before
                raise
            return len(before) - len(kept)

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

    def set_list_high_water(self, mark: int) -> None:
        """Persist a new LIST cursor high-water mark (kept only once written; OSError otherwise)."""
        with self._lock:
            before = self.list_high_water
            self.list_high_water = max(before, mark)
            try:
                self._save()
            except BaseException:
                self.list_high_water = before
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
        if self._erasure_key is not None:
            records = [[o, n, se, at] for (o, n, se), at in sorted(self._erasures.items(), key=_scope_order)]
            doc["erasures"], doc["erasures_mac"] = records, self._erasures_mac(records)
        elif self._kept_erasures is not None:
            doc["erasures"], doc["erasures_mac"] = self._kept_erasures
        if self.list_high_water:
            doc["list_high_water"] = self.list_high_water
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


def _scope_order(item: tuple[Scope, float]) -> tuple:
    (owner, namespace, session), at = item
    return (owner, namespace or "", namespace is not None, session or "", session is not None, at)


def _compacted(erasures: dict[Scope, float]) -> dict[Scope, float]:
    """Without the tombstones a wider one at least as late covers; within :data:`MAX_ERASURES`
    (the oldest half folded into one per owner, at the latest of their times: wider, later)."""
    if len(erasures) > MAX_ERASURES:
        by_age = sorted(erasures.items(), key=lambda item: item[1])
        erasures = dict(by_age[len(by_age) // 2:])
        for (owner, _, _), at in by_age[:len(by_age) // 2]:
            wide = (owner, None, None)
            erasures[wide] = max(at, erasures.get(wide, at))
    out = {}
    for scope, at in erasures.items():
        owner, namespace, session = scope
        wider = {(owner, None, None), (owner, namespace, None), (owner, None, session)} - {scope}
        if not any(erasures.get(w, -math.inf) >= at for w in wider):
            out[scope] = at
    return out
