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
``disk_dir``) still authenticates at the next start; so does the fleet journal's
record of a block whose removal a Mooncake fleet still owed (it did not answer)
when the server stopped. So a server with a disk spill or a fleet journal
records each erasure here first, as a tombstone (owner, namespace or null,
session or null, wall-clock time), and its start drops every file and deletes
from the fleet every journaled block a tombstone covers, never indexing them
again: same owner and scope, created at or before the erasure
(:meth:`RuntimeState.erased`). The erasure's time is the wall clock's, or the
newest creation stamped on a block of the owner's where that is later (the clock
stepped back since: :class:`~kvtier.server.spill.NewestStamps`), so that no
erased block is left outside it.

Tombstones are authenticated (an HMAC under a key from the server's state key --
the secret in ``state_dir``, a disk configured or not, or the master key with
encryption at rest: :meth:`~kvtier.server.spill.SpillCodec.erasure_key`): one that
was edited stops the start, naming the file. (Whoever can write ``state_dir``
can still delete them with the file, as any override: keep it apart from
``disk_dir`` where that matters.) The file names the key they were written
under (``erasures_key``, an id derived from it). Earlier versions keyed them by
the disk spill's secret wherever there was a disk: that key is still read (an
older key of this server's), and what it authenticates is written anew under
the state key at once, so that the upgrade, or a disk dropped later, loses none.
Tombstones of a key this server does not hold (a disk dropped before an upgrade,
a secret replaced) are logged and not applied, the other overrides kept; they
stay in the file as they are (``foreign_erasures``, at most
:data:`MAX_FOREIGN_SETS` sets) and are applied by a start that holds their key
again. (A start that would make ``state_dir``'s secret anew while the file
holds tombstones none of its keys authenticates is refused instead: the secret
moves with the state, :func:`erasures_of_another_key`.) Only tombstones of this
server's keys whose MAC does not match stop the start. A file from before key
ids that does not authenticate stops a server with a disk spill (they were
written under a disk's key); without a disk it may be a dropped disk's: logged,
kept aside.

They are kept: a tombstone goes only where a wider one at least as late covers
it (per scope only the latest erasure is kept, and one that a wider, later
erasure of the same owner covers goes), never because the files it covers are
gone from ``disk_dir`` (a backup put back later would bring them back). Past
:data:`MAX_ERASURES` they are folded: an owner's tombstones older than its
oldest block the server still holds (that no tombstone covers) become one
tombstone of the whole owner at the latest of their times, which covers all
they covered and no block the server keeps. If that is not enough (an owner
whose old blocks stay, erasing one session after another), the oldest
tombstones go, logged: a copy of the blocks they covered, put back, would be
served again. Sets merged at start (an older key's, one kept aside) are not
bounded until the next erasure, which can fold them: none goes unfolded.

Format (version 1)::

    {"version": 1,
     "quota": {"acme": 1048576, "globex": null},
     "tenant_ttl_s": {"acme": 3600},
     "namespace_ttl_s": [["acme", "scratch", 600], ["globex", "tmp", null]],
     "erasures": [["acme", "chat", null, 1767225600.25], ["globex", null, "s-42", 1767225601.5]],
     "erasures_mac": "<hex HMAC-SHA256 of the compact JSON of erasures>",
     "erasures_key": "<the key's id: 16 hex digits of an HMAC under it>",
     "foreign_erasures": [{"erasures": [...], "erasures_mac": "...", "erasures_key": "..."}],
     "list_high_water": 1767229200000000000}

``list_high_water``: no ``LIST`` cursor handed out is past it; a restarted
server numbers after it (:meth:`~kvtier.server.index.BlockIndex.number_after`),
so an old cursor never skips a block, even with the wall clock set back.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone

from kvtier.errors import ConfigError
from kvtier.private_files import fsync_dir, make_private_dirs, replace_private_file
from kvtier.server.spill import NewestStamps, wall_of

FILE_NAME = "runtime.json"
_VERSION = 1
#: tombstones kept at most (a few hundred KB of JSON, rewritten at each erasure); past it, folded
MAX_ERASURES = 4096
#: a folded tombstone stays this far before the oldest block it must not reach (wall clocks slew)
FOLD_MARGIN_S = 1.0
#: sets of erasure records of keys this server does not hold kept in the file; past it the oldest go
MAX_FOREIGN_SETS = 8

#: an erasure's scope: (owner, namespace or None: all, session or None: all)
Scope = tuple[str, str | None, str | None]
#: an owner's blocks the server holds, each as (namespace, session, wall-clock creation)
LiveBlocks = Callable[[str], Iterable[tuple[str, str, float]]]

log = logging.getLogger(__name__)


class RuntimeState:
    """The persisted overrides; ``path`` None keeps them in memory only (no disk_dir / state_dir)."""

    def __init__(self, path: str | None, *, erasure_key: bytes | None = None,
                 older_erasure_keys: Sequence[bytes] = (),
                 unkeyed_erasures_must_authenticate: bool = True) -> None:
        """``erasure_key`` authenticates the erasure records (a server with a disk spill or a fleet
        journal); without it they are neither read nor recorded, only kept in the file as they are.
        ``older_erasure_keys``: keys of this server that earlier versions wrote them under (a disk's
        secret), still read; what they authenticate is written anew under ``erasure_key`` at once.
        ``unkeyed_erasures_must_authenticate``: whether records written before key ids were kept
        that authenticate under none of these keys stop the start (a disk spill's key: only a disk's
        wrote them) or are kept aside, logged (a server without a disk: a dropped disk's)."""
        self.path = path
        self._lock = threading.Lock()
        self.quota: dict[str, int | None] = {}
        self.tenant_ttl_s: dict[str, float | None] = {}
        self.namespace_ttl_s: dict[tuple[str, str], float | None] = {}
        self._erasure_key = erasure_key
        self._older_keys = tuple(k for k in older_erasure_keys if k != erasure_key)
        self._unkeyed_must_authenticate = unkeyed_erasures_must_authenticate
        #: scope → wall-clock time of its latest erasure
        self._erasures: dict[Scope, float] = {}
        #: without an erasure key: the file's erasure fields, kept as they are
        self._kept_erasures: dict | None = None
        #: sets of erasure records under keys this server does not hold, kept in the file as they are
        #: (read again at each start: that key may be this server's again)
        self._foreign: list[dict] = []
        #: the newest creation stamped on each owner's blocks: no tombstone is recorded before it
        self.stamps = NewestStamps()
        #: no LIST cursor handed out is past it (see the module's docstring)
        self.list_high_water = 0
        if path is not None and os.path.exists(path) and self._load(path):
            self._write_migrated()

    def _load(self, path: str) -> bool:
        """Read the file; returns whether erasure records were read under an older key (to write anew)."""
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            if not isinstance(doc, dict) or doc.get("version") != _VERSION:
                raise ValueError(f"expected version {_VERSION}")
            self.quota = {str(o): _opt_int(v) for o, v in doc.get("quota", {}).items()}
            self.tenant_ttl_s = {str(o): _opt_float(v) for o, v in doc.get("tenant_ttl_s", {}).items()}
            self.namespace_ttl_s = {(str(o), str(n)): _opt_float(v) for o, n, v in doc.get("namespace_ttl_s", [])}
            migrated = self._load_erasures(_erasure_set(doc), doc.get("foreign_erasures", []))
            mark = doc.get("list_high_water", 0)
            if isinstance(mark, bool) or not isinstance(mark, int) or not 0 <= mark < 1 << 63:
                raise ValueError(f"list_high_water is a non-negative integer, got {mark!r}")
            self.list_high_water = mark
            return migrated
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"runtime overrides {path!r} are unreadable ({exc}); fix or remove the file "
                f"(the config file's quotas and TTLs then apply)"
            ) from None

    def _load_erasures(self, main: dict | None, foreign) -> bool:
        """Apply the file's erasure records (``main``: its own set; ``foreign``: sets kept aside by an
        earlier start, of keys it did not hold) that authenticate under one of this server's keys;
        keep the others aside, as they are. Returns whether any was read under an older key or from a
        set kept aside: the caller writes them anew under this key (:meth:`_write_migrated`)."""
        if not isinstance(foreign, list) or not all(isinstance(f, dict) for f in foreign):
            raise ValueError("foreign_erasures must be a list of erasure record sets")
        foreign = [_checked_set(f) for f in foreign]
        if self._erasure_key is None:
            self._kept_erasures = {"main": main, "foreign": foreign}
            return False
        migrated = False
        for erasure_set in foreign + ([main] if main is not None else []):  # (oldest first, as they are kept)
            key = self._key_of(erasure_set, is_main=erasure_set is main)
            if key is None:
                self._foreign.append(erasure_set)
                continue
            self._apply(erasure_set["erasures"])
            migrated |= key != self._erasure_key or erasure_set is not main
        if len(self._foreign) > MAX_FOREIGN_SETS:
            dropped = self._foreign[:-MAX_FOREIGN_SETS]
            log.warning("runtime overrides %s: %d sets of erasure records of keys this server does not hold "
                        "dropped, the oldest (past %d)", self.path, len(dropped), MAX_FOREIGN_SETS)
            self._foreign = self._foreign[-MAX_FOREIGN_SETS:]
        return migrated

    def _key_of(self, erasure_set: dict, *, is_main: bool) -> bytes | None:
        """The key of this server's that a set of erasure records authenticates under; None for one
        of a key it does not hold (logged: kept in the file, not applied). Raises ValueError for the
        file's own records if they were edited (their id names one of this server's keys, or a disk
        server's from before key ids that none of its keys authenticates). The MACs are checked
        first: the id is not under them, so a damaged id must not set aside records that verify."""
        records, tag, key_id = erasure_set["erasures"], erasure_set["erasures_mac"], erasure_set.get("erasures_key")
        keys = (self._erasure_key, *self._older_keys)
        for key in keys:
            if hmac.compare_digest(_erasures_mac(key, records), tag):
                return key
        if not is_main:  # (set aside by an earlier start: judged already)
            self._set_aside(records, f"set aside by an earlier start (another key's, id {str(key_id)[:16]!r})")
            return None
        if key_id is not None and key_id not in {_key_id(k) for k in keys}:
            self._set_aside(records, f"written under another key (id {key_id[:16]!r}, this server's "
                                     f"{self._key_id()!r})")
            return None
        if key_id is not None:
            raise ValueError("its erasure records do not authenticate although written under this server's key "
                             "(their erasures_key is its id): edited; without them, erased blocks may come back")
        if not self._unkeyed_must_authenticate:
            self._set_aside(records, "written before key ids were kept, under another key (a disk_dir dropped "
                                     "from the config)")
            return None
        raise ValueError("its erasure records do not authenticate under this server's spill secret (edited, "
                         "or written under another master key or server.secret; without them, erased blocks "
                         "in disk_dir may come back)")

    def _apply(self, records: list) -> None:
        """Add authenticated erasure records (the latest time per scope wins)."""
        for owner, namespace, session, at in records:
            if not (isinstance(owner, str) and isinstance(namespace, (str, type(None)))
                    and isinstance(session, (str, type(None))) and isinstance(at, (int, float))
                    and not isinstance(at, bool) and math.isfinite(at)):
                raise ValueError(f"an erasure is [owner, namespace or null, session or null, time], got "
                                 f"{[owner, namespace, session, at]!r}")
            scope = (owner, namespace, session)
            self._erasures[scope] = max(float(at), self._erasures.get(scope, -math.inf))

    def _write_migrated(self) -> None:
        """Write the erasures just read under an older key (or from a set kept aside) anew under this
        server's key now, not at the next change: that older key (a disk's secret) may be gone at
        the next start, and its records with it. Best effort: they are read again next time. Not
        bounded here, where the blocks a fold must not reach are not known yet (bounded without them,
        the oldest would go, not fold): past :data:`MAX_ERASURES` they stay so until the next
        :meth:`record_erasure` folds them (the file is read whatever its count)."""
        self._erasures = _without_covered(self._erasures)
        try:
            self._save()
        except OSError as exc:
            log.warning("runtime overrides %s: erasure records read under an older key could not be written "
                        "anew under this one (%s); read again under it at the next start", self.path, exc)
            return
        log.info("runtime overrides %s: erasure records read under an older key of this server (a disk's "
                 "secret) written anew under its state key", self.path)

    def _set_aside(self, records: list, why: str) -> None:
        log.warning("runtime overrides %s: %d erasure records %s are not applied, the quotas and TTLs kept: they "
                    "stay in the file as they are, applied again once a start holds that key (the disk_dir or "
                    "master key they were written under configured again)", self.path, len(records), why)

    def _key_id(self) -> str:
        return _key_id(self._erasure_key)

    # -- erasures ----------------------------------------------------------------------------
    def erased(self, owner: str, namespace: str, session: str, created_wall: float) -> bool:
        """Whether an erasure covers a block of ``owner`` in ``namespace`` and ``session``
        created at ``created_wall`` (at or before the erasure). Four lookups, whatever the count."""
        return _covers(self._erasures, owner, namespace, session, created_wall)

    def erasures(self) -> dict[Scope, float]:
        """A copy: scope → time of its latest erasure."""
        return dict(self._erasures)

    def record_erasure(self, owner: str, namespace: str | None, session: str | None, erased_at: float,
                       live_blocks: LiveBlocks | None = None) -> None:
        """Persist a tombstone for ``owner``'s blocks (one namespace, one session, or all of them)
        created at or before ``erased_at`` (wall clock); kept only once written (rolled back and
        the error raised otherwise). A server without an erasure key records nothing.
        ``live_blocks``: the blocks the server holds, asked only past :data:`MAX_ERASURES` (a
        fold must not reach them; None: nothing is folded, the oldest go)."""
        if self._erasure_key is None:
            return
        erased_at = self._not_before_its_stamps(owner, erased_at)
        with self._lock:
            before = self._erasures
            erasures = dict(before)
            scope = (owner, namespace, session)
            erasures[scope] = max(erased_at, erasures.get(scope, erased_at))
            self._erasures = _bounded(_without_covered(erasures), live_blocks)
            try:
                self._save()
            except BaseException:
                self._erasures = before
                raise

    def _not_before_its_stamps(self, owner: str, erased_at: float) -> float:
        """``erased_at``, or the newest creation stamped on a block of ``owner``'s where that is later:
        the wall clock was stepped back since (an NTP step), and a tombstone older than its blocks'
        stamps would not cover them. (It may then cover blocks of the erased scope put in the next
        moments too: dropped at the next start, a cache's loss; erased blocks back would be a leak.)"""
        newest = self.stamps.newest(owner)
        if newest <= erased_at:
            return erased_at
        log.warning("erasure of %r recorded at %s, the newest creation stamped on its blocks, %.3f s ahead of the "
                    "wall clock: the clock was stepped back since", owner, _utc(newest), newest - erased_at)
        return newest

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

    def forget_namespace_ttl(self, owner: str, namespace: str) -> None:
        """Remove ``owner``'s entry for ``namespace`` altogether (not kept as null, which would win
        over the config file): for an entry no setting may make any more -- a tenant's TTL on a
        shared namespace an older version saved (:meth:`AdminAPI.set_ttl
        <kvtier.server.admin.AdminAPI.set_ttl>`). Saved at once; OSError leaves it as it was."""
        with self._lock:
            if (owner, namespace) not in self.namespace_ttl_s:
                return
            before = self.namespace_ttl_s.copy()
            del self.namespace_ttl_s[(owner, namespace)]
            try:
                self._save()
            except BaseException:
                self.namespace_ttl_s = before
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
        foreign = self._foreign
        if self._erasure_key is not None:
            records = [[o, n, se, at] for (o, n, se), at in sorted(self._erasures.items(), key=_scope_order)]
            doc.update(erasures=records, erasures_mac=_erasures_mac(self._erasure_key, records),
                       erasures_key=self._key_id())
        elif self._kept_erasures is not None:
            doc.update(self._kept_erasures["main"] or {})
            foreign = self._kept_erasures["foreign"]
        if foreign:
            doc["foreign_erasures"] = foreign
        if self.list_high_water:
            doc["list_high_water"] = self.list_high_water
        directory = os.path.dirname(self.path) or "."
        make_private_dirs(directory)
        # Written whole or not at all: a write the disk cuts short (nearly full) raises ENOSPC and
        # removes its temp file, and the old file stays (a short file renamed over it stopped every
        # later start); the caller then rolls the change back.
        replace_private_file(self.path, json.dumps(doc, indent=1, sort_keys=True).encode())
        fsync_dir(directory)  # the rename itself survives a power cut


def erasures_of_another_key(path: str, keys: Sequence[bytes]) -> int:
    """How many erasure records the file at ``path`` holds as its own that none of ``keys``
    authenticates (0: none, no file, or one of the keys does): what a server starting under a key
    made anew would set aside. Reads only; ConfigError for a file a start would refuse."""
    if not os.path.exists(path):
        return 0
    own = RuntimeState(path)._kept_erasures["main"]  # (read as without a key: nothing written)
    if own is None or not own["erasures"]:
        return 0
    if any(hmac.compare_digest(_erasures_mac(key, own["erasures"]), own["erasures_mac"]) for key in keys):
        return 0
    return len(own["erasures"])


def blocks_held_in(index) -> LiveBlocks:
    """The blocks a :class:`~kvtier.server.index.BlockIndex` holds, as :meth:`RuntimeState.record_erasure`
    asks for them: what a folded tombstone must not reach."""

    def held(owner: str):
        for skey in index.select(owner):
            entry = index.get(skey)
            if entry is not None:
                yield entry.namespace, entry.session, wall_of(entry.created)

    return held


def _erasure_set(doc: dict) -> dict | None:
    """The file's own erasure records with their MAC and key id (None: it has none)."""
    if "erasures" not in doc:
        return None
    erasure_set = {"erasures": doc["erasures"], "erasures_mac": doc.get("erasures_mac")}
    if doc.get("erasures_key") is not None:
        erasure_set["erasures_key"] = doc["erasures_key"]
    return _checked_set(erasure_set)


def _checked_set(erasure_set: dict) -> dict:
    if not (isinstance(erasure_set.get("erasures"), list) and isinstance(erasure_set.get("erasures_mac"), str)
            and isinstance(erasure_set.get("erasures_key"), (str, type(None)))):
        raise ValueError("erasures must be a list with its erasures_mac (and the erasures_key id)")
    return erasure_set


def _key_id(key: bytes) -> str:
    """The id of an erasure key the records are written under (not the key: one-way)."""
    return hmac.new(key, b"kvtier erasures key id", hashlib.sha256).hexdigest()[:16]


def _erasures_mac(key: bytes, records: list) -> str:
    body = json.dumps(records, separators=(",", ":"), ensure_ascii=True).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


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


def _covers(erasures: dict[Scope, float], owner: str, namespace: str, session: str, created_wall: float) -> bool:
    """Whether a tombstone of ``erasures`` covers a block (see :meth:`RuntimeState.erased`)."""
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


def _without_covered(erasures: dict[Scope, float]) -> dict[Scope, float]:
    """Without the tombstones that a wider one of the same owner, at least as late, covers."""
    out = {}
    for scope, at in erasures.items():
        owner, namespace, session = scope
        wider = {(owner, None, None), (owner, namespace, None), (owner, None, session)} - {scope}
        if not any(erasures.get(w, -math.inf) >= at for w in wider):
            out[scope] = at
    return out


def _bounded(erasures: dict[Scope, float], live_blocks: LiveBlocks | None) -> dict[Scope, float]:
    """Within :data:`MAX_ERASURES`: folded where that reaches no block the server holds, then,
    if still too many, without the oldest (logged: what they covered may come back)."""
    if len(erasures) <= MAX_ERASURES:
        return erasures
    if live_blocks is not None:
        erasures = _without_covered(_folded(erasures, live_blocks))
    if len(erasures) <= MAX_ERASURES:
        return erasures
    by_age = sorted(erasures.items(), key=lambda item: item[1])
    dropped = by_age[:len(by_age) - MAX_ERASURES]
    log.warning("%d erasure tombstones dropped, the oldest (erased up to %s): past %d, those that cannot be "
                "folded go; a copy of the blocks they covered, put back, would be served again",
                len(dropped), _utc(dropped[-1][1]), MAX_ERASURES)
    return dict(by_age[len(dropped):])


def _folded(erasures: dict[Scope, float], live_blocks: LiveBlocks) -> dict[Scope, float]:
    """Per owner, the tombstones older than its oldest held block that none covers (less
    :data:`FOLD_MARGIN_S`) as one tombstone of the whole owner at the latest of their times: it
    covers every block they cover, and none that the server keeps."""
    by_owner: dict[str, list[tuple[Scope, float]]] = {}
    for scope, at in erasures.items():
        by_owner.setdefault(scope[0], []).append((scope, at))
    out = dict(erasures)
    for owner, held in by_owner.items():
        if len(held) < 2:
            continue  # one tombstone folded is no fewer
        horizon = _oldest_uncovered(erasures, owner, live_blocks(owner)) - FOLD_MARGIN_S
        old = [(scope, at) for scope, at in held if at < horizon]
        if len(old) < 2:
            continue
        for scope, _ in old:
            del out[scope]
        out[(owner, None, None)] = max(at for _, at in old)
    return out


def _oldest_uncovered(erasures: dict[Scope, float], owner: str,
                      blocks: Iterable[tuple[str, str, float]]) -> float:
    """The creation of ``owner``'s oldest block that no tombstone covers (infinity: none)."""
    return min((wall for namespace, session, wall in blocks
                if not _covers(erasures, owner, namespace, session, wall)), default=math.inf)


def _utc(wall: float) -> str:
    return datetime.fromtimestamp(wall, timezone.utc).isoformat(timespec="seconds")
