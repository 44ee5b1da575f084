"""The contract every tier keeps: host pool, disk directory, remote server, null.

Semantics shared by all tiers (the contract suite in tests/tiers checks them):

* Keys are content addresses (:mod:`kvtier.core.keys`): one key always names the
  same bytes, so ``put`` of a key already present is a successful no-op and
  never overwrites a block another thread may be reading.
* ``get`` copies into a caller-owned buffer whose size must equal the stored
  block's; a missing, expired, torn, tampered or foreign block returns
  :attr:`Status.MISS` or :attr:`Status.CORRUPT` -- never an exception, never
  partial data. Callers treat every non-OK status as a miss.
* Batch forms return one status per key, in order; one key's failure does not
  stop the others.
* When a tier needs room it asks its eviction policy for victims, skips pinned
  blocks, calls :attr:`Tier.on_evict` with each victim's bytes *before* freeing
  it (so a store can demote it), then frees it.
* Retention: a block's age counts from its first write into a store (``created``,
  wall-clock seconds, so that a disk tier keeps it across restarts in its files'
  mtimes). Tiers that keep ages (:attr:`Tier.keeps_age`: host, disk, and wrappers of
  them) take it on ``put`` / ``put_many`` and report it (:meth:`Tier.created_of`),
  so that a block promoted, copied down or demoted keeps its age. A tier with a
  ``ttl_s`` serves a block only while its age is under it, and refuses one that
  arrives older (OK, nothing stored, counted in ``expirations``); :meth:`Tier.admits`
  says so beforehand, so that a caller that counts, marks or seals what it puts
  (promotions, an encrypting wrapper) skips such a put. Tiers that keep
  their own retention (remote, Mooncake) are given no age (:func:`age_kw`).
* All methods are thread safe.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import itertools
import math
import numbers
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import NamedTuple

from kvtier.core.keys import BlockKey
from kvtier.core.payload import BlockMeta
from kvtier.errors import ConfigError


class Status(enum.IntEnum):
    OK = 0
    MISS = 1  #: absent, expired or not visible to the caller
    CORRUPT = 2  #: present but failed verification: served as a miss, counted
    FULL = 3  #: no room: everything evictable is pinned, or the medium is full
    ERROR = 4  #: the tier failed (I/O error, timeout, connection lost)
    TOO_LARGE = 5  #: the block does not fit this tier's slots
    BAD_SIZE = 6  #: the caller's buffer size differs from the stored block's

    @property
    def ok(self) -> bool:
        return self is Status.OK


@dataclass(slots=True)
class TierStats:
    """Counters of one tier; mutate only under the tier's lock."""

    hits: int = 0
    misses: int = 0
    verify_failures: int = 0
    puts: int = 0
    put_failures: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    expirations: int = 0
    deletes: int = 0
    errors: int = 0

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


#: ``on_evict(key, data, meta)``: called with a read-only view of a victim's bytes
#: before it is freed (the host tier hands over an expiring block too, so that a block not yet
#: copied down reaches the tier below if that tier's TTL admits it). It must not call back into
#: the same tier, except :meth:`Tier.created_of` for the victim (still answered during the call).
#: Evictions call it under the tier's lock; the host tier's ``expire()`` calls it outside (a delete of
#: the key waits for it to return).
EvictHook = Callable[[BlockKey, memoryview, BlockMeta | None], None]


