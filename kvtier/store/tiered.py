"""TieredStore: several tiers, fastest first, behaving as one cache.

* ``lookup`` is longest-prefix across tiers: block *i* counts if some tier holds
  it and blocks ``0..i-1`` counted; different blocks may live in different tiers.
* ``get`` reads each block from the fastest tier that has it; a block that fails
  verification there is tried in the next tier; a block read from a slower tier
  is promoted (copied) into the faster ones.
* ``put`` is write-back by default: blocks go to the fastest tier and are
  demoted, one tier down, when that tier evicts them. Write-through puts into
  every tier.
* The ``*_async`` forms run on a small I/O thread pool so that loads and saves
  overlap the engine's compute; the numpy copies, hashing and file I/O they do
  release the GIL.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.core.keys import BlockKey
from kvtier.core.payload import BlockMeta
from kvtier.tiers.base import Status, Tier


class WriteMode(str, enum.Enum):
    WRITE_BACK = "write-back"
    WRITE_THROUGH = "write-through"


class PrefixMatch(NamedTuple):
    """Result of a longest-prefix lookup: ``tiers[i]`` is the name of the tier holding block i."""

    hit_blocks: int
    tiers: list[str]


class GetResult(NamedTuple):
    """Per-key outcome of a get. ``loaded`` is the length of the leading run of OK keys:
    only that prefix is usable by an engine."""

    statuses: list[Status]
    tiers: list[str | None]
    loaded: int


@dataclass(slots=True)
class StoreStats:
    lookups: int = 0
    lookup_blocks: int = 0
    lookup_hit_blocks: int = 0
    get_blocks: int = 0
    get_hit_blocks: int = 0
    promotions: int = 0
    demotions: int = 0
    demotion_failures: int = 0
    puts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class TieredStore:
    """The block manager. Owns its tiers (``close`` closes them)."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        write_mode: WriteMode | str = WriteMode.WRITE_BACK,
        promote: bool = True,
        io_threads: int = 2,
    ) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}; give each a distinct .name")
        self.tiers = list(tiers)
        self.write_mode = WriteMode(write_mode)
        self.promote = promote
        self._stats = StoreStats()
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvtier-io")
        self._pending: set[Future] = set()
        self._pending_lock = threading.Lock()
        if self.write_mode is WriteMode.WRITE_BACK:
            for upper, lower in zip(self.tiers, self.tiers[1:]):
                upper.on_evict = self._demoter(lower)

    def _demoter(self, lower: Tier):
        def demote(key: BlockKey, data: memoryview, meta: BlockMeta | None) -> None:
            status = lower.put(key, data, meta=meta)
            with self._stats.lock:
                if status is Status.OK:
                    self._stats.demotions += 1
                else:
                    self._stats.demotion_failures += 1

        return demote

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r}; tiers are {[t.name for t in self.tiers]}")

    # -- lookup ------------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey]) -> PrefixMatch:
        keys = list(keys)
        where: list[str] = []
        pos = 0
        while pos < len(keys):
            rest = keys[pos:]
            for tier in self.tiers:
                n = tier.lookup_prefix(rest)
                if n:
                    where.extend([tier.name] * n)
                    pos += n
                    break
            else:
                break
        with self._stats.lock:
            self._stats.lookups += 1
            self._stats.lookup_blocks += len(keys)
            self._stats.lookup_hit_blocks += pos
        return PrefixMatch(pos, where)

    # -- get ---------------------------------------------------------------------
    def get(self, keys: Sequence[BlockKey], outs: Sequence, *, stop_at_miss: bool = True) -> GetResult:
        """Load blocks into caller-owned buffers.

        With ``stop_at_miss`` (the default) loading stops at the first block no
        tier can serve, since later blocks are useless without it.
        """
        if len(keys) != len(outs):
            raise ValueError(f"get: {len(keys)} keys but {len(outs)} buffers")
        statuses: list[Status] = []
        tiers: list[str | None] = []
        for key, out in zip(keys, outs):
            status, source = self._get_one(key, out)
            statuses.append(status)
            tiers.append(source)
            if stop_at_miss and status is not Status.OK:
                break
        statuses.extend([Status.MISS] * (len(keys) - len(statuses)))
        tiers.extend([None] * (len(keys) - len(tiers)))
        loaded = 0
        while loaded < len(statuses) and statuses[loaded] is Status.OK:
            loaded += 1
        with self._stats.lock:
            self._stats.get_blocks += len(keys)
            self._stats.get_hit_blocks += sum(s is Status.OK for s in statuses)
        return GetResult(statuses, tiers, loaded)

    def _get_one(self, key: BlockKey, out) -> tuple[Status, str | None]:
        last = Status.MISS
        for i, tier in enumerate(self.tiers):
            status = tier.get(key, out)
            if status is Status.OK:
                if self.promote and i > 0:
                    self._promote(key, out, self.tiers[:i])
                return status, tier.name
            if status is Status.BAD_SIZE:
                return status, None  # a caller error: the same in every tier
            last = status if last is Status.MISS else last
        return (Status.MISS if last in (Status.MISS, Status.CORRUPT) else last), None

    def _promote(self, key: BlockKey, data, upper: Sequence[Tier]) -> None:
        for tier in upper:
            if tier.put(key, data) is Status.OK:
                with self._stats.lock:
                    self._stats.promotions += 1

    # -- put ---------------------------------------------------------------------
    def put(
        self,
        keys: Sequence[BlockKey],
        blocks: Sequence,
        *,
        parents: Sequence[BlockKey | None] | None = None,
        metas: Sequence[BlockMeta | None] | None = None,
    ) -> list[Status]:
        """Store blocks (a chain unless ``parents`` says otherwise). The caller keeps its buffers.

        Returns per-key status of the fastest tier (write-back) or the best
        status over all tiers (write-through: OK if any tier took the block).
        """
        keys = list(keys)
        if parents is None:
            parents = [None, *keys[:-1]]
        targets = self.tiers if self.write_mode is WriteMode.WRITE_THROUGH else self.tiers[:1]
        best = [Status.ERROR] * len(keys)
        for tier in targets:
            statuses = tier.put_many(keys, blocks, parents=parents, metas=metas)
            best = [b if b is Status.OK else s for b, s in zip(best, statuses)]
        with self._stats.lock:
            self._stats.puts += len(keys)
        return best

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Delete from every tier; returns how many (tier, key) copies were removed."""
        return sum(sum(tier.delete_many(list(keys))) for tier in self.tiers)

    # -- asynchronous forms ---------------------------------------------------------
    def get_async(self, keys: Sequence[BlockKey], outs: Sequence, **kw) -> Future[GetResult]:
        """As :meth:`get`, on the I/O pool. ``outs`` must not be touched until the future is done."""
        return self._track(self._pool.submit(self.get, list(keys), list(outs), **kw))

    def put_async(self, keys: Sequence[BlockKey], blocks: Sequence, **kw) -> Future[list[Status]]:
        """As :meth:`put`, on the I/O pool. ``blocks`` must stay unchanged until the future is done."""
        return self._track(self._pool.submit(self.put, list(keys), list(blocks), **kw))

    def _track(self, future: Future) -> Future:
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._untrack)
        return future

    def _untrack(self, future: Future) -> None:
        with self._pending_lock:
            self._pending.discard(future)

    def flush(self) -> None:
        """Wait for every asynchronous operation submitted so far."""
        with self._pending_lock:
            pending = list(self._pending)
        for future in pending:
            future.exception()  # waits; errors stay with the caller's future

    # -- introspection ------------------------------------------------------------
    def stats(self) -> dict:
        with self._stats.lock:
            store = {k: getattr(self._stats, k) for k in StoreStats.__slots__ if k != "lock"}
        per_tier = {}
        for t in self.tiers:
            per_tier[t.name] = {**t.stats.snapshot(), "used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes}
        return {"store": store, "tiers": per_tier}

    def check_integrity(self) -> None:
        for t in self.tiers:
            t.check_integrity()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for t in self.tiers:
            t.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
