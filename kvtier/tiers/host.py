"""``host``: one preallocated DRAM pool that fits the blocks it holds.

The pool is a single anonymous mmap, faulted in at start (``MAP_POPULATE``-like
prefault) and advised to use huge pages, so that puts copy into warm memory at
memcpy speed. :mod:`kvtier.tiers.host_alloc` carves it: a block takes a run of
whole pages (page aligned, so it can be written to an O_DIRECT file or a socket
without another copy, and a 256 KiB block takes 256 KiB, not a ``max_block``
slot); blocks under half a page take a chunk of a size class, unless the pool is
built with ``slabs=False`` (the server's: a chunk's slab stays taken while any
chunk of it lives, so what a chunk is charged is not what it keeps from reuse;
without slabs a block's :meth:`HostTier.footprint` is exactly the pool memory it
holds). ``slot_bytes`` is the largest block accepted.

Writes are two-phase: :meth:`HostTier.reserve` takes memory under the lock and
hands out a writable view of exactly the block's bytes, the caller fills it
outside the lock (``put`` copies; the server receives straight from a socket),
then :meth:`HostTier.commit` publishes it or :meth:`HostTier.abort` frees it --
a torn upload leaves no trace. Two writers of one key each fill a reservation of
their own, and the first to commit publishes the block (the other's copy is
freed): had the second been told "being written" and done nothing, the block
would be lost when the first writer aborted. Readers pin a block (refcount) while they copy,
``borrow`` or ``hold`` it; a pinned block is never evicted, overwritten or
reused, and ``delete`` of a pinned block hides it at once and frees its memory
at the last unpin.

Eviction: the policy names victims; the tier evicts them in that order until
the new block fits. Memory freed by a victim of another size may not be usable
(a hole too short for a long block, a chunk of another class): once the
victims evicted add up to what the new block needs, the tier also evicts the
fewest bytes of unpinned neighbours around the last hole so that a long enough
run appears (memcached's slab rebalance, at page granularity).

Retention (``ttl_s``): a block's age counts from its first write into the store,
carried in by ``put``/``reserve`` (``created``, wall clock) and kept here on the
monotonic clock. An expired block is a miss; it leaves the pool as an evicted one
does, through ``on_evict`` (counted in ``expirations``, not ``evictions``), so that
a block the tier below has no copy of yet reaches it if that tier's TTL admits it.
:meth:`HostTier.expire` does that at once for every expired block (a store's
write-behind flusher calls it), handing them to ``on_evict`` outside the lock
(misses already, their memory pinned until the hook returns; a ``delete`` of
one waits for it): a demotion is a put into the tier below, and a backlog of
them under the lock stalled every DRAM read and write. Otherwise a look-up or
an eviction finds them (one block, under the lock).
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvtier.core.keys import BlockKey
from kvtier.core.payload import BlockMeta
from kvtier.policy.eviction import EvictionPolicy, LRUPolicy
from kvtier.tiers.base import AgeQueue, Status, Tier, check_ttl
from kvtier.tiers.host_alloc import CACHE_LINE, Run, RunAllocator, Slab

PAGE = mmap.PAGESIZE


@dataclass(slots=True, eq=False)
class _Entry:
    key: BlockKey
    offset: int  #: byte offset in the pool
    home: Run | Slab  #: the run it owns or the slab it has a chunk of
    nbytes: int
    footprint: int  #: bytes of pool it takes
    meta: BlockMeta | None
    created: float  #: first written into the store, on the monotonic clock
    pins: int = 0
    key_pins: int = 0  #: those of ``pins`` taken by :meth:`HostTier.pin` (``unpin`` releases only these)
    published: bool = False
    doomed: bool = False  # deleted while pinned: free the memory at the last unpin
    #: the parent its publishing commit named: the demotion hook passes it down (:meth:`HostTier.parent_of`)
    parent: BlockKey | None = None


class Reservation(NamedTuple):
    key: BlockKey
    entry: _Entry
    view: np.ndarray  #: writable uint8 view of exactly the block's bytes


class Held(NamedTuple):
    view: np.ndarray  #: read-only uint8 view; valid until ``release()``
    release: Callable[[], None]


class HostTier(Tier):
    """A DRAM pool of ``capacity_bytes`` holding blocks of up to ``slot_bytes`` each.

    A block takes :meth:`footprint` bytes: its size rounded up to a page (to 64
    bytes when ``slot_bytes`` is under a page; for blocks under half a page, their
    size class's chunk, unless ``slabs=False``).

    ``slabs=False``: no size-class slabs; every block takes a run of whole pages, so
    the footprint charged for it (quotas) is exactly the memory it keeps from other
    blocks. With slabs a tiny block is charged one chunk but keeps its whole slab
    (16 pages) from reuse while it lives.

    ``ttl_s``: blocks older than this (since their first write into the store, see the
    module docstring) are misses; a positive number of seconds or None (no expiry).
    """

    name = "host"
    bounded_reads = True  # a memcpy
    keeps_age = True

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        *,
        policy: EvictionPolicy | None = None,
        ttl_s: float | None = None,
        prefault: bool = True,
        slabs: bool = True,
    ) -> None:
        super().__init__()
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        ttl_s = check_ttl(ttl_s)
        # Page-granular runs can go straight to O_DIRECT files and sockets; a pool of
        # sub-page blocks (tests, toy models) only gets cache-line granules, not a page each.
        granule = PAGE if slot_bytes >= PAGE else CACHE_LINE
        self._alloc = RunAllocator(max(1, capacity_bytes // granule), granule, slabs=slabs)
        #: the largest block accepted, as the pool rounds it
        self.slot_bytes = self._alloc.footprint(slot_bytes)
        if capacity_bytes < self.slot_bytes:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} holds no block of {self.slot_bytes} bytes; "
                f"give at least one block's worth"
            )
        self._capacity = self._alloc.granules * granule
        self._mmap = mmap.mmap(-1, self._capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # Transparent huge pages before the first touch: every payload is copied into
        # and out of this pool, and with 4 KiB pages the copy misses the TLB 512 times
        # as often (measured: 10.5 vs 8.9 GB/s copies).
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self._pool = np.frombuffer(self._mmap, dtype=np.uint8)
        if prefault:  # fault every page in now, so that puts copy into warm memory
            self._pool[:: mmap.PAGESIZE] = 0
        self._entries: dict[BlockKey, _Entry] = {}
        #: reservations of a key whose ``_entries`` holder was still being written (see :meth:`reserve`)
        self._rivals: dict[BlockKey, list[_Entry]] = {}
        #: deleted while pinned: memory freed at their last unpin
        self._doomed: dict[BlockKey, list[_Entry]] = {}
        #: expired blocks :meth:`expire` is handing to ``on_evict`` outside the lock (misses already,
        #: pinned and doomed: their memory stays valid until the hook returns); a delete of one waits
        self._leaving: dict[BlockKey, list[_Entry]] = {}
        self._left = threading.Condition(self._lock)  # notified as each of those is freed
        self._policy = policy if policy is not None else LRUPolicy()  # an empty policy is falsy
        self._ttl_s = ttl_s
        #: published blocks by age, for :meth:`expire` (only with a TTL)
        self._ages = AgeQueue(self._aged_entries) if ttl_s is not None else None
        self._used = 0  # payload bytes of every block holding memory
        self._footprint = 0  # pool bytes they take

    # -- contract ---------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Payload bytes held (blocks being written and deleted-but-pinned included)."""
        return self._used

    @property
    def footprint_bytes(self) -> int:
        """Pool bytes taken by those blocks (what the pool really spends on them)."""
        return self._footprint

    def footprint(self, nbytes: int) -> int:
        """Bytes of pool a block of ``nbytes`` takes (what quotas charge)."""
        return self._alloc.footprint(nbytes)

    @property
    def num_slots(self) -> int:
        """How many blocks of the largest size the pool holds (an estimate for caps)."""
        return self._capacity // self.slot_bytes

    @property
    def free_slots(self) -> int:
        """How many blocks of the largest size fit without evicting (truthy: any block does)."""
        with self._lock:
            return self._alloc.largest_free_bytes // self.slot_bytes

    def fits_now(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` would be placed now without evicting one."""
        with self._lock:
            return self._alloc.alloc_fits(nbytes)

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return self._live(key) is not None

    def lookup_prefix(self, keys) -> int:
        with self._lock:
            n = 0
            for key in keys:
                if self._live(key) is None:
                    break
                n += 1
            return n

    def get(self, key: BlockKey, out) -> Status:
        dst = _as_bytes(out, writable=True)
        with self._lock:
            entry = self._live(key)
            if entry is None:
                self.stats.misses += 1
                return Status.MISS
            if entry.nbytes != dst.nbytes:
                self.stats.misses += 1
                return Status.BAD_SIZE
            entry.pins += 1
            self._policy.on_access(key)
            pool = self._pool  # taken with the pin: close() may drop the tier's, never this one
        try:
            np.copyto(dst, self._view(entry, pool))
        finally:
            self._unpin_entry(key, entry)
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_read += entry.nbytes
        return Status.OK

    def get_many(self, keys, outs) -> list[Status]:
        """:meth:`get` of each block; the misses found under one hold of the lock (a load asks
        the host tier first for every block a slower tier then serves)."""
        if len(keys) != len(outs):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} buffers")
        dsts = [_as_bytes(out, writable=True) for out in outs]  # every caller mistake, as get would say
        with self._lock:
            held = [self._live(key) is not None for key in keys]
            self.stats.misses += held.count(False)
        return [self.get(key, dst) if here else Status.MISS for key, dst, here in zip(keys, dsts, held)]

    def put(self, key: BlockKey, data, *, parent: BlockKey | None = None, meta: BlockMeta | None = None,
            created: float | None = None) -> Status:
        """Copy ``data`` in. ``created``: when the block was first written into the store (wall
        clock; None: now); one already past ``ttl_s`` is not stored (OK, counted as expired)."""
        src = _as_bytes(data)
        status, res = self.reserve(key, src.nbytes, meta=meta, created=created)
        if res is None:
            return status  # OK (already held, or expired already), FULL or TOO_LARGE
        np.copyto(res.view, src)
        self.commit(res, parent=parent)
        return Status.OK

    # -- two-phase writes and held views --------------------------------------------
    def reserve(
        self, key: BlockKey, nbytes: int, *, meta: BlockMeta | None = None, created: float | None = None,
        evict_first: Sequence[BlockKey] = (),
    ) -> tuple[Status, Reservation | None]:
        """Take memory for ``key`` (evicting as needed) and return a writable view of it.

        Returns (OK, reservation) to fill then :meth:`commit` or :meth:`abort`;
        (OK, None) if the key is already held (content addressed: nothing to
        do) or ``created`` (wall clock: when the block was first written into the
        store; None: now) is already past ``ttl_s`` (nothing stored, counted as
        expired); (FULL or TOO_LARGE, None) otherwise. Nothing is visible to readers
        before ``commit``. A key another writer is still writing gets a
        reservation of its own (a *rival*): whichever commits first is the
        block, so neither writer's abort can lose it.

        ``evict_first``: where the block does not fit, these blocks (those held and not
        pinned) are evicted before the policy's victims, until it does (a server's tenant at
        its quota gives up its own blocks, not another tenant's).
        """
        if not 0 < nbytes <= self.slot_bytes:
            with self._lock:
                self.stats.put_failures += 1
            return Status.TOO_LARGE, None
        with self._lock:
            if self._pool is None:
                raise RuntimeError(f"put into a closed HostTier {self.name!r}")
            if self._live(key) is not None:
                self._policy.on_access(key)
                return Status.OK, None
            now = time.monotonic()
            born = now if created is None else now - max(0.0, time.time() - created)
            if self._ttl_s is not None and now - born > self._ttl_s:
                self.stats.expirations += 1  # older than this tier keeps blocks: never stored
                return Status.OK, None
            entry = _Entry(key, 0, None, nbytes, self._alloc.plan(nbytes)[2], meta,  # type: ignore[arg-type]
                           born, pins=1)
            got = self._alloc.alloc(nbytes, entry) or self._evict_for_locked(nbytes, entry, evict_first)
            if got is None:
                self.stats.put_failures += 1
                return Status.FULL, None
            entry.offset, entry.home = got
            if key in self._entries:  # being written by another writer
                self._rivals.setdefault(key, []).append(entry)
            else:
                self._entries[key] = entry
            self._used += nbytes
            self._footprint += entry.footprint
            pool = self._pool
        return Status.OK, Reservation(key, entry, self._view(entry, pool))

    def commit(self, res: Reservation, *, parent: BlockKey | None = None) -> bool:
        """Publish a filled reservation; False if another writer's copy of the key was
        published first (content addressed: the same bytes), and this one is freed, or if the
        tier was closed meanwhile (nothing is published in a closed pool)."""
        key, entry = res.key, res.entry
        with self._lock:
            holder = self._entries.get(key)
            if self._pool is None:
                entry.doomed = True
                won = False
            elif holder is not entry:  # a rival: the first copy committed wins
                self._forget_rival_locked(key, entry)
                if self._live(key) is not None:
                    entry.doomed = True  # the last unpin (ours) frees the memory
                    won = False
                else:
                    # Read the holder again: _live() has just evicted and freed it if it was a
                    # published copy past the TTL, and a freed block filed as a rival would stay
                    # in _rivals for good (the integrity check then fails a healthy pool).
                    writing = self._entries.get(key)
                    if writing is not None:  # still being written: that writer is now the rival
                        self._rivals.setdefault(key, []).append(writing)
                    self._entries[key] = entry
                    won = True
            else:
                won = True
            if won:
                entry.published = True
                entry.parent = parent
                if self._ages is not None:
                    self._ages.push(entry.created, key, entry, held=len(self._entries))
                self._policy.on_insert(key, parent)
                self.stats.puts += 1
                self.stats.bytes_written += entry.nbytes
        self._unpin_entry(key, entry)
        return won

    def abort(self, res: Reservation) -> None:
        """Drop a reservation: its memory is freed, nothing was ever visible."""
        with self._lock:
            if self._entries.get(res.key) is res.entry:
                del self._entries[res.key]
            else:
                self._forget_rival_locked(res.key, res.entry)
            self.stats.put_failures += 1
            res.entry.doomed = True  # the last unpin (ours) frees the memory
        self._unpin_entry(res.key, res.entry)

    def _forget_rival_locked(self, key: BlockKey, entry: _Entry) -> None:
        rivals = self._rivals.get(key)
        if rivals is not None and entry in rivals:
            rivals.remove(entry)
            if not rivals:
                del self._rivals[key]

    def hold(self, key: BlockKey) -> Held | None:
        """Pin a block and return a read-only view plus its ``release``; None if absent.

        Unlike :meth:`borrow` this is not a ``with`` block, so the pin can span
        the awaits of an asynchronous send. Counted as a hit.
        """
        with self._lock:
            entry = self._live(key)
            if entry is None:
                return None
            entry.pins += 1
            self._policy.on_access(key)
            self.stats.hits += 1
            self.stats.bytes_read += entry.nbytes
            pool = self._pool
        view = self._view(entry, pool)
        view.flags.writeable = False
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._unpin_entry(key, entry)

        return Held(view, release)

    def delete(self, key: BlockKey) -> bool:
        """Remove a block (False if not held). Waits for a demotion of the key that :meth:`expire`
        has under way (as a delete waits for the lock an eviction's demotion holds), so that a store
        deleting its fastest tier first finds the demoted copy in the tier below and removes it too."""
        with self._lock:
            while key in self._leaving:
                self._left.wait()
            entry = self._entries.get(key)
            if entry is None or not entry.published or entry.doomed:
                return False
            self._policy.on_remove(key)
            self.stats.deletes += 1
            if entry.pins:
                entry.doomed = True
                del self._entries[key]
                self._doomed.setdefault(key, []).append(entry)
            else:
                self._free_locked(key, entry)
            return True

    def keys(self) -> Iterator[BlockKey]:
        with self._lock:
            return iter([k for k, e in self._entries.items() if e.published])

    # -- pins and zero-copy views -------------------------------------------------
    @contextmanager
    def borrow(self, key: BlockKey):
        """Yield a read-only view of a block's bytes, pinned for the ``with`` body; None if absent.

        The view is valid only inside the ``with``: the memory may be reused after.
        """
        with self._lock:
            entry = self._live(key)
            if entry is not None:
                entry.pins += 1
                self._policy.on_access(key)
            pool = self._pool
        if entry is None:
            yield None
            return
        try:
            view = self._view(entry, pool)
            view.flags.writeable = False
            yield view
        finally:
            self._unpin_entry(key, entry)

    @contextmanager
    def borrow_many(self, keys, nbytes: int | None = None):
        """:meth:`borrow` of the leading run of ``keys`` this tier holds (each of ``nbytes``
        if given), pinned and released under one lock acquisition each: yields their
        read-only views, as many as the run is long (maybe none).

        For loaders that copy many blocks out at once: per-block borrows cost a lock
        round trip and a generator each, a noticeable share of a 256 KiB copy.
        """
        pool, entries = self._pin_leading(keys, nbytes)
        try:
            views = []
            for entry in entries:
                view = self._view(entry, pool)
                view.flags.writeable = False
                views.append(view)
            yield views
        finally:
            self._unpin_all(entries)

    @contextmanager
    def borrow_runs(self, keys, nbytes: int):
        """:meth:`borrow_many` of blocks of ``nbytes`` each, yielding one read-only view per run
        of them adjacent in the pool (block k+1 starts where block k ends), in key order: the
        views' ``nbytes // nbytes`` add up to the leading run's length (maybe no view).

        For loaders that copy a run with one call: a view per block, and telling adjacent
        ones apart from their addresses, cost a few microseconds a block in Python, a
        noticeable share of copying 256 KiB at memory speed.
        """
        pool, entries = self._pin_leading(keys, nbytes)
        try:
            runs = []
            start = end = -1
            for entry in entries:
                if entry.offset != end:
                    if end >= 0:
                        runs.append(pool[start:end])
                    start = entry.offset
                end = entry.offset + nbytes
            if end >= 0:
                runs.append(pool[start:end])
            for view in runs:
                view.flags.writeable = False
            yield runs
        finally:
            self._unpin_all(entries)

    def _pin_leading(self, keys, nbytes: int | None) -> tuple[np.ndarray, list[_Entry]]:
        """Pin the leading run of ``keys`` this tier holds (each of ``nbytes`` if given), counted as
        read; the pool to view them in (taken with the pins: see :meth:`_view`)."""
        entries: list[_Entry] = []
        with self._lock:
            for key in keys:
                entry = self._live(key)
                if entry is None or (nbytes is not None and entry.nbytes != nbytes):
                    break
                entry.pins += 1
                self._policy.on_access(key)
                entries.append(entry)
            # Loaders read through this instead of get(): count what they take, or the
            # tier's hit rate (metrics, kvtier top, the planner) reads 0 for every load.
            # The key the run stopped at is not counted as a miss: the loader asks the
            # store for it next, and that get counts it.
            self.stats.hits += len(entries)
            self.stats.bytes_read += sum(entry.nbytes for entry in entries)
            return self._pool, entries

    def _unpin_all(self, entries: list[_Entry]) -> None:
        if entries:
            with self._lock:
                for entry in entries:
                    self._unpin_locked(entry.key, entry)

    def pin(self, key: BlockKey) -> bool:
        """Pin a block until :meth:`unpin`; False if absent."""
        with self._lock:
            entry = self._live(key)
            if entry is None:
                return False
            entry.pins += 1
            entry.key_pins += 1
            return True

    def unpin(self, key: BlockKey) -> None:
        """Release one :meth:`pin` of ``key``: of the live copy if it has one, else of a
        copy deleted while pinned (oldest first). Never a ``hold`` or ``borrow``: those
        release through their own handle, so another caller's unpin cannot free a
        block a reader still holds."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.key_pins <= 0:
                entry = next((e for e in self._doomed.get(key, ()) if e.key_pins > 0), None)
            if entry is None:
                raise ValueError("unpin of a block that is not pinned")
            entry.key_pins -= 1
        self._unpin_entry(key, entry)

    def meta_of(self, key: BlockKey) -> BlockMeta | None:
        with self._lock:
            entry = self._live(key)
            return entry.meta if entry else None

    def created_of(self, key: BlockKey) -> float | None:
        """When a held block was first written into the store (wall clock); None if not held.
        Expired blocks not yet freed answer too (an ``on_evict`` hook asks about its victim,
        also while :meth:`expire` hands it over outside the lock): the oldest copy's age."""
        with self._lock:
            entry = self._entries.get(key)
            copies = [entry] if entry is not None and entry.published else []
            copies += self._leaving.get(key, ())
            if not copies:
                return None
            return time.time() - (time.monotonic() - min(e.created for e in copies))

    def parent_of(self, key: BlockKey) -> BlockKey | None:
        """The parent named when a held block was published (None: none was, or not held). Expired
        blocks not yet freed answer too, as for :meth:`created_of`: an ``on_evict`` hook demoting a
        victim whose write-behind mark is gone (the backlog's bound dropped it) still links it below."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.published:
                return entry.parent
            leaving = self._leaving.get(key)
            return leaving[0].parent if leaving else None

    def admits(self, created: float | None) -> bool:
        """False for a block already past ``ttl_s`` (a put of it stores nothing; see :meth:`reserve`)."""
        return self._ttl_s is None or created is None or time.time() - created <= self._ttl_s

    def expire(self) -> int:
        """Free every expired block now (through ``on_evict``, as a look-up would); returns how
        many. Pinned ones stay until their last unpin and a later look. Cheap when nothing is
        due: the blocks are queued by age.

        With a hook, the due blocks become misses under one hold of the lock, and are handed to it
        after, outside the lock, each freed once its hook returns: a store's hook demotes a dirty
        block with a put into the tier below (a file write, a network call), and a sweep of a
        backlog under the lock stalled every DRAM read and write for all of them (seconds). A
        delete of such a key waits for its hand-over (see :meth:`delete`)."""
        if self._ages is None:
            return 0
        with self._lock:
            due, pinned = [], []
            for key, entry in self._ages.due(time.monotonic() - self._ttl_s):
                if self._entries.get(key) is not entry:
                    continue  # gone already (evicted, deleted, expired at a look-up)
                (pinned if entry.pins else due).append(entry)
            for entry in pinned:
                self._ages.push(entry.created, entry.key, entry, held=len(self._entries))
            hook, pool = self.on_evict, self._pool
            if hook is None:  # nothing to hand over: freed at once
                for entry in due:
                    self._evict_locked(entry)
                return len(due)
            for entry in due:
                self._leave_locked(entry)
        done = 0
        try:
            for entry in due:
                try:
                    hook(entry.key, memoryview(self._view(entry, pool)).toreadonly(), entry.meta)
                except Exception:  # noqa: BLE001 - a failed demotion only loses a cached block
                    with self._lock:
                        self.stats.errors += 1
                finally:
                    done += 1
                    self._settle_leaving(entry)
        finally:
            for entry in due[done:]:  # (interrupted: free the rest, or their deletes would wait for good)
                self._settle_leaving(entry)
        return len(due)

    def _leave_locked(self, entry: _Entry) -> None:
        """An expired block leaves: a miss from now on (a put may store the key anew), its memory
        pinned and doomed (freed by :meth:`_settle_leaving`), counted as expired."""
        key = entry.key
        self._policy.on_remove(key)
        self.stats.expirations += 1
        del self._entries[key]
        entry.pins += 1
        entry.doomed = True
        self._doomed.setdefault(key, []).append(entry)
        self._leaving.setdefault(key, []).append(entry)

    def _settle_leaving(self, entry: _Entry) -> None:
        """The hand-over of an entry :meth:`_leave_locked` took is done: free it (at its last
        unpin) and let a delete of its key go on."""
        with self._lock:
            leaving = self._leaving[entry.key]
            leaving.remove(entry)
            if not leaving:
                del self._leaving[entry.key]
            self._unpin_locked(entry.key, entry)
            self._left.notify_all()

    # -- internals ---------------------------------------------------------------
    def _view(self, entry: _Entry, pool: np.ndarray) -> np.ndarray:
        """A block's bytes in ``pool``, which the caller took under the lock with the block's pin
        (or holds the lock): ``close()`` drops the tier's pool, but a view keeps the mapping alive."""
        return pool[entry.offset : entry.offset + entry.nbytes]

    def _live(self, key: BlockKey) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None or not entry.published:
            return None
        if not entry.pins and self._expired(entry):
            self._evict_locked(entry)  # through on_evict: a block not copied down yet may go on
            return None
        return entry

    def _expired(self, entry: _Entry) -> bool:
        return self._ttl_s is not None and time.monotonic() - entry.created > self._ttl_s

    def _aged_entries(self) -> Iterator[tuple[float, BlockKey, _Entry]]:
        """The published blocks, for rebuilding the age queue."""
        return ((e.created, k, e) for k, e in self._entries.items() if e.published)

    def _unpin_entry(self, key: BlockKey, entry: _Entry) -> None:
        with self._lock:
            self._unpin_locked(key, entry)

    def _unpin_locked(self, key: BlockKey, entry: _Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and entry.doomed:
            self._release_locked(entry)
            doomed = self._doomed.get(key)
            if doomed is not None and entry in doomed:
                doomed.remove(entry)
                if not doomed:
                    del self._doomed[key]

    def _free_locked(self, key: BlockKey, entry: _Entry) -> Run:
        del self._entries[key]
        return self._release_locked(entry)

    def _release_locked(self, entry: _Entry) -> Run:
        self._used -= entry.nbytes
        self._footprint -= entry.footprint
        return self._alloc.free(entry.offset, entry.home)

    def _evict_locked(self, entry: _Entry, *, keep_memory: bool = False) -> Run | None:
        """Evict (or expire) an unpinned published block; returns the run that holds the freed
        memory (None with ``keep_memory``: the caller hands it over)."""
        # The demotion hook runs under the lock, so that a block is never both
        # absent from this tier and not yet in the next one. An expired block goes through it
        # too: the hook skips blocks already copied down and passes the block's age on
        # (created_of), so that the tier below stores it only if its own TTL admits it.
        if self.on_evict is not None:
            try:
                self.on_evict(entry.key, memoryview(self._view(entry, self._pool)).toreadonly(), entry.meta)
            except Exception:  # noqa: BLE001 - a failed demotion only loses a cached block
                self.stats.errors += 1
        self._policy.on_remove(entry.key)
        if self._expired(entry):
            self.stats.expirations += 1
        else:
            self.stats.evictions += 1
        if keep_memory:
            del self._entries[entry.key]
            self._used -= entry.nbytes
            self._footprint -= entry.footprint
            return None
        return self._free_locked(entry.key, entry)

    def _evict_for_locked(self, nbytes: int, tag: _Entry,
                          first: Sequence[BlockKey] = ()) -> tuple[int, Run | Slab] | None:
        """Evict the blocks named in ``first`` (those held, published and unpinned), then in the
        policy's order, until a block of ``nbytes`` fits; None if it cannot."""
        for key in first:
            entry = self._entries.get(key)
            if entry is not None and entry.published and not entry.pins:
                got, _ = self._evict_to_place_locked(entry, nbytes, tag)
                if got is not None:
                    return got
        need = 0  # bytes the block needs, once a victim's memory does not fit as is
        evicted = 0
        for key in self._policy.victims():
            entry = self._entries[key]
            if entry.pins:
                self._policy.on_access(key)
                continue
            got, hole = self._evict_to_place_locked(entry, nbytes, tag)
            if got is not None:
                return got
            evicted += entry.footprint
            need = need or self._alloc.granules_for(nbytes) * self._alloc.granule
            # The victims have paid for the block, but their memory is not usable as
            # it is (holes too short, chunks of another class): evict the cheapest
            # stretch of unpinned neighbours around the last hole too.
            if evicted >= need:
                got = self._rebalance_locked(hole, nbytes, tag)
                if got is not None:
                    return got
        return None

    def _evict_to_place_locked(self, entry: _Entry, nbytes: int, tag: _Entry):
        """Evict ``entry``, then place the block of ``nbytes`` (``tag``): (its place or None, and
        the run the eviction freed, None where the block took it over)."""
        # Uniform blocks: the victim's memory is the new block's as it is. (Equal
        # footprints mean equal runs or chunks of one class: runs are whole pages,
        # chunks at most half a page.)
        if entry.footprint == tag.footprint:
            self._evict_locked(entry, keep_memory=True)
            return self._alloc.hand_over(entry.offset, entry.home, tag), None
        hole = self._evict_locked(entry)
        assert hole is not None
        return self._alloc.alloc(nbytes, tag), hole

    def _rebalance_locked(self, hole: Run, nbytes: int, tag: _Entry) -> tuple[int, Run | Slab] | None:
        window = self._alloc.window(hole, self._alloc.granules_for(nbytes), self._pinned)
        if window is None:
            return None
        for run in window:
            if run.slab is not None:
                for entry in list(run.slab.tags.values()):
                    self._evict_locked(entry)  # type: ignore[arg-type]
            elif run.tag is not None:
                self._evict_locked(run.tag)  # type: ignore[arg-type]
        got = self._alloc.alloc(nbytes, tag)
        assert got is not None, "a cleared window did not make room"
        return got

    @staticmethod
    def _pinned(run: Run) -> bool:
        """Whether a run holds memory that cannot be evicted now (pinned, being written, doomed)."""
        if run.slab is not None:
            return any(e.pins or not e.published for e in run.slab.tags.values())  # type: ignore[attr-defined]
        entry = run.tag
        return entry is not None and (entry.pins or not entry.published)  # type: ignore[attr-defined]

    def check_integrity(self) -> None:
        with self._lock:
            live = list(self._entries.values())
            doomed = [e for group in self._doomed.values() for e in group]
            rivals = [e for group in self._rivals.values() for e in group]
            assert all(e.doomed and e.pins > 0 for e in doomed), "a doomed entry outlived its pins"
            assert all(e in self._doomed.get(k, ()) for k, group in self._leaving.items() for e in group), (
                "a block being handed over by expire() is not held doomed")
            assert all(e.pins > 0 and not e.published for e in rivals), "a rival reservation is not being written"
            assert all(e.pins >= 0 for e in live), "negative pin count"
            assert all(0 <= e.key_pins <= e.pins for e in live + doomed), "more key pins than pins"
            holders = live + doomed + rivals
            per_class = self._alloc.check()
            runs = self._alloc.runs()
            owned = [r.tag for r in runs if r.tag is not None]
            chunked = [t for r in runs if r.slab is not None for t in r.slab.tags.values()]
            assert len(owned) + len(chunked) == len(holders), (
                f"{len(owned)} runs and {len(chunked)} chunks in use but "
                f"{len(live)} entries and {len(doomed)} doomed"
            )
            assert {id(e) for e in owned + chunked} == {id(e) for e in holders}, "memory held by no entry"
            for e in holders:
                if isinstance(e.home, Slab):
                    assert e.home.tags.get(e.offset) is e, "an entry's chunk belongs to another"
                    assert e.footprint == e.home.chunk
                else:
                    assert e.home.tag is e and e.offset == e.home.start * self._alloc.granule
                    assert e.footprint == e.home.length * self._alloc.granule
                assert e.nbytes <= e.footprint
            assert sum(per_class.values()) == len(chunked), "per-class chunk counts disagree"
            assert self._used == sum(e.nbytes for e in holders), f"used_bytes {self._used} != payload held"
            assert self._footprint == sum(e.footprint for e in holders), "footprint_bytes is off"
            assert self._footprint + self._alloc.free_bytes + self._slack() == self._capacity, (
                "free + used != total"
            )
            published = sum(1 for e in live if e.published)
            assert len(self._policy) == published, (
                f"policy tracks {len(self._policy)} keys but {published} blocks are published"
            )

    def _slack(self) -> int:
        """Pool bytes in slabs not held by a block (free chunks, each slab's tail)."""
        g = self._alloc.granule
        return sum(r.length * g - len(r.slab.tags) * r.slab.chunk for r in self._alloc.runs() if r.slab)

    def close(self) -> None:
        """Forget every block; later gets miss and puts raise. A reader that pinned a block before
        copies it still (the mapping lives until its last view goes)."""
        with self._lock:
            self._entries.clear()
            self._rivals.clear()
            if self._ages is not None:
                self._ages.clear()
            self._pool = None  # type: ignore[assignment]
            try:
                self._mmap.close()
            except BufferError:
                pass  # a borrowed view is still alive; the mapping goes with it


def _as_bytes(buf, *, writable: bool = False) -> np.ndarray:
    """A flat uint8 view of any C-contiguous buffer (numpy array, bytes, memoryview)."""
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("buffers must be C-contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError("the output buffer is read-only")
    return arr.reshape(-1).view(np.uint8)

