"""The host tier's blocks as vLLM KV events of ``medium="CPU"``, so that a router sees them.

vLLM's scheduler publishes its GPU pool's events and, beside them, whatever the connector's
``take_events()`` returns. A router that prices each worker's host DRAM (``kvtier route``,
Dynamo's) credits a block there only on a ``BlockStored`` of medium ``"CPU"`` and drops it on
a ``BlockRemoved`` of that medium. Without them, once vLLM evicts a page the router believes
the worker lost the block, though its kvtier host tier still serves it at DRAM speed.

* **Worker** (:class:`HostResidency`, in the process that holds the store): the blocks of a
  save are marked before the put; once it is done, each block the host tier then holds is
  reported held, every other one not held. The host tier's eviction hook (``on_evict``: its
  evictions and expiries, after the hook it had, write-behind's demotion) reports a held
  block gone. A block is named by vLLM's hash of its last hash-block (the same on every
  tensor and pipeline rank) and its key epoch; reports go to the scheduler with each step's
  :class:`~kvtier.integrations.vllm.metadata.KvtierWorkerMetadata`, one bit per rank.
* **Scheduler** (:class:`HostEvents`): a save is described when it is planned, while its
  request is known (vLLM's page hashes, the tokens, LoRA, extra keys). A block becomes a
  ``BlockStored`` once every rank reports it held (a load needs every rank's shard), and a
  ``BlockRemoved`` as soon as one rank reports it gone. A reset (a new key epoch: what the
  host tier holds is unreachable) removes every block announced; reports of an older epoch
  are ignored.

Errors lean to a missing credit, never a stale one: a stale credit sends requests to a worker
that then recomputes (or reads the shared tier) while another had the context; a missing one
only under-predicts a hit. So: a block reported held is checked in the host tier after its
put, an eviction racing the report wins, and every map is bounded by dropping what lets the
router under-predict — a description (no credit), a held block over the host tier's count of
blocks (reported gone). Not seen: blocks promoted into the host tier by loads from lower tiers
(missing credits) and blocks removed by ``TieredStore.delete``, which the connector never calls.

Thread safety: :class:`HostResidency` is called from the worker's thread, the store's I/O
threads (a put done) and, under the host tier's lock, its eviction hook; it takes only its own
lock, and never while calling the tier. :class:`HostEvents` runs on vLLM's scheduler thread.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvtier.core.keys import BlockKey
from kvtier.tiers.base import Status, Tier
from kvtier.tiers.host import HostTier

#: a step's report: (key epoch, block id) → (bits of the ranks that hold it now, of those that do not)
HostReport = dict[tuple[str, bytes], tuple[int, int]]

#: at most this many page hashes in one ``BlockRemoved`` (a reset removes every block at once)
REMOVED_CHUNK = 8192


def merge_reports(a: HostReport, b: HostReport) -> HostReport:
    """Two workers' reports of one step as one (each rank sets its own bit). Neither is changed."""
    if not b:
        return a
    if not a:
        return b
    out = dict(a)
    for block, (held, gone) in b.items():
        was_held, was_gone = out.get(block, (0, 0))
        out[block] = (was_held | held, was_gone | gone)
    return out


def host_tier(tiers: Sequence[Tier]) -> Tier | None:
    """The store's first tier if it is a host (DRAM) tier, as the store sees it (sealed
    included); None for a store whose fastest tier is a disk, a server or Mooncake."""
    first = tiers[0] if tiers else None
    inner = first
    while inner is not None and not isinstance(inner, HostTier):
        inner = getattr(inner, "inner", None)
    return first if inner is not None else None


class _EvictionListeners:
    """A tier's ``on_evict``: the hook it had (write-behind's demotion), then each listener with
    the victim's key (even when that hook raised: the block leaves the tier either way)."""

    def __init__(self, previous) -> None:
        self.previous = previous
        self.listeners: tuple[Callable[[BlockKey], None], ...] = ()

    def __call__(self, key: BlockKey, data, meta) -> None:
        try:
            if self.previous is not None:
                self.previous(key, data, meta)
        finally:
            for listener in self.listeners:
                listener(key)


