"""The router's block index: which worker holds which prompt block, in which tier.

Keys are the router's own, recomputed from token ids (a chained 64-bit xxh3 over each
block's tokens, seeded by its parent's key), so no hash seed must agree with the
engines: a vLLM ``BlockStored`` event carries the token ids of the blocks it stores,
and the router keys a prompt the same way from the tokens its tokenizer gives.
The key is only a routing hint: a collision sends a request to a worker that then
misses, never to a wrong block (the worker checks its own cache).

Per key, one int: bit 0 = a shared tier every worker can load holds it; bit
``1 + 2 x worker + tier`` = ``worker`` holds it in ``tier`` (0 = GPU/HBM, 1 = CPU/host).
Events are applied idempotently (a duplicate store sets bits already set, a duplicate
removal clears bits already clear), out of order (a block whose parent is not yet
known waits, bounded, for it), and the whole index is an LRU of at most ``capacity``
keys (oldest dropped first) so memory is bounded whatever the publishers send.
"""

from __future__ import annotations

import array
from collections import OrderedDict
from itertools import repeat
from typing import Iterable, Sequence

import numpy as np
import xxhash

GPU, CPU = 0, 1          #: worker tiers, as vLLM's ``medium``
SHARED_BIT = 1
ROOT_SEED = 0
_MEDIUM = {"GPU": GPU, None: GPU, "CPU": CPU}
_hash = xxhash.xxh3_64_intdigest
_U64 = (1 << 64) - 1
assert array.array("I").itemsize == 4, "token ids are keyed as 4-byte unsigned ints"


def worker_bit(worker: int, tier: int) -> int:
    return 1 << (1 + 2 * worker + tier)


def tier_of_medium(medium: str | None) -> int | None:
    """Index tier of a vLLM event medium; None for media the router does not price (STORAGE…)."""
    return _MEDIUM.get(medium.upper() if isinstance(medium, str) else medium)


def block_keys(token_ids: Sequence[int] | np.ndarray, block_tokens: int, seed: int = ROOT_SEED) -> list[int]:
    """Keys of the full blocks of ``token_ids``, each chained on its parent's key.

    A list (what tokenizers and events give) becomes bytes through ``array`` (4x faster
    than numpy for a Python list); the bytes are the same either way (native uint32).
    """
    if isinstance(token_ids, np.ndarray):
        data = memoryview(token_ids.astype(np.uint32, copy=False).tobytes())
    else:
        data = memoryview(array.array("I", token_ids)).cast("B")
    step = 4 * block_tokens
    keys = []
    append = keys.append
    key = seed
    for start in range(0, len(data) - step + 1, step):
        key = _hash(data[start:start + step], seed=key)
        append(key)
    return keys


class _Source:
    """What the index knows of one worker's publisher: its hashes → our keys, and orphans."""

    __slots__ = ("hash_to_key", "orphans", "orphan_count")

    def __init__(self) -> None:
        self.hash_to_key: OrderedDict[object, int] = OrderedDict()
        self.orphans: dict[object, list[tuple]] = {}   # parent hash → stored events waiting for it
        self.orphan_count = 0


