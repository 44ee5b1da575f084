"""Write-behind between the tiers of a :class:`~kvtier.store.tiered.TieredStore`.

A block put into a tier that has a tier below it is *dirty* there: a flusher
thread copies it one tier down in batches (``put_many`` on the lower tier), off
the caller's path. A copied block is *clean*: when its tier evicts it, nothing
is written (the demotion hook skips it). A dirty block that is evicted before
its copy is demoted synchronously, as write-back always did, so eviction never
loses a block; nor does expiry: a tier that expires a block hands it to
the same hook (the host tier; the flusher asks each tier with dirty marks to
``expire()`` before each batch, so an expired block does not wait for a
look-up). Every copy carries the block's age (the source tier's
``created_of``, see *retention* in :mod:`kvtier.tiers.base`): a tier below
whose TTL the block has outlived refuses it (counted in its ``expirations``),
and no copy gives a block a new life.

Choices, and why:

* **One tier down at a time** (a chain: host → disk → remote). A block that
  lands in a middle tier -- copied by the flusher or demoted by an eviction --
  is dirty there for the tier below. Every pair of tiers behaves alike, so the
  evicted-while-dirty path and the background path are one mechanism; a block
  is durable on local disk before it goes on the wire; and the eviction hook
  of the host never waits on a network tier.
* **A bounded backlog that never blocks the caller.** Each tier keeps at most
  ``dirty_limit_blocks`` dirty marks; one more drops the *oldest* mark, counted
  in ``writebehind_dropped``. Only the mark goes: the block stays in its tier
  and, not being clean, is still demoted when evicted (with its parent link, which
  a tier that keeps it answers: ``parent_of``, the host's) -- and the oldest blocks
  are the ones LRU evicts next anyway. What a dropped mark costs is the copy
  before a crash or a ``close`` (a cache may lose by policy, never by accident).
* **Clean marks are hints.** They are bounded too (oldest forgotten first);
  a forgotten mark only costs one redundant demotion, which the lower tier
  takes as a no-op (keys are content addresses).
* **Pins, not copies.** A source tier that lends views (``borrow``: the host
  pool) is read in place; the views are pinned while the lower tier writes
  them, so the block cannot be evicted mid-copy. A batch pins at most a quarter
  of the source tier's capacity, so that puts still find room. Other tiers are
  read with ``get`` into staging buffers (at most ``_STAGING_BYTES`` a batch).

Lock order: the write-behind lock is never held while calling into a tier
(tiers call the demotion hook, which takes it, under their own locks).
Races: a delete of a block whose copy is in flight waits until that copy has
landed (at most one batch: a key being deleted is never taken again), and only
then deletes it from every tier. Deleting the landed copy afterwards instead
left a window in which the erased block was served and promoted back, or in
which it was saved again and its only copy then deleted. The wait holds no
lock the copy needs (the copy takes this lock only briefly, in demotion hooks
and to settle, and the wait releases it), so it ends when the copy does (a
copy that fails or raises settles too). A block saved while it is being deleted is marked dirty
once the delete is over (copied if its tier still holds it). A block evicted
mid-copy (a source tier without pins) is not marked clean afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvtier.core.keys import BlockKey
from kvtier.core.payload import BlockMeta
from kvtier.tiers.base import Status, Tier, age_kw

log = logging.getLogger(__name__)

#: at most this many staging bytes per batch when the source tier cannot lend views
_STAGING_BYTES = 64 << 20
#: the flusher thread ends after this long without work (and starts again on the next mark),
#: so that an idle store keeps no thread and can be garbage collected
_IDLE_EXIT_S = 2.0
#: a flush whose flusher could not be started (threads exhausted) tries again this often
_START_RETRY_S = 0.5

# states of a block whose copy is in flight
_COPYING, _EVICTED = "copying", "evicted"


class FlushReport(NamedTuple):
    """What a flush did: ``flushed`` copies made (one per block and tier pair) while it ran,
    ``dropped`` dirty blocks left when it ended (not copied), ``seconds`` it took."""

    flushed: int
    dropped: int
    seconds: float


@dataclass(slots=True)
class _Dirty:
    """What the copy needs that the source tier may not keep: the parent link, the meta,
    the payload size (None: ask the source tier)."""

    parent: BlockKey | None
    meta: BlockMeta | None
    nbytes: int | None


class WriteBehind:
    """Dirty and clean marks for each tier with a tier below it, the flusher, the demotion hooks.

    ``stats`` is the store's :class:`~kvtier.store.tiered.StoreStats` (counters
    ``demotions``, ``demotion_failures``, ``clean_evictions``,
    ``writebehind_flushed``, ``writebehind_dropped``, under ``stats.lock``).
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        stats,
        *,
        dirty_limit_blocks: int,
        batch_blocks: int = 32,
        clean_limit_blocks: int | None = None,
    ) -> None:
        if len(tiers) < 2:
            raise ValueError("write-behind needs a tier below the first")
        if dirty_limit_blocks < 1:
            raise ValueError(f"dirty_limit_blocks must be at least 1, got {dirty_limit_blocks}")
        if batch_blocks < 1:
            raise ValueError(f"batch_blocks must be at least 1, got {batch_blocks}")
        self.tiers = list(tiers)
        self._stats = stats
        self.dirty_limit = dirty_limit_blocks
        self.batch_blocks = batch_blocks
        self.clean_limit = clean_limit_blocks or max(4 * dirty_limit_blocks, 65536)
        levels = len(self.tiers) - 1  # level i: copies from tiers[i] into tiers[i + 1]
        self._dirty: list[OrderedDict[BlockKey, _Dirty]] = [OrderedDict() for _ in range(levels)]
        self._clean: list[OrderedDict[BlockKey, None]] = [OrderedDict() for _ in range(levels)]
        self._inflight: list[dict[BlockKey, str]] = [{} for _ in range(levels)]
        #: the marks of the blocks in flight (taken by the flusher): an eviction meanwhile demotes
        #: the block with the parent link its mark carries
        self._taken: list[dict[BlockKey, _Dirty]] = [{} for _ in range(levels)]
        # blocks saved while they are being deleted: marked dirty once the deletes are over
        self._after_delete: list[dict[BlockKey, _Dirty]] = [{} for _ in range(levels)]
        self._deleting: dict[BlockKey, int] = {}  # keys being deleted now, by how many callers
        self._demoting = 0  # demotions under way (their marks already gone): a flush waits for them
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._closed = False
        self._next_level = 0
        for level in range(levels):
            self.tiers[level].on_evict = self._demoter(level)

    # -- marks ---------------------------------------------------------------------
    def mark_dirty(self, level: int, keys: Sequence[BlockKey], parents: Sequence, metas: Sequence,
                   sizes: Sequence) -> None:
        """Mark blocks of ``tiers[level]`` dirty (not the last tier's: nothing is below it)."""
        with self._cond:
            dropped = self._mark_dirty_locked(level, keys, parents, metas, sizes)
        if dropped:
            self._count(writebehind_dropped=dropped)

    def _mark_dirty_locked(self, level: int, keys: Sequence[BlockKey], parents: Sequence,
                           metas: Sequence, sizes: Sequence) -> int:
        """:meth:`mark_dirty` under the lock; returns how many marks the backlog's bound dropped
        (the caller counts them once it has let the lock go)."""
        if level >= len(self._dirty) or self._closed:
            return 0
        dropped = 0
        dirty, clean, inflight = self._dirty[level], self._clean[level], self._inflight[level]
        for key, parent, meta, nbytes in zip(keys, parents, metas, sizes):
            if key in self._deleting:
                # the delete may remove this copy or not (it may have passed this tier): its
                # end decides, so that no block saved meanwhile stays uncopied
                self._after_delete[level][key] = _Dirty(parent, meta, nbytes)
                continue
            if key in dirty or key in clean or key in inflight:
                continue  # already copied, queued or being copied (the same bytes)
            dirty[key] = _Dirty(parent, meta, nbytes)
            if len(dirty) > self.dirty_limit:
                dirty.popitem(last=False)  # the oldest: LRU evicts (and so demotes) it next anyway
                dropped += 1
        self._ensure_flusher_locked()
        self._cond.notify_all()
        return dropped

    def mark_clean(self, level: int, key: BlockKey) -> None:
        """``tiers[level]`` holds ``key`` and a tier below holds it too (e.g. after a promotion)."""
        if level >= len(self._clean):
            return
        with self._cond:
            if key not in self._dirty[level] and key not in self._inflight[level] and key not in self._deleting:
                self._add_clean_locked(level, key)

    @contextlib.contextmanager
    def deleting(self, keys: Sequence[BlockKey]):
        """Wrap the deletion of ``keys`` from every tier: their marks go, and the body runs once
        no copy of them is in flight (it has landed: the body deletes it with the rest). None
        is copied or marked until the deletion is over (an eviction racing it may demote a
        block once more, before the body deletes it there); a block saved meanwhile is marked
        dirty at the end.

        Waits at most for the flusher's batch under way (keys being deleted are never taken
        again; after :meth:`close` too, as a copy may still land). Call it holding no lock that
        a tier's put or a demotion hook takes."""
        keys = list(dict.fromkeys(keys))
        with self._cond:
            for key in keys:
                self._deleting[key] = self._deleting.get(key, 0) + 1
            for level in range(len(self._dirty)):
                for key in keys:
                    self._dirty[level].pop(key, None)
                    self._clean[level].pop(key, None)
                    self._after_delete[level].pop(key, None)  # saved before this delete: it goes too
            self._cond.notify_all()  # flush() counts the marks dropped here
        try:
            with self._cond:
                copying = self._copying_locked(keys)
                while copying:
                    self._cond.wait()  # _settle notifies
                    copying = self._copying_locked(copying)
            yield
        finally:
            with self._cond:
                dropped = self._end_delete_locked(keys)
            if dropped:
                self._count(writebehind_dropped=dropped)

    def _end_delete_locked(self, keys: Sequence[BlockKey]) -> int:
        """The deletion of ``keys`` is over: those saved meanwhile (and deleted by no other caller
        now) are marked dirty, under the lock that their saved marks are taken under -- marked
        after it, a flush between found neither mark and returned with the blocks uncopied.
        Returns how many marks the backlog's bound dropped."""
        ended = []
        for key in keys:   # every count settled before any mark (a mark may fail to start the flusher)
            left = self._deleting.pop(key) - 1
            if left:
                self._deleting[key] = left
            else:
                ended.append(key)
        dropped = 0
        for key in ended:
            for level, saved in enumerate(self._after_delete):
                entry = saved.pop(key, None)
                if entry is not None:  # gone from its tier meanwhile: the flusher skips it
                    dropped += self._mark_dirty_locked(level, [key], [entry.parent], [entry.meta],
                                                       [entry.nbytes])
        return dropped

    def _copying_locked(self, keys) -> list[BlockKey]:
        """Those of ``keys`` whose copy is in flight (in the flusher's batch)."""
        return [key for key in keys if any(key in inflight for inflight in self._inflight)]

    def dirty_count(self) -> int:
        with self._cond:
            return self._pending_locked()

    def _pending_locked(self) -> int:
        return self._marked_locked() + self._demoting

    def _marked_locked(self) -> int:
        return sum(map(len, self._dirty)) + sum(map(len, self._inflight)) + sum(map(len, self._after_delete))

    def _add_clean_locked(self, level: int, key: BlockKey) -> None:
        clean = self._clean[level]
        clean[key] = None
        clean.move_to_end(key)
        if len(clean) > self.clean_limit:
            clean.popitem(last=False)  # a hint: forgetting one costs one redundant demotion

    # -- eviction ------------------------------------------------------------------
    def _demoter(self, level: int):
        upper, lower = self.tiers[level], self.tiers[level + 1]
        parent_held_above = getattr(upper, "parent_of", lambda key: None)  # (the host tier keeps it)

        def demote(key: BlockKey, data: memoryview, meta: BlockMeta | None) -> None:
            # (an expiring block comes here too: copied down if the tier below admits its age)
            # Runs under the evicting tier's lock (an eviction), or outside it for a block the
            # host's expire() hands over (its deletes wait for this to return): take ours only
            # briefly, call no tier under it.
            with self._cond:
                if key in self._clean[level] and key not in self._inflight[level]:
                    del self._clean[level][key]
                    clean = True
                else:
                    clean = False
                    entry = self._dirty[level].pop(key, None)
                    if entry is None:
                        entry = self._taken[level].get(key)  # its copy in flight
                    if self._inflight[level].get(key) == _COPYING:
                        self._inflight[level][key] = _EVICTED  # its tier no longer holds it: never clean
                    self._demoting += 1
            if clean:
                self._count(clean_evictions=1)
                return
            try:
                # no mark (the backlog's bound dropped it): the parent its tier was told, if it keeps it
                parent = entry.parent if entry is not None else parent_held_above(key)
                if meta is None and entry is not None:
                    meta = entry.meta
                created = upper.created_of(key) if lower.keeps_age else None  # (the victim is still held)
                status = lower.put(key, data, parent=parent, meta=meta, **age_kw(lower, created))
                if status is Status.OK:
                    self._count(demotions=1)
                    self.mark_dirty(level + 1, [key], [parent], [meta], [memoryview(data).nbytes])
                else:
                    self._count(demotion_failures=1)
            finally:
                with self._cond:
                    self._demoting -= 1
                    self._cond.notify_all()  # flush() waits for it

        return demote

    # -- the flusher ----------------------------------------------------------------
    def _ensure_flusher_locked(self) -> None:
        """Start the flusher unless it runs. A start that fails (threads exhausted for a moment)
        leaves the marks queued and no thread recorded, so the next mark or flush tries again
        (recorded before its start, an unstarted thread stood for the flusher for good)."""
        if self._thread is not None:
            return
        thread = threading.Thread(target=self._run, name="kvtier-writebehind", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:
            log.warning("write-behind: cannot start the flusher (%s); the dirty blocks wait for the next "
                        "mark or flush", exc)
            return
        self._thread = thread   # (under the lock: the thread takes it before it can reset this)

    def _run(self) -> None:
        while True:
            self._expire()
            with self._cond:
                idle_until = time.monotonic() + _IDLE_EXIT_S
                while not self._closed and not any(self._dirty):
                    left = idle_until - time.monotonic()
                    if left <= 0:
                        self._thread = None  # the next mark starts another
                        return
                    self._cond.wait(left)
                if self._closed:
                    self._thread = None
                    return
                level, batch = self._take_locked()
            try:
                self._copy(level, batch)
            except Exception:  # noqa: BLE001 - a broken tier must not kill the flusher
                if self._closed:  # the store closed the tiers under a copy it gave up on
                    log.debug("write-behind: a copy abandoned at close failed", exc_info=True)
                else:
                    log.exception("write-behind: copying %d blocks from %s failed", len(batch),
                                  self.tiers[level].name)
                self._settle(level, batch, [Status.ERROR] * len(batch), [])
            except BaseException:  # the thread ends: nothing stays in flight (a delete waits on it)
                self._settle(level, batch, [Status.ERROR] * len(batch), [])
                with self._cond:
                    self._thread = None  # the next mark starts another
                raise

    def _expire(self) -> None:
        """Ask each tier with dirty marks to expire its old blocks now (called holding no lock):
        an expired dirty block then goes down through the demotion hook, with its parent link,
        instead of sitting in its tier until a look-up or the batch that takes it. The host tier
        runs those demotions outside its lock (a backlog of them under it stalled every DRAM
        read and write), each counted in ``_demoting`` while it runs, as an eviction's is."""
        for tier in self.tiers[:-1]:
            try:
                tier.expire()
            except Exception:  # noqa: BLE001 - a broken tier must not kill the flusher
                log.exception("write-behind: expiring blocks of %s failed", tier.name)

    def _take_locked(self) -> tuple[int, list[tuple[BlockKey, _Dirty]]]:
        """Take the oldest dirty blocks of one level (levels in turn, so none starves)."""
        levels = len(self._dirty)
        for step in range(levels):
            level = (self._next_level + step) % levels
            dirty = self._dirty[level]
            if dirty:
                self._next_level = (level + 1) % levels
                batch = []
                while dirty and len(batch) < self.batch_blocks:
                    key, entry = dirty.popitem(last=False)
                    self._inflight[level][key] = _COPYING
                    self._taken[level][key] = entry
                    batch.append((key, entry))
                return level, batch
        raise AssertionError("_take_locked called with nothing dirty")

    def _copy(self, level: int, batch: list[tuple[BlockKey, _Dirty]]) -> None:
        upper, lower = self.tiers[level], self.tiers[level + 1]
        borrow = getattr(upper, "borrow", None)
        meta_of = getattr(upper, "meta_of", None)
        carry = lower.keeps_age  # the blocks' ages go down with them
        budget = max(1, upper.capacity_bytes // 4) if borrow is not None else _STAGING_BYTES
        with contextlib.ExitStack() as held:
            keys, datas, parents, metas, created, taken, deferred = [], [], [], [], [], [], []
            used = 0
            for i, (key, entry) in enumerate(batch):
                if used >= budget:
                    deferred = batch[i:]  # back to the front of the queue, in order
                    break
                if borrow is not None:
                    data = held.enter_context(borrow(key))  # pinned until the lower tier has it
                elif entry.nbytes is not None:
                    staging = np.empty(entry.nbytes, np.uint8)
                    data = staging if upper.get(key, staging) is Status.OK else None
                else:
                    data = None  # size unknown and no view to ask: cannot copy
                if data is None:
                    continue  # gone (deleted, expired, evicted and demoted): nothing to copy
                used += data.nbytes
                meta = entry.meta if entry.meta is not None or meta_of is None else meta_of(key)
                keys.append(key)
                datas.append(data)
                parents.append(entry.parent)
                metas.append(meta)
                created.append(upper.created_of(key) if carry else None)  # (pinned, or read: still held)
                taken.append((key, entry))
            sizes = [d.nbytes for d in datas]
            statuses = (lower.put_many(keys, datas, parents=parents, metas=metas, **age_kw(lower, created))
                        if keys else [])
        copied = set(keys)
        gone = [key for key, _ in batch[: len(batch) - len(deferred)] if key not in copied]
        self._settle(level, taken, statuses, gone, deferred, sizes)

    def _settle(self, level: int, taken, statuses, gone, deferred=(), sizes=None) -> None:
        """Record the outcome of a batch: clean marks above, dirty marks below. A key being
        deleted gets neither: its delete waits for this, then removes the copy that landed.

        The marks below are made under the same lock as the in-flight ones go, before anyone is
        notified: made after, a flush woke between the two with nothing pending and returned,
        and ``close`` then refused the marks (the blocks never reached the last tier, while
        the report said none was dropped)."""
        below = []
        flushed = dropped = 0
        with self._cond:
            for key in gone:
                self._land_locked(level, key)
            for key, entry in reversed(deferred):
                if self._land_locked(level, key) == _COPYING and key not in self._deleting:
                    self._dirty[level][key] = entry
                    self._dirty[level].move_to_end(key, last=False)
            for i, ((key, entry), status) in enumerate(zip(taken, statuses)):
                state = self._land_locked(level, key, _COPYING)
                if key in self._deleting:
                    continue
                if status is not Status.OK:
                    dropped += 1  # still in its tier, not clean: an eviction demotes it
                    continue
                flushed += 1
                if state == _COPYING:
                    self._add_clean_locked(level, key)
                nbytes = sizes[i] if sizes is not None else entry.nbytes
                below.append((key, entry.parent, entry.meta, nbytes))
            if below:
                dropped += self._mark_dirty_locked(level + 1, *map(list, zip(*below)))
            self._cond.notify_all()
            closed = self._closed  # then close() has counted the whole batch as dropped
        if (flushed or dropped) and not closed:
            self._count(writebehind_flushed=flushed, writebehind_dropped=dropped)

    def _land_locked(self, level: int, key: BlockKey, default: str | None = None) -> str | None:
        """``key``'s copy is no longer in flight: its state (copying, or evicted meanwhile)."""
        self._taken[level].pop(key, None)
        return self._inflight[level].pop(key, default)

    # -- flush and close ----------------------------------------------------------------
    def flush(self, timeout_s: float | None) -> FlushReport:
        """Wait until nothing is dirty (copies cascade down every tier), at most ``timeout_s``.

        The marks left at the deadline stay queued; they are reported as ``dropped``."""
        start = time.monotonic()
        deadline = None if timeout_s is None else start + max(0.0, timeout_s)
        with self._stats.lock:
            flushed_before = self._stats.writebehind_flushed
        with self._cond:
            if any(self._dirty):
                self._ensure_flusher_locked()
                self._cond.notify_all()
            while self._pending_locked():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                if self._thread is None and any(self._dirty):   # its start failed: try again now and then
                    self._ensure_flusher_locked()
                    if self._thread is None:
                        left = _START_RETRY_S if left is None else min(left, _START_RETRY_S)
                self._cond.wait(left)
            remaining = self._pending_locked()
        with self._stats.lock:
            flushed = self._stats.writebehind_flushed - flushed_before
        return FlushReport(flushed, remaining, time.monotonic() - start)

    def close(self, timeout_s: float | None) -> FlushReport:
        """Flush (bounded), then stop the flusher; what is still dirty or in flight is dropped
        and counted (a copy still in flight may land, but the tiers are closed next)."""
        report = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            abandoned = self._marked_locked()  # (a demotion under way is no mark: it lands or fails on its own)
            for dirty in self._dirty:
                dirty.clear()
            for saved in self._after_delete:
                saved.clear()
            thread = self._thread
            self._cond.notify_all()
        if abandoned:
            self._count(writebehind_dropped=abandoned)
        if thread is not None:
            thread.join(timeout=1.0)
            if thread.is_alive():  # stuck in a lower tier's put: it is a daemon, let it go
                log.warning("write-behind: the flusher is still copying after close; its copy may be lost")
        return report

    def _count(self, **deltas: int) -> None:
        with self._stats.lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)