def watch_evictions(tier: Tier, listener: Callable[[BlockKey], None]) -> None:
    """Call ``listener(key)`` for each block ``tier`` evicts or expires, after its own hook."""
    hook = tier.on_evict
    if not isinstance(hook, _EvictionListeners):
        hook = _EvictionListeners(hook)
        tier.on_evict = hook
    hook.listeners += (listener,)


def unwatch_evictions(tier: Tier, listener: Callable[[BlockKey], None]) -> None:
    hook = tier.on_evict
    if isinstance(hook, _EvictionListeners):
        hook.listeners = tuple(x for x in hook.listeners if x != listener)


class HostResidency:
    """Which of this worker's saved blocks its host tier holds, reported to the scheduler side.

    ``rank``: this worker's index among the engine's workers (``pp_rank * tp_size + tp_rank``);
    ``limit_blocks``: how many blocks the host tier can hold at most (more held here means
    removals this did not see: the oldest are then reported gone)."""

    def __init__(self, tier: Tier, rank: int, limit_blocks: int) -> None:
        self.tier = tier
        self.bit = 1 << rank
        self.limit_blocks = max(1, limit_blocks)
        self.forgotten = 0  #: held blocks reported gone over ``limit_blocks``
        self._lock = threading.Lock()
        self._epoch = ""
        #: blocks of saves under way, not held yet: key → (epoch, block id)
        self._saving: dict[BlockKey, tuple[str, bytes]] = {}
        #: blocks reported held and not gone since, oldest first
        self._held: OrderedDict[BlockKey, tuple[str, bytes]] = OrderedDict()
        #: since the last report: (epoch, block id) → held now
        self._report: dict[tuple[str, bytes], bool] = {}
        watch_evictions(tier, self.evicted)

    def saving(self, keys: Sequence[BlockKey], ids: Sequence[bytes], epoch: str) -> None:
        """Blocks about to be put (before the put: an eviction during it must be seen). A new
        ``epoch`` forgets the blocks of the old one: the scheduler removed them at its reset."""
        with self._lock:
            if epoch != self._epoch:
                self._epoch = epoch
                self._saving.clear()
                self._held.clear()
            for key, block_id in zip(keys, ids):
                if key not in self._held:
                    self._saving[key] = (epoch, block_id)

    def saved(self, keys: Sequence[BlockKey], statuses: Sequence[Status] | None) -> None:
        """A put of ``keys`` is done (``statuses`` None: it raised). The host tier is asked after
        it: a write-through put is OK when any tier took a block, and the block may be gone
        already. An eviction between that question and the lock below took it out of
        ``_saving``: never reported held."""
        ok = [key for key, status in zip(keys, statuses or ()) if status is Status.OK]
        here = {key for key, held in zip(ok, self.tier.contains_many(ok)) if held} if ok else set()
        with self._lock:
            for key in keys:
                block = self._saving.pop(key, None)
                if block is None:
                    continue  # evicted meanwhile, held already, or of an older epoch
                if key in here:
                    self._held[key] = block
                    self._report[block] = True
                else:
                    self._report[block] = False
            while len(self._held) > self.limit_blocks:
                _, block = self._held.popitem(last=False)
                self._report[block] = False
                self.forgotten += 1

    def evicted(self, key: BlockKey) -> None:
        """The host tier's eviction hook (under its lock): a held block, or one being saved, is gone."""
        with self._lock:
            block = self._held.pop(key, None) or self._saving.pop(key, None)
            if block is not None:
                self._report[block] = False

    def take(self) -> HostReport:
        """What changed since the last call, as this rank's part of a step's report."""
        with self._lock:
            if not self._report:
                return {}
            report, self._report = self._report, {}
        bit = self.bit
        return {block: (bit, 0) if held else (0, bit) for block, held in report.items()}

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        unwatch_evictions(self.tier, self.evicted)