class BlockIndex:
    """Blocks per worker and tier, fed by events, read by the live cluster view."""

    def __init__(self, block_tokens: int, capacity: int = 1 << 22, max_orphans: int = 4096) -> None:
        if block_tokens <= 0 or capacity <= 0:
            raise ValueError("block_tokens and capacity must be positive")
        self.block_tokens = block_tokens
        self.capacity = capacity
        self.max_orphans = max_orphans
        self._masks: OrderedDict[int, int] = OrderedDict()
        self._sources: dict[int, _Source] = {}
        self._max_worker = 0      # highest worker id ever indexed: how wide masks can be
        self.dropped_orphans = 0

    def __len__(self) -> int:
        return len(self._masks)

    def mask(self, key: int) -> int:
        return self._masks.get(key, 0)

    def masks(self, keys: Sequence[int]) -> list[int]:
        """Masks of the leading ``keys``, stopping at the first key nobody holds."""
        get = self._masks.get
        out = []
        for key in keys:
            m = get(key, 0)
            if not m:
                break
            out.append(m)
        return out

    def leading_masks(self, keys: Sequence[int]) -> list[int]:
        """:meth:`masks` with the lookups done at C speed (one ``dict.get`` per key, then a scan)."""
        found = list(map(self._masks.get, keys, repeat(0)))
        try:
            return found[:found.index(0)]
        except ValueError:
            return found

    def tier_runs(self, worker_ids: Sequence[int], keys: Sequence[int],
                  codes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Where each worker can have the leading prompt blocks anybody holds, as runs.

        Returns ``(run_tiers, run_blocks)``: the leading keys split into runs of equal
        masks (``run_blocks[r]`` keys each: a prompt has a few, one per change of who
        holds what), and ``run_tiers[i, r]`` = ``codes[0]`` if ``worker_ids[i]`` holds
        run ``r`` in GPU, else ``codes[1]`` in CPU, else ``codes[2]`` if the shared tier
        does, else ``codes[3]`` (int8). Numpy work (one ``unpackbits`` of the runs'
        masks), no loop per worker or per block.
        """
        masks = self.leading_masks(keys)
        ids = np.asarray(worker_ids, dtype=np.int64)
        if not masks:
            return np.full((len(ids), 0), codes[3], dtype=np.int8), np.zeros(0, dtype=np.int64)
        # 64-bit words of the widest mask, and of the widest bit asked about (a worker
        # that never sent an event still has a column: all clear)
        words = (2 + 2 * max(self._max_worker, int(ids.max(initial=0)))) // 64 + 1
        if 2 + 2 * self._max_worker < 64:
            packed = np.zeros((len(masks), words), dtype="<u8")
            packed[:, 0] = masks
        else:   # over 31 workers: split each mask into words (slower; rare)
            packed = np.array([[(m >> (64 * w)) & _U64 for w in range(words)] for m in masks], dtype="<u8")
        starts = np.flatnonzero(np.concatenate(([True], (packed[1:] != packed[:-1]).any(axis=1))))
        run_blocks = np.diff(np.append(starts, len(masks)))
        bits = np.unpackbits(packed[starts].view(np.uint8), axis=1, bitorder="little").T   # (bits, runs)
        gpu, cpu, shared = bits[1 + 2 * ids], bits[2 + 2 * ids], bits[0]   # worker_bit(w, GPU / CPU)
        out = np.where(shared, np.int8(codes[2]), np.int8(codes[3]))[None, :].repeat(len(ids), axis=0)
        out[cpu.view(bool)] = codes[1]
        out[gpu.view(bool)] = codes[0]
        return out, run_blocks

    def keys_of(self, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        return block_keys(token_ids, self.block_tokens)

    # --- mutations ------------------------------------------------------------------
    def _set(self, key: int, bits: int) -> None:
        masks = self._masks
        masks[key] = masks.get(key, 0) | bits
        masks.move_to_end(key)
        while len(masks) > self.capacity:
            masks.popitem(last=False)

    def _clear(self, key: int, bits: int) -> None:
        m = self._masks.get(key)
        if m is None:
            return
        m &= ~bits
        if m:
            self._masks[key] = m
        else:
            del self._masks[key]

    def _source(self, worker: int) -> _Source:
        src = self._sources.get(worker)
        if src is None:
            if worker < 0:
                raise ValueError(f"worker ids are >= 0, got {worker}")
            src = self._sources[worker] = _Source()
            self._max_worker = max(self._max_worker, worker)
        return src

    def stored(self, worker: int, block_hashes: Sequence[object], parent_hash: object,
               token_ids: Sequence[int], block_size: int, medium: str | None = "GPU",
               shared: bool = False) -> int:
        """Apply a ``BlockStored`` event; returns how many blocks were indexed (0 if it waits).

        ``shared``: these blocks also reach a tier every worker loads from (the worker
        writes what it computes through to it).
        """
        tier = tier_of_medium(medium)
        if tier is None or block_size != self.block_tokens or not block_hashes:
            return 0
        src = self._source(worker)
        if parent_hash is None:
            parent = ROOT_SEED
        else:
            parent = src.hash_to_key.get(parent_hash)
            if parent is None:
                self._wait_for_parent(src, (block_hashes, parent_hash, token_ids, block_size, medium, shared))
                return 0
        keys = block_keys(token_ids[:len(block_hashes) * block_size], block_size, seed=parent)
        bits = worker_bit(worker, tier) | (SHARED_BIT if shared else 0)
        h2k = src.hash_to_key
        for h, key in zip(block_hashes, keys):
            h2k[h] = key
            h2k.move_to_end(h)
            self._set(key, bits)
        while len(h2k) > self.capacity:
            h2k.popitem(last=False)
        done = len(keys)
        for h in block_hashes[:len(keys)]:
            waiting = src.orphans.pop(h, None)
            if waiting:
                src.orphan_count -= len(waiting)
                for event in waiting:
                    done += self.stored(worker, *event)
        return done

    def _wait_for_parent(self, src: _Source, event: tuple) -> None:
        if src.orphan_count >= self.max_orphans:
            self.dropped_orphans += 1   # a miss later, never a wrong answer
            return
        src.orphans.setdefault(event[1], []).append(event)
        src.orphan_count += 1

    def removed(self, worker: int, block_hashes: Iterable[object], medium: str | None = "GPU") -> None:
        """Apply a ``BlockRemoved`` event (unknown hashes are ignored: duplicates, or never seen)."""
        tier = tier_of_medium(medium)
        src = self._sources.get(worker)
        if tier is None or src is None:
            return
        bit = worker_bit(worker, tier)
        both = worker_bit(worker, GPU) | worker_bit(worker, CPU)
        for h in block_hashes:
            key = src.hash_to_key.get(h)
            if key is None:
                continue
            self._clear(key, bit)
            if not self._masks.get(key, 0) & both:
                del src.hash_to_key[h]

    def clear_worker(self, worker: int) -> None:
        """Forget everything ``worker`` reported (it left, its publisher restarted, or a gap)."""
        src = self._sources.pop(worker, None)
        if src is None:
            return
        bits = worker_bit(worker, GPU) | worker_bit(worker, CPU)
        for key in set(src.hash_to_key.values()):
            self._clear(key, bits)

    def add_shared(self, keys: Iterable[int]) -> None:
        for key in keys:
            self._set(key, SHARED_BIT)

    def clear_shared(self) -> None:
        """Forget what the shared tier holds (its publisher restarted or events were lost)."""
        for key in [k for k, m in self._masks.items() if m & SHARED_BIT]:
            self._clear(key, SHARED_BIT)

    def worker_blocks(self, worker: int) -> int:
        """Blocks ``worker`` reported stored and not removed (since its last resync)."""
        src = self._sources.get(worker)
        return len(src.hash_to_key) if src is not None else 0

    def workers_known(self) -> list[int]:
        return sorted(self._sources)
