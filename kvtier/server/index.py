"""BlockIndex: what the server holds, per owner (tenant or shared namespace).

The tiers know storage keys only; the index knows, for each, which owner and
namespace it belongs to, its session, its wire header (the client's key and
checksum, sent back with every GET) and its size, and keeps the orders that
governance needs:

* per *account*, least recently used first: quota eviction takes the blocks
  charged to the account that is over its quota. A block is charged to its
  owner, and a block in a shared namespace also to the tenant that wrote it
  (its ``payer``), so a publisher cannot bypass its own quota by writing
  there. The walk stops as soon as enough bytes are freed: O(victims), never
  O(blocks) -- it runs under the index lock on the event loop;
* per (owner, namespace), oldest first (:class:`NamespaceOrder`): TTL
  retention scans only the fronts, and ``LIST`` pages resume after an opaque
  cursor in O(page) instead of copying the namespace for every page. Cursors
  are the namespace's own position numbers: one apart per block added to it,
  from a first number read off a clock (nanoseconds, wall-clock aligned, never
  going back in the process) when the namespace gets its first block, so that
  a namespace emptied and filled again numbers its new blocks after any cursor
  handed out before, and no cursor tells how many blocks other namespaces got.
  A cursor from an earlier run never skips a block (it may list some again):
  a server with a state directory persists a high-water mark past every cursor
  it hands out (:meth:`BlockIndex.number_after`, written ahead by an hour of
  clock, so about once an hour) and numbers after the last run's mark, however
  far its wall clock went back; and a cursor at or past a namespace's next
  position pages from its start (:class:`NamespaceOrder`);
* per (owner, session) a set (session erasure).

Blocks spilled to disk carry their entry with them (:mod:`kvtier.server.spill`);
a restarted server adds them back from there (``tier`` "disk"), and those it
placed in a Mooncake fleet from its fleet journal (``tier`` "mooncake",
:mod:`kvtier.server.fleet`). A shared block's payer travels in its spill
annotation and fleet record: a restart charges it to its writer again while the
config still names that tenant a writer of the namespace (one an older version
wrote names none, and is charged to the shared namespace only).

A block is in the index from its commit until it is deleted, expires or leaves
the last tier (the server's eviction hooks call :meth:`remove`). All methods are
thread safe; none calls into a tier, so hooks running under a tier's lock may
call them (lock order: tier → index).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvtier.server.namespace_order import NamespaceOrder

_FORMER_OWNERS = 1 << 16
#: how far past a cursor handed out the persisted high-water mark is set (one write per hour of clock)
HIGH_WATER_LEASE_NS = 3600 * 10**9

log = logging.getLogger(__name__)


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
    #: the tenant that wrote a block into a shared namespace ("": the owner pays alone)
    payer: str = ""
    #: the tiers KV events announced holding it and not since gone (a block promoted from disk is
    #: held, and was announced, in both): its removal is announced for each (:meth:`BlockIndex.announce`)
    announced: tuple[str, ...] = ()

    @property
    def accounts(self) -> tuple[str, ...]:
        """Whose quotas this block counts against: its owner, and the tenant that wrote it there."""
        if self.payer and self.payer != self.owner:
            return (self.payer, self.owner)
        return (self.owner,)


class BlockIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[bytes, BlockEntry] = {}
        self._lru: dict[str, OrderedDict[bytes, None]] = {}  # per account
        self._charged: dict[str, int] = {}  # per account: payload bytes
        self._age: dict[tuple[str, str], NamespaceOrder] = {}
        self._sessions: dict[tuple[str, str], set[bytes]] = {}
        self._usage: dict[str, int] = {}  # per owner: payload bytes held in its spaces
        self._blocks: dict[str, int] = {}  # per owner
        self._ns_usage: dict[tuple[str, str], int] = {}
        self._by_disk_name: dict[bytes, bytes] = {}
        # Owners of recently removed blocks: deleting a block's sealed copy needs its owner (the
        # disk name is the owner's HMAC), also after the index let it go -- e.g. a write-behind
        # copy that lands after an erasure is deleted again then. Bounded; oldest forgotten first:
        # a hint only. The service's own deletions never rely on it (see :meth:`deleting`).
        self._former: OrderedDict[bytes, str] = OrderedDict()
        # Owners of removed blocks whose tiers' deletion is running (:meth:`deleting`): held until
        # it ends, however many other blocks leave meanwhile. storage key → (owner, deletions).
        self._deleting: dict[bytes, tuple[str, int]] = {}
        self._bytes = 0
        # The clock a new namespace's first listing position is read from: monotonic in this
        # process, about the wall clock's nanoseconds (so cursors mostly keep growing over a restart).
        self._clock_offset_ns = time.time_ns() - time.monotonic_ns()
        # The persisted high-water mark: no cursor handed out (by this run or, read back, an earlier
        # one) is past it. Persisted only with a state directory (``_save_high_water`` None: none).
        self._high_water = 0
        self._save_high_water: Callable[[int], None] | None = None
        self._high_water_lock = threading.Lock()  # (a write under the index lock would stall its hooks)
        #: LRU entries quota eviction has looked at, in all (a test's window on O(victims))
        self.victims_walked = 0

    def __len__(self) -> int:
        return len(self._entries)

    def number_after(self, high_water: int, save: Callable[[int], None]) -> None:
        """Number namespaces created from now on after ``high_water`` (the mark an earlier run
        persisted: none of its cursors is past it), whatever the wall clock says, and have
        :meth:`page` persist a new mark through ``save`` before it hands out a cursor past the
        last one (``save`` raises OSError if it could not: logged, and the page still answered).
        Call it before the first block is added."""
        with self._lock:
            self._clock_offset_ns = max(self._clock_offset_ns, high_water + 1 - time.monotonic_ns())
            self._high_water = high_water
            self._save_high_water = save

    def _raise_high_water(self, cursor: int) -> None:
        with self._high_water_lock:
            if cursor <= self._high_water:
                return
            mark = max(cursor, time.monotonic_ns() + self._clock_offset_ns) + HIGH_WATER_LEASE_NS
            try:
                self._save_high_water(mark)
            except OSError as exc:  # (not retried for the lease: a LIST must not write on every page)
                log.warning("LIST cursor high-water mark not saved (%s): after a restart with the clock "
                            "set back, a cursor handed out now may skip blocks", exc)
            self._high_water = mark

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def add(self, skey: bytes, entry: BlockEntry) -> bool:
        """Record a committed block; False (no change) if it is already recorded."""
        with self._lock:
            if skey in self._entries:
                for account in self._entries[skey].accounts:
                    self._lru[account].move_to_end(skey)
                return False
            self._entries[skey] = entry
            self._former.pop(skey, None)
            for account in entry.accounts:
                self._lru.setdefault(account, OrderedDict())[skey] = None
                self._charged[account] = self._charged.get(account, 0) + entry.nbytes
            group = (entry.owner, entry.namespace)
            order = self._age.get(group)
            if order is None:  # (a block takes far longer than 1 ns to add: after every earlier position)
                order = self._age[group] = NamespaceOrder(first=time.monotonic_ns() + self._clock_offset_ns)
            order.append(skey)
            if entry.session:
                self._sessions.setdefault((entry.owner, entry.session), set()).add(skey)
            if entry.disk_name is not None:
                self._by_disk_name[entry.disk_name] = skey
            self._usage[entry.owner] = self._usage.get(entry.owner, 0) + entry.nbytes
            self._blocks[entry.owner] = self._blocks.get(entry.owner, 0) + 1
            self._ns_usage[group] = self._ns_usage.get(group, 0) + entry.nbytes
            self._bytes += entry.nbytes
            return True

    def get(self, skey: bytes) -> BlockEntry | None:
        return self._entries.get(skey)

    def keys(self) -> list[bytes]:
        """Every storage key indexed (a snapshot)."""
        with self._lock:
            return list(self._entries)

    def owner_of(self, skey: bytes) -> str | None:
        """The owner of a block in the index, of one whose deletion is running (:meth:`deleting`),
        or of one removed recently (a bounded memory: None once enough others left since)."""
        entry = self._entries.get(skey)
        if entry is not None:
            return entry.owner
        held = self._deleting.get(skey)
        return held[0] if held is not None else self._former.get(skey)

    @contextlib.contextmanager
    def deleting(self, skey: bytes, owner: str) -> Iterator[None]:
        """Within it, :meth:`owner_of` answers ``owner`` for ``skey``: a deletion carries the owner
        of the entry it removed to the tiers (a sealed tier names a block by its owner's HMAC),
        however late it runs. (A storage key derives from its owner: one key, one owner.)"""
        with self._lock:
            _, n = self._deleting.get(skey, (owner, 0))
            self._deleting[skey] = (owner, n + 1)
        try:
            yield
        finally:
            with self._lock:
                _, n = self._deleting[skey]
                if n > 1:
                    self._deleting[skey] = (owner, n - 1)
                else:
                    del self._deleting[skey]

    def storage_key_of(self, disk_name: bytes) -> bytes | None:
        """The storage key of the block the disk tier stores under ``disk_name`` (see ``disk_name``)."""
        return self._by_disk_name.get(disk_name)

    def touch(self, skey: bytes) -> None:
        with self._lock:
            entry = self._entries.get(skey)
            if entry is not None:
                for account in entry.accounts:
                    self._lru[account].move_to_end(skey)

    def set_tier(self, skey: bytes, tier: str) -> BlockEntry | None:
        with self._lock:
            entry = self._entries.get(skey)
            if entry is not None:
                entry.tier = tier
            return entry

    def announce(self, skey: bytes, entry: BlockEntry, tier: str) -> bool:
        """Note that ``tier`` is announced holding ``entry``'s block; False (nothing noted, nothing to
        announce) once the entry is no longer the one indexed under ``skey``: its removal has been
        announced already, and a late "stored" would outlive it at every subscriber."""
        with self._lock:
            if self._entries.get(skey) is not entry:
                return False
            if tier not in entry.announced:
                entry.announced += (tier,)
            return True

    def announce_gone(self, entry: BlockEntry, tier: str) -> None:
        """Note that ``tier`` is announced no longer holding ``entry``'s block."""
        with self._lock:
            if tier in entry.announced:
                entry.announced = tuple(t for t in entry.announced if t != tier)

    def remove(self, skey: bytes, *, only: BlockEntry | None = None) -> BlockEntry | None:
        """Forget ``skey``'s block; with ``only``, only if that entry is still the one indexed (a
        block judged earlier, say expired, and put again since is a new entry, left alone)."""
        with self._lock:
            entry = self._entries.get(skey)
            if entry is None or (only is not None and entry is not only):
                return None
            del self._entries[skey]
            self._former[skey] = entry.owner
            if len(self._former) > _FORMER_OWNERS:
                self._former.popitem(last=False)
            for account in entry.accounts:
                lru = self._lru[account]
                del lru[skey]
                if not lru:
                    del self._lru[account]
                _subtract(self._charged, account, entry.nbytes)
            group = (entry.owner, entry.namespace)
            order = self._age[group]
            order.discard(skey)
            self._ns_usage[group] -= entry.nbytes
            if not order:
                del self._age[group]
                del self._ns_usage[group]
            if entry.session:
                members = self._sessions[(entry.owner, entry.session)]
                members.discard(skey)
                if not members:
                    del self._sessions[(entry.owner, entry.session)]
            if entry.disk_name is not None:
                self._by_disk_name.pop(entry.disk_name, None)
            _subtract(self._usage, entry.owner, entry.nbytes)
            _subtract(self._blocks, entry.owner, 1)
            self._bytes -= entry.nbytes
            return entry

    # -- queries for governance (snapshots: the caller deletes outside the lock) ----
    def usage(self, owner: str) -> int:
        """Payload bytes held in ``owner``'s spaces."""
        return self._usage.get(owner, 0)

    def charged(self, account: str) -> int:
        """Payload bytes charged to ``account``: its own blocks and, for a tenant, the shared blocks it wrote."""
        return self._charged.get(account, 0)

    def namespace_usage(self, owner: str, namespace: str) -> tuple[int, int]:
        """(bytes, blocks) of one namespace."""
        with self._lock:
            return self._ns_usage.get((owner, namespace), 0), len(self._age.get((owner, namespace), ()))

    def usage_by_owner(self) -> dict[str, tuple[int, int]]:
        """owner → (bytes, blocks)."""
        with self._lock:
            return {o: (self._usage.get(o, 0), n) for o, n in self._blocks.items()}

    def victims(self, account: str, need: int, extra_of: Callable[[bytes], int]) -> list[bytes]:
        """``account``'s least recently used blocks, oldest first, until they free ``need`` bytes
        (payload plus ``extra_of(skey)``) -- and not one entry further."""
        out: list[bytes] = []
        if need <= 0:
            return out
        with self._lock:
            freed = 0
            for skey in self._lru.get(account, ()):
                out.append(skey)
                freed += self._entries[skey].nbytes + extra_of(skey)
                if freed >= need:
                    break
            self.victims_walked += len(out)
        return out

    def expired(self, now: float, ttl_of: Callable[[str, str], float | None], limit: int = 100_000) -> list[bytes]:
        """Storage keys older than their (owner, namespace) TTL, oldest first per group."""
        with self._lock:
            out: list[bytes] = []
            for (owner, ns), order in self._age.items():
                ttl = ttl_of(owner, ns)
                if ttl is None:
                    continue
                for skey in order:
                    if now - self._entries[skey].created <= ttl or len(out) >= limit:
                        break
                    out.append(skey)
            return out

    def page(self, owner: str, namespace: str, after: int, limit: int) -> tuple[list[BlockEntry], int]:
        """One ``LIST`` page of a namespace, oldest first: up to ``limit`` entries after the cursor
        ``after`` (0: from the start) and the cursor of the next page (0: this was the last).
        Costs O(limit) whatever the namespace's size (see :meth:`NamespaceOrder.page`)."""
        with self._lock:
            order = self._age.get((owner, namespace))
            if order is None:
                return [], 0
            skeys, cursor = order.page(after, limit)
            entries = [self._entries[k] for k in skeys]
        if cursor > self._high_water and self._save_high_water is not None:
            self._raise_high_water(cursor)  # persisted before the cursor reaches the client
        return entries, cursor

    def select(self, owner: str, *, namespace: str | None = None, session: str | None = None) -> list[bytes]:
        """Storage keys of ``owner``'s blocks (one namespace, one session, or all of them). Blocks a
        tenant wrote into a shared namespace belong to that namespace, not to the tenant."""
        with self._lock:
            if session is not None:
                keys = list(self._sessions.get((owner, session), ()))
                return [k for k in keys if namespace is None or self._entries[k].namespace == namespace]
            if namespace is not None:
                return list(self._age.get((owner, namespace), ()))
            return [k for (o, _), order in self._age.items() if o == owner for k in order]

    def check_integrity(self) -> None:
        with self._lock:
            n_accounts = sum(len(e.accounts) for e in self._entries.values())
            assert sum(len(v) for v in self._lru.values()) == n_accounts, "LRU lists disagree with entries"
            assert sum(len(v) for v in self._age.values()) == len(self._entries), "age lists disagree with entries"
            per_owner: dict[str, int] = {}
            per_account: dict[str, int] = {}
            for e in self._entries.values():
                per_owner[e.owner] = per_owner.get(e.owner, 0) + e.nbytes
                for a in e.accounts:
                    per_account[a] = per_account.get(a, 0) + e.nbytes
            assert per_owner == self._usage, f"usage {self._usage} != sum of entries {per_owner}"
            assert per_account == self._charged, f"charges {self._charged} != sum of entries {per_account}"
            assert self._bytes == sum(per_owner.values()), "total bytes disagree"
            for (owner, _), members in self._sessions.items():
                assert all(self._entries[k].owner == owner for k in members), "a session lists a foreign block"
            for order in self._age.values():
                order.check()


def _subtract(table: dict[str, int], name: str, amount: int) -> None:
    left = table[name] - amount
    if left:
        table[name] = left
    else:
        del table[name]
