"""BlockIndex: what the server holds, per owner (tenant or shared namespace).

The tiers know storage keys only; the index knows, for each, which owner and
namespace it belongs to, its session, its wire header (the client's key and
checksum, sent back with every GET) and its size, and keeps the orders that
governance needs:

* per owner, least recently used first (quota eviction takes its own blocks);
* per (owner, namespace), oldest first (TTL retention scans only the fronts);
* per (owner, session) a set (session erasure).

Blocks spilled to disk carry their entry with them (:mod:`kvtier.server.spill`);
a restarted server adds them back from there (``tier`` "disk").

A block is in the index from its commit until it is deleted, expires or leaves
the last tier (the server's eviction hooks call :meth:`remove`). All methods are
thread safe; none calls into a tier, so hooks running under a tier's lock may
call them (lock order: tier → index).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


_FORMER_OWNERS = 1 << 16


@dataclass(slots=True)
class BlockEntry:
    owner: str
    namespace: str
    key: bytes  #: the client's key (tenant-relative)
    nbytes: int
    header: bytes  #: the block header as the writer sent it (verified on put)
    created: float  #: time.monotonic() at commit (on disk as wall time: see kvtier.server.spill)
    session: str = ""
    tier: str = "host"  #: the fastest tier that holds it (for events and listings)
    parent: bytes | None = None  #: the parent's storage key, as the writer named it
    #: the name the disk tier stores it under when that is not the storage key (encryption at rest)
    disk_name: bytes | None = None


class BlockIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[bytes, BlockEntry] = {}
        self._lru: dict[str, OrderedDict[bytes, None]] = {}
        self._age: dict[tuple[str, str], dict[bytes, None]] = {}
        self._sessions: dict[tuple[str, str], set[bytes]] = {}
        self._usage: dict[str, int] = {}
        self._ns_usage: dict[tuple[str, str], int] = {}
        self._by_disk_name: dict[bytes, bytes] = {}
        # Owners of recently removed blocks: deleting a block's sealed copy needs its owner (the
        # disk name is the owner's HMAC), also after the index let it go -- e.g. a write-behind
        # copy that lands after an erasure is deleted again then. Bounded; oldest forgotten first.
        self._former: OrderedDict[bytes, str] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def add(self, skey: bytes, entry: BlockEntry) -> bool:
        """Record a committed block; False (no change) if it is already recorded."""
        with self._lock:
            if skey in self._entries:
                self._lru[entry.owner].move_to_end(skey)
                return False
            self._entries[skey] = entry
            self._former.pop(skey, None)
            self._lru.setdefault(entry.owner, OrderedDict())[skey] = None
            self._age.setdefault((entry.owner, entry.namespace), {})[skey] = None
            if entry.session:
                self._sessions.setdefault((entry.owner, entry.session), set()).add(skey)
            if entry.disk_name is not None:
                self._by_disk_name[entry.disk_name] = skey
            self._usage[entry.owner] = self._usage.get(entry.owner, 0) + entry.nbytes
            group = (entry.owner, entry.namespace)
            self._ns_usage[group] = self._ns_usage.get(group, 0) + entry.nbytes
            self._bytes += entry.nbytes
            return True

    def get(self, skey: bytes) -> BlockEntry | None:
        return self._entries.get(skey)

    def owner_of(self, skey: bytes) -> str | None:
        """The owner of a block in the index, or of one removed recently."""
        entry = self._entries.get(skey)
        return entry.owner if entry is not None else self._former.get(skey)

    def storage_key_of(self, disk_name: bytes) -> bytes | None:
        """The storage key of the block the disk tier stores under ``disk_name`` (see ``disk_name``)."""
        return self._by_disk_name.get(disk_name)

    def touch(self, skey: bytes) -> None:
        with self._lock:
            entry = self._entries.get(skey)
            if entry is not None:
                self._lru[entry.owner].move_to_end(skey)

    def set_tier(self, skey: bytes, tier: str) -> BlockEntry | None:
        with self._lock:
            entry = self._entries.get(skey)
            if entry is not None:
                entry.tier = tier
            return entry

    def remove(self, skey: bytes) -> BlockEntry | None:
        with self._lock:
            entry = self._entries.pop(skey, None)
            if entry is None:
                return None
            self._former[skey] = entry.owner
            if len(self._former) > _FORMER_OWNERS:
                self._former.popitem(last=False)
            lru = self._lru[entry.owner]
            del lru[skey]
            if not lru:
                del self._lru[entry.owner]
            group = (entry.owner, entry.namespace)
            age = self._age[group]
            del age[skey]
            self._ns_usage[group] -= entry.nbytes
            if not age:
                del self._age[group]
                del self._ns_usage[group]
            if entry.session:
                members = self._sessions[(entry.owner, entry.session)]
                members.discard(skey)
                if not members:
                    del self._sessions[(entry.owner, entry.session)]
            if entry.disk_name is not None:
                self._by_disk_name.pop(entry.disk_name, None)
            self._usage[entry.owner] -= entry.nbytes
            if not self._usage[entry.owner]:
                del self._usage[entry.owner]
            self._bytes -= entry.nbytes
            return entry

    # -- queries for governance (snapshots: the caller deletes outside the lock) ----
    def usage(self, owner: str) -> int:
        return self._usage.get(owner, 0)

    def namespace_usage(self, owner: str, namespace: str) -> tuple[int, int]:
        """(bytes, blocks) of one namespace."""
        with self._lock:
            return self._ns_usage.get((owner, namespace), 0), len(self._age.get((owner, namespace), ()))

    def usage_by_owner(self) -> dict[str, tuple[int, int]]:
        """owner → (bytes, blocks)."""
        with self._lock:
            return {o: (self._usage.get(o, 0), len(lru)) for o, lru in self._lru.items()}

    def least_recent(self, owner: str, limit: int) -> list[tuple[bytes, int]]:
        """Up to ``limit`` (storage key, nbytes) of ``owner``, least recently used first."""
        with self._lock:
            out = []
            for skey in self._lru.get(owner, ()):
                out.append((skey, self._entries[skey].nbytes))
                if len(out) >= limit:
                    break
            return out

    def expired(self, now: float, ttl_of: Callable[[str, str], float | None], limit: int = 100_000) -> list[bytes]:
        """Storage keys older than their (owner, namespace) TTL, oldest first per group."""
        with self._lock:
            out: list[bytes] = []
            for (owner, ns), age in self._age.items():
                ttl = ttl_of(owner, ns)
                if ttl is None:
                    continue
                for skey in age:
                    if now - self._entries[skey].created <= ttl or len(out) >= limit:
                        break
                    out.append(skey)
            return out

    def select(self, owner: str, *, namespace: str | None = None, session: str | None = None) -> list[bytes]:
        with self._lock:
            if session is not None:
                keys = list(self._sessions.get((owner, session), ()))
                return [k for k in keys if namespace is None or self._entries[k].namespace == namespace]
            if namespace is not None:
                return list(self._age.get((owner, namespace), ()))
            return list(self._lru.get(owner, ()))

    def check_integrity(self) -> None:
        with self._lock:
            assert sum(len(v) for v in self._lru.values()) == len(self._entries), "LRU lists disagree with entries"
            assert sum(len(v) for v in self._age.values()) == len(self._entries), "age lists disagree with entries"
            per_owner: dict[str, int] = {}
            for e in self._entries.values():
                per_owner[e.owner] = per_owner.get(e.owner, 0) + e.nbytes
            assert per_owner == self._usage, f"usage {self._usage} != sum of entries {per_owner}"
            assert self._bytes == sum(per_owner.values()), "total bytes disagree"
            for (owner, _), members in self._sessions.items():
                assert all(self._entries[k].owner == owner for k in members), "a session lists a foreign block"