class Tier(ABC):
    """A key → block store with bounded capacity. See the module docstring."""

    name: str = "tier"
    #: a read either ends or fails within a bound known before it starts: a memcpy, or a
    #: network call with its deadline. An engine may then wait for a small read inside a
    #: step (the vLLM connector's ``sync_load_max_bytes``); a disk read has no such bound.
    bounded_reads: bool = False
    #: False while the tier backs off after a failure (a server or fleet not answering): its
    #: misses and ``False`` lookups then say nothing about what it holds
    available: bool = True
    #: the tier keeps each block's age: its puts take ``created`` and :meth:`created_of` answers.
    #: Others (remote, Mooncake) keep their own retention and are given no age (:func:`age_kw`).
    keeps_age: bool = False

    def __init__(self) -> None:
        self.stats = TierStats()
        self.on_evict: EvictHook | None = None
        self._lock = threading.RLock()

    # -- single-key operations -------------------------------------------------
    @abstractmethod
    def contains(self, key: BlockKey) -> bool:
        """True if ``get(key, …)`` would probably succeed (verification may still fail)."""

    @abstractmethod
    def get(self, key: BlockKey, out) -> Status:
        """Copy the block into ``out`` (a writable buffer of exactly its size)."""

    @abstractmethod
    def put(
        self, key: BlockKey, data, *, parent: BlockKey | None = None, meta: BlockMeta | None = None
    ) -> Status:
        """Store a copy of ``data`` (any C-contiguous buffer); the caller keeps ownership.

        A tier that keeps ages also takes ``created: float | None`` (see the module docstring:
        when the block was first written into the store, wall clock; None: now)."""

    @abstractmethod
    def delete(self, key: BlockKey) -> bool:
        """Remove a block; True if it was present. A pinned block is removed when unpinned.
        False too where the medium refused the removal: such a block is never served again by
        this tier, and the refusal is reported to a caller collecting :func:`refused_removals`."""

    @abstractmethod
    def keys(self) -> Iterator[BlockKey]:
        """Every key held (a snapshot; for listing and erasure, not for hot paths)."""

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    def created_of(self, key: BlockKey) -> float | None:
        """When a held block was first written into the store (wall-clock seconds), as this tier
        keeps it; None if the tier does not hold it or keeps no ages (:attr:`keeps_age`)."""
        return None

    def admits(self, created: float | None) -> bool:
        """Whether a put of a block first written into the store at ``created`` (wall clock; None:
        now) would store it: False where it is already past this tier's TTL (such a put answers
        OK and stores nothing). Cheap (no I/O, no lock): a promotion or an encrypting wrapper asks
        before it reads, seals or counts anything. Here: True (no TTL of its own)."""
        return True

    def expire(self) -> int:
        """Remove the blocks past this tier's TTL now (they are misses already); how many.
        Here: none (no TTL, or a tier that keeps its own retention)."""
        return 0

    def check_integrity(self) -> None:
        """Raise AssertionError if internal accounting is inconsistent."""

    def close(self) -> None:
        """Release resources; the tier must not be used afterwards."""

    # -- batch forms (tiers override them when they can do better) -----------
    def lookup_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` this tier holds (a block counts only with all its ancestors)."""
        n = 0
        for key in keys:
            if not self.contains(key):
                break
            n += 1
        return n

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence) -> list[Status]:
        if len(keys) != len(outs):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} buffers")
        return [self.get(k, o) for k, o in zip(keys, outs)]

    def get_many_as_ready(self, keys: Sequence[BlockKey], outs: Sequence,
                          ready: Callable[[list[int], list], None]) -> list[Status]:
        """:meth:`get_many`, calling ``ready(indices, payloads)`` with verified blocks before it
        returns, possibly several times and from other threads, each served block once:
        ``payloads[m]`` holds block ``indices[m]``'s bytes during the call (its ``outs`` buffer, or
        the tier's own staging: ``outs`` may then not hold it). A caller can use a block (copy it
        on, say) while later ones are still read. Here: once, at the end, from ``outs``; a tier
        that verifies blocks as they land overrides it."""
        statuses = self.get_many(keys, outs)
        done = [i for i, status in enumerate(statuses) if status is Status.OK]
        if done:
            ready(done, [outs[i] for i in done])
        return statuses

    def put_many(
        self,
        keys: Sequence[BlockKey],
        datas: Sequence,
        *,
        parents: Sequence[BlockKey | None] | None = None,
        metas: Sequence[BlockMeta | None] | None = None,
        created: Sequence[float | None] | None = None,
    ) -> list[Status]:
        """Put several blocks. Without ``parents``, ``keys`` are taken as one chain. ``created``
        (one ``float | None`` per key) only for a tier that keeps ages: passed on to ``put``."""
        check_batch_lengths("put_many", keys, datas, parents, metas, created)
        if parents is None:
            parents = [None, *keys[:-1]]
        metas = metas or [None] * len(keys)
        if created is None:  # (a tier that keeps no ages takes no such argument)
            return [self.put(k, d, parent=p, meta=m) for k, d, p, m in zip(keys, datas, parents, metas)]
        return [self.put(k, d, parent=p, meta=m, created=c)
                for k, d, p, m, c in zip(keys, datas, parents, metas, created)]

    def delete_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [self.delete(k) for k in keys]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} used={self.used_bytes}/{self.capacity_bytes}>"


def check_batch_lengths(op: str, keys: Sequence, datas: Sequence, parents: Sequence | None,
                        metas: Sequence | None, created: Sequence | None = None) -> None:
    """Raise ValueError unless ``datas`` (and ``parents``, ``metas``, ``created`` where given) have
    one item per key: zipped, a shorter list would store only the first blocks and report fewer
    statuses."""
    parts = [("buffers", datas), ("parents", parents), ("metas", metas), ("creation times", created)]
    wrong = [f"{len(seq)} {what}" for what, seq in parts if seq is not None and len(seq) != len(keys)]
    if wrong:
        raise ValueError(f"{op}: {len(keys)} keys but {', '.join(wrong)}; give one per key")


def check_ttl(ttl_s) -> float | None:
    """A tier's ``ttl_s``: a positive, finite number of seconds, or None (no expiry); else
    ConfigError. (0 or less expired every block at once, NaN none ever.)"""
    if ttl_s is None:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, numbers.Real) or not (math.isfinite(ttl_s) and ttl_s > 0):
        raise ConfigError(f"ttl_s must be a positive number of seconds or None (no expiry), got {ttl_s!r}")
    return float(ttl_s)


def age_kw(tier: Tier, created) -> dict:
    """``{"created": created}`` for a tier that keeps ages (:attr:`Tier.keeps_age`), else ``{}``:
    what a caller passes on to its ``put`` (``created`` a float) or ``put_many`` (one float or None
    per key). Tiers that keep their own retention (remote, Mooncake) take no such argument."""
    if created is None or not tier.keeps_age:
        return {}
    if not isinstance(created, (int, float)) and all(c is None for c in created):
        return {}
    return {"created": created}


class AgeQueue:
    """Blocks ordered by creation (oldest first), so that a TTL sweep takes only the expired ones
    instead of scanning every block. A block's item is not removed when the block goes: the tier
    checks each item :meth:`due` hands back against its index (an item whose block left, or was
    stored anew, is dropped), and :meth:`push` rebuilds the queue from ``live()`` once stale items
    outnumber live ones (amortised: one rebuild per that many pushes). Not thread safe: the
    tier's lock guards it."""

    def __init__(self, live: Callable[[], Iterator[tuple[float, BlockKey, object]]]) -> None:
        self._heap: list[tuple[float, int, BlockKey, object]] = []
        self._tick = itertools.count()  # ties: never compare keys or tokens
        self._live = live

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, created: float, key: BlockKey, token: object, *, held: int) -> None:
        """Queue a block the tier holds (``held``: how many it holds now)."""
        heapq.heappush(self._heap, (created, next(self._tick), key, token))
        if len(self._heap) > 2 * held + 64:
            self._heap = [(c, next(self._tick), k, t) for c, k, t in self._live()]
            heapq.heapify(self._heap)

    def due(self, cutoff: float) -> list[tuple[BlockKey, object]]:
        """Take the items created before ``cutoff`` (oldest first)."""
        out = []
        while self._heap and self._heap[0][0] < cutoff:
            _, _, key, token = heapq.heappop(self._heap)
            out.append((key, token))
        return out

    def clear(self) -> None:
        self._heap = []


def buffer_nbytes(buf) -> int:
    return memoryview(buf).nbytes


def writable_bytes(out) -> memoryview:
    """The caller's output buffer as bytes; a read-only one is the caller's mistake, found before any I/O."""
    view = memoryview(out).cast("B")
    if view.readonly:
        raise ValueError("the output buffer is read-only; pass a writable buffer (e.g. numpy.empty)")
    return view


def runs_by_bytes(items: Sequence, sizes: Sequence[int], limit: int) -> Iterator[list]:
    """Split ``items`` into consecutive runs whose ``sizes`` add up to at most ``limit`` (an item
    larger than ``limit`` is a run of its own): how batches are cut into bounded engine calls or
    staging groups."""
    run: list = []
    total = 0
    for item, size in zip(items, sizes):
        if run and total + size > limit:
            yield run
            run, total = [], 0
        run.append(item)
        total += size
    if run:
        yield run


class RefusedRemoval(NamedTuple):
    """A delete a tier could not carry out: the block is no longer served by that tier
    (withheld), but its bytes are still on the medium."""

    key: bytes  #: the key the tier was asked to delete (an encrypting wrapper's storage name)
    path: str  #: what could not be removed
    error: OSError


_REFUSED: ContextVar[list[RefusedRemoval] | None] = ContextVar("kvtier_refused_removals", default=None)


@contextlib.contextmanager
def refused_removals() -> Iterator[list[RefusedRemoval]]:
    """Collect every delete a tier could not carry out while the block runs, on this thread
    (a wrapper's ``delete`` reaches the disk tier's on the same thread). Outside such a block a
    refused delete only returns False (and is logged and counted): callers that delete on a read
    path (a block failing its check) or a flusher must not get an exception. The caller that must
    not report an erasure it could not do (:meth:`kvtier.store.tiered.TieredStore.delete`) looks
    at the list afterwards."""
    with collecting(_REFUSED) as found:
        yield found


#: the caller's collection of lookups no medium answered (see unanswered_lookups), on this thread
_UNANSWERED: ContextVar[list[int] | None] = ContextVar("kvtier_unanswered_lookups", default=None)


@contextlib.contextmanager
def unanswered_lookups() -> Iterator[list[int]]:
    """Collect, on this thread while the block runs, the size of each tier lookup (``contains``,
    ``contains_many``, ``lookup_prefix``, and a wrapping tier's lookups that reach them) whose
    False/0 is not a medium's answer: a fleet lookup never sent (the tier down, backing off,
    closed), failed or overran, or answered by a master that said it could not (its codes); an
    encrypting tier's lookup whose names its keyring could not compute, so that nothing was asked.
    Such a lookup's "not stored" says nothing. Empty: every lookup made was answered. (A Mooncake
    tier's ``available`` read after the lookup does not tell: the health check the lookup itself
    started may end the outage in between, and misses never asked were taken for the fleet's word:
    audit s34 r6 D1; an encrypting tier stays available while one owner's key store fails: r10 D2.)"""
    with collecting(_UNANSWERED) as found:
        yield found


def report_unanswered(count: int) -> None:
    """Tell the caller collecting :func:`unanswered_lookups`, if any, that a lookup of ``count``
    keys was not answered (its False/0 says nothing)."""
    found = _UNANSWERED.get()
    if found is not None:
        found.append(count)


@contextlib.contextmanager
def collecting(var: ContextVar) -> Iterator[list]:
    """A fresh list in ``var`` while the block runs, on this thread, restored after it: what a
    tier's code reached from the block appends there is the caller's (``None`` outside: nobody asks)."""
    found: list = []
    token = var.set(found)
    try:
        yield found
    finally:
        var.reset(token)


def report_refused(key: bytes, path: str, error: OSError) -> None:
    """Tell the caller collecting :func:`refused_removals`, if any."""
    found = _REFUSED.get()
    if found is not None:
        found.append(RefusedRemoval(bytes(key), path, error))