class HostBlock(NamedTuple):
    """What a ``BlockStored`` of one kvtier block says: vLLM's hashes of its pages, the hash of
    the page before it (None for a request's first block), its tokens, LoRA adapter, vLLM's
    per-page extra keys (as its events publish them) and session."""

    page_hashes: tuple[bytes, ...]
    parent: bytes | None
    token_ids: array
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list | None = None
    session_id: str | None = None


class Removed(NamedTuple):
    """A ``BlockRemoved`` of these page hashes."""

    page_hashes: tuple[bytes, ...]


class HostEvents:
    """The scheduler side's queue of CPU-medium events (see the module docstring).

    ``workers``: the engine's workers (ranks) whose host tiers must all hold a block;
    ``describe(request, index)``: kvtier block ``index`` of ``request`` as a :class:`HostBlock`;
    ``limit_blocks``: the most blocks one host tier holds (announced blocks past it are removed,
    oldest first); ``pending_blocks``: descriptions of saves not reported yet kept at most
    (oldest dropped: a credit lost)."""

    def __init__(self, workers: int, describe: Callable[[object, int], HostBlock], limit_blocks: int,
                 pending_blocks: int = 4096) -> None:
        self.all_ranks = (1 << workers) - 1
        self.describe = describe
        self.limit_blocks = max(1, limit_blocks)
        self.pending_blocks = max(1, pending_blocks, self.limit_blocks)
        self._described: OrderedDict[bytes, HostBlock] = OrderedDict()
        #: ranks holding a block that not every rank holds (tensor or pipeline parallel)
        self._holders: dict[bytes, int] = {}
        #: blocks announced stored: block id → its page hashes, oldest first
        self._announced: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()
        self._events: list[HostBlock | Removed] = []

    def planned(self, request, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Saves of ``request``'s blocks ``(index, block id)`` are planned under the current epoch."""
        for index, block_id in blocks:
            if block_id in self._announced:
                continue  # planned again after a rewind: announced already
            self._described[block_id] = self.describe(request, index)
            self._described.move_to_end(block_id)
        while len(self._described) > self.pending_blocks:
            self._described.popitem(last=False)

    def report(self, report: HostReport, epoch: str) -> None:
        """Take a step's report (every rank's); ``epoch``: the scheduler's key epoch now."""
        for (block_epoch, block_id), (held, gone) in report.items():
            if block_epoch != epoch:
                continue  # before a reset: removed then
            announced = self._announced.get(block_id)
            ranks = self._holders.pop(block_id, self.all_ranks if announced is not None else 0)
            ranks = (ranks | held) & ~gone
            if ranks == self.all_ranks:
                block = self._described.pop(block_id, None)
                if announced is None and block is not None:   # (no description: no credit)
                    self._announce(block_id, block)
                continue
            if announced is not None:
                del self._announced[block_id]
                self._events.append(Removed(announced))
            if gone:
                self._described.pop(block_id, None)  # a rank lost it: only a save planned anew comes back
            if ranks:
                self._holders[block_id] = ranks
        while len(self._holders) > self.pending_blocks:
            del self._holders[next(iter(self._holders))]

    def _announce(self, block_id: bytes, block: HostBlock) -> None:
        self._announced[block_id] = block.page_hashes
        self._events.append(block)
        while len(self._announced) > self.limit_blocks:
            _, hashes = self._announced.popitem(last=False)
            self._events.append(Removed(hashes))

    def reset(self) -> None:
        """A new key epoch: every block announced is removed, nothing described stays."""
        hashes = [h for page_hashes in self._announced.values() for h in page_hashes]
        for i in range(0, len(hashes), REMOVED_CHUNK):
            self._events.append(Removed(tuple(hashes[i:i + REMOVED_CHUNK])))
        self._announced.clear()
        self._described.clear()
        self._holders.clear()

    def take(self) -> list[HostBlock | Removed]:
        """The events since the last call, in order."""
        events, self._events = self._events, []
        return events

    def announced(self) -> int:
        return len(self._announced)
