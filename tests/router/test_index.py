"""The router's block index: keys from token ids, idempotent, order-tolerant, bounded, resynced."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest

from kvtier.router.events import VllmEvents
from kvtier.router.index import CPU, GPU, SHARED_BIT, BlockIndex, block_keys, block_keys_reference, worker_bit
from kvtier.router.workers import Worker

BS = 4
TOKENS = list(range(100, 100 + 4 * BS))          # four blocks


def store_chain(index, worker, tokens=TOKENS, hashes=(11, 12, 13, 14), parent=None, medium="GPU"):
    return index.stored(worker, list(hashes), parent, tokens, BS, medium)


def test_keys_from_events_equal_keys_of_the_prompt():
    index = BlockIndex(BS)
    # Two events (first two blocks, then the rest chained on the second's hash): the
    # engine's hashes are arbitrary, the router's keys depend on tokens only.
    index.stored(0, [7, 8], None, TOKENS[:2 * BS], BS, "GPU")
    index.stored(0, [9, 10], 8, TOKENS[2 * BS:], BS, "GPU")
    keys = block_keys(TOKENS + [1, 2], BS)        # a trailing partial block has no key
    assert len(keys) == 4
    assert [m & worker_bit(0, GPU) != 0 for m in index.masks(keys)] == [True] * 4
    # Another prompt sharing the first two blocks only
    other = block_keys(TOKENS[:2 * BS] + [5] * 2 * BS, BS)
    assert len(index.masks(other)) == 2


@pytest.mark.parametrize("block_tokens", [1, 16, 32, 256])
def test_vectorised_keys_equal_the_definition(block_tokens):
    rng = np.random.default_rng(block_tokens)
    tokens = rng.integers(0, 1 << 32, 5000, dtype=np.uint64).astype(np.uint32)   # the full id range
    as_list = tokens.tolist()
    want = block_keys_reference(as_list, block_tokens)
    assert len(want) == 5000 // block_tokens
    assert block_keys(as_list, block_tokens) == want
    assert block_keys(tokens, block_tokens) == want               # numpy input, same keys
    assert block_keys(tokens.astype(np.int64), block_tokens) == want
    seed = (1 << 64) - 3                                           # a parent key in the top bit range
    assert block_keys(as_list, block_tokens, seed=seed) == block_keys_reference(as_list, block_tokens, seed=seed)
    assert block_keys(as_list[:block_tokens - 1], block_tokens) == []


def test_keys_chain_from_a_parent_and_separate_prefixes():
    tokens = np.random.default_rng(0).integers(0, 150_000, 64 * BS, dtype=np.uint32).tolist()
    keys = block_keys(tokens, BS)
    # continuing from block 9's key gives the whole prompt's keys from block 10 on (events do this)
    assert block_keys(tokens[10 * BS:], BS, seed=keys[9]) == keys[10:]
    assert len(set(keys)) == len(keys)
    # one token changed anywhere changes that block's key and every later one, never an earlier one
    for block in (0, 31, 63):
        for position in (0, BS - 1):
            changed = list(tokens)
            changed[block * BS + position] += 1
            other = block_keys(changed, BS)
            assert other[:block] == keys[:block]
            assert all(a != b for a, b in zip(other[block:], keys[block:]))
    # the same block after different prefixes: different keys (the chain is not per block)
    same_last = block_keys([1] * BS + [7] * BS, BS)[1], block_keys([2] * BS + [7] * BS, BS)[1]
    assert same_last[0] != same_last[1]
    # a block of equal tokens in another position of the block changes the key (weights differ)
    assert block_keys([5, 0, 0, 0], BS) != block_keys([0, 5, 0, 0], BS)


def test_duplicate_events_are_idempotent():
    index = BlockIndex(BS)
    store_chain(index, 0)
    store_chain(index, 0)
    keys = block_keys(TOKENS, BS)
    assert len(index) == 4 and len(index.masks(keys)) == 4
    index.removed(0, [13, 14])
    index.removed(0, [13, 14])                     # duplicate removal: nothing more to do
    assert len(index.masks(keys)) == 2
    store_chain(index, 0, TOKENS[2 * BS:], (13, 14), parent=12)
    assert len(index.masks(keys)) == 4


def test_child_before_parent_waits_for_it():
    index = BlockIndex(BS)
    index.stored(0, [13, 14], 12, TOKENS[2 * BS:], BS, "GPU")      # out of order
    assert len(index) == 0
    index.stored(0, [11, 12], None, TOKENS[:2 * BS], BS, "GPU")
    assert len(index.masks(block_keys(TOKENS, BS))) == 4


def test_orphans_are_bounded():
    index = BlockIndex(BS, max_orphans=3)
    for parent in range(10):
        index.stored(0, [1000 + parent], 500 + parent, TOKENS[:BS], BS, "GPU")
    assert index.dropped_orphans == 7


def test_tiers_per_worker_and_removal_per_medium():
    index = BlockIndex(BS)
    store_chain(index, 0, medium="GPU")
    store_chain(index, 0, medium="CPU")
    store_chain(index, 1, hashes=(21, 22, 23, 24), medium="CPU")
    keys = block_keys(TOKENS, BS)
    both0 = worker_bit(0, GPU) | worker_bit(0, CPU)
    assert all(m & both0 == both0 and m & worker_bit(1, CPU) for m in index.masks(keys))
    index.removed(0, [11, 12, 13, 14], "GPU")      # evicted from GPU, still in CPU
    assert all(m & both0 == worker_bit(0, CPU) for m in index.masks(keys))
    index.removed(0, [11, 12, 13, 14], "CPU")
    assert all(m & both0 == 0 for m in index.masks(keys))
    assert len(index.masks(keys)) == 4             # worker 1 still has them


def test_worker_leaving_drops_only_its_entries():
    index = BlockIndex(BS)
    store_chain(index, 0)
    store_chain(index, 1, TOKENS[:2 * BS], (31, 32))
    index.clear_worker(1)
    masks = index.masks(block_keys(TOKENS, BS))
    assert len(masks) == 4 and not any(m & worker_bit(1, GPU) for m in masks)
    index.clear_worker(0)
    assert len(index) == 0


def test_memory_is_bounded_by_capacity_oldest_first():
    index = BlockIndex(BS, capacity=100)
    for i in range(1000):
        index.stored(0, [i], None, [i] * BS, BS, "GPU")
    assert len(index) == 100
    assert index.mask(block_keys([999] * BS, BS)[0]) and not index.mask(block_keys([0] * BS, BS)[0])
    assert len(index._sources[0].hash_to_key) <= 100


def test_shared_marks():
    index = BlockIndex(BS)
    index.stored(0, [11, 12, 13, 14], None, TOKENS, BS, "GPU", shared=True)
    keys = block_keys(TOKENS, BS)
    index.clear_worker(0)                          # worker gone, the shared tier still holds them
    assert all(m == SHARED_BIT for m in index.masks(keys))
    index.clear_shared()
    assert len(index) == 0


def message(seq, events):
    return [b"", struct.pack(">Q", seq), msgpack.packb([1.0, events, None])]


def stored(hashes, parent, tokens):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU"}


def test_sequence_gap_and_publisher_restart_clear_the_workers_entries():
    index = BlockIndex(BS)
    worker = Worker(0, "http://w0")
    events = VllmEvents(worker, index)
    keys = block_keys(TOKENS, BS)
    events.handle(message(0, [stored([11, 12], None, TOKENS[:2 * BS])]))
    events.handle(message(1, [stored([13, 14], 12, TOKENS[2 * BS:])]))
    assert len(index.masks(keys)) == 4 and worker.events_up
    # message 2 lost: what came before the hole may be stale (a removal may be in it)
    events.handle(message(3, [stored([21], None, [1] * BS)]))
    assert events.resyncs == 1 and len(index.masks(keys)) == 0
    assert index.mask(block_keys([1] * BS, BS)[0])
    # the publisher restarts: sequence numbers start again
    events.handle(message(0, [stored([11], None, TOKENS[:BS])]))
    assert events.resyncs == 2
    assert not index.mask(block_keys([1] * BS, BS)[0]) and len(index.masks(keys)) == 1
    # AllBlocksCleared, and malformed input never raises
    events.handle(message(1, [{"type": "AllBlocksCleared"}]))
    assert len(index) == 0
    events.handle([b"garbage"])
    events.handle([b"", struct.pack(">Q", 2), b"\xc1not msgpack"])


def test_an_offloaded_copy_of_a_salted_prompt_keeps_its_key_and_is_cleared_with_it():
    """vLLM's CPU offloading connector publishes its copies with ``extra_keys=None`` for the same
    block hashes the GPU pool published with the request's cache salt. Recomputed, they were keyed
    as an unsalted prompt's: another tenant was predicted a CPU hit, and the salted key's GPU bit,
    no longer reachable through its hash, survived its removal and clear_worker."""
    from kvtier.router.index import context_seed
    index = BlockIndex(BS)
    index.stored(0, [11, 12], None, TOKENS[:2 * BS], BS, "GPU", extra_keys=[["tenant-a"], None])
    index.stored(0, [11, 12], None, TOKENS[:2 * BS], BS, "CPU", extra_keys=None)     # the offloaded copy
    salted = index.keys_of(TOKENS[:2 * BS], context_seed(None, "tenant-a"))
    both0 = worker_bit(0, GPU) | worker_bit(0, CPU)
    assert index.leading_masks(salted) == [both0] * 2          # positive control: the tenant's own hits
    assert index.leading_masks(index.keys_of(TOKENS[:2 * BS])) == []    # no salt: no hit
    index.removed(0, [11, 12], "GPU")
    assert index.leading_masks(salted) == [worker_bit(0, CPU)] * 2
    index.removed(0, [11, 12], "CPU")
    assert index.leading_masks(salted) == [] and len(index) == 0
    # a chain extended in the same event keeps the known blocks' context
    index.stored(0, [11, 12], None, TOKENS[:2 * BS], BS, "GPU", extra_keys=[["tenant-a"], None])
    index.stored(0, [11, 12, 13], None, TOKENS[:3 * BS], BS, "CPU", extra_keys=None)
    salted = index.keys_of(TOKENS[:3 * BS], context_seed(None, "tenant-a"))
    assert len(index.leading_masks(salted)) == 3
    index.clear_worker(0)
    assert len(index) == 0


def test_a_hash_bound_to_a_new_key_clears_its_old_keys_bits():
    index = BlockIndex(BS)
    store_chain(index, 0, TOKENS[:2 * BS], (11, 12))
    old = block_keys(TOKENS[:2 * BS], BS)[1]
    index.stored(1, [91], None, [7] * BS, BS)
    # hash 12 again, after a new block: chained on it, its key differs (contrived: vLLM's hashes
    # chain too); the old key must not keep a bit that no hash reaches any more
    index.stored(0, [21, 12], None, [7] * BS + TOKENS[BS:2 * BS], BS)
    assert not index.mask(old) & worker_bit(0, GPU)
    assert index.mask(block_keys([7] * BS, BS)[0]) == worker_bit(0, GPU) | worker_bit(1, GPU)
    index.clear_worker(0)
    assert len(index) == 1        # worker 1's block only


def test_the_per_worker_hash_cap_clears_the_dropped_hashs_bits():
    """Each worker's hash map is capped; the key of a dropped hash may live on in the shared LRU
    (another worker touched it), so the dropping worker's bit on it had to go with the hash."""
    index = BlockIndex(BS, capacity=2)
    a = [1] * BS
    index.stored(0, [11], None, a, BS)                    # worker 0: key k1
    index.stored(1, [91], None, a, BS)                    # worker 1: same content
    index.stored(0, [12], 11, [2] * BS, BS)               # worker 0: k2 (child of k1)
    index.stored(1, [91], None, a, BS)                    # worker 1 touches k1 again (LRU: newest)
    k1 = index.keys_of(a)[0]
    assert index.mask(k1) & worker_bit(0, GPU)            # control: before the cap drops hash 11
    index.stored(0, [13], 12, [3] * BS, BS)               # worker 0: k3; its map drops hash 11
    assert index.mask(k1) == worker_bit(1, GPU)           # worker 1 keeps its bit
    index.clear_worker(0)
    assert index.mask(k1) == worker_bit(1, GPU)


def test_a_long_chain_of_orphans_resolves_without_recursion():
    """Orphans were re-applied recursively, a frame per chained event: ~1500 raised RecursionError
    when their root arrived, losing the orphans popped and the rest of the listener's batch."""
    index = BlockIndex(BS)
    n = 1500
    tokens = [(i * 7) % 50000 for i in range(n * BS)]
    for i in range(n - 1, 0, -1):     # children first
        index.stored(0, [1000 + i], 1000 + i - 1, tokens[i * BS:(i + 1) * BS], BS)
    assert index._sources[0].orphan_count == n - 1
    assert index.stored(0, [1000], None, tokens[:BS], BS) == n
    assert len(index.masks(index.keys_of(tokens))) == n and index._sources[0].orphan_count == 0


def test_orphans_are_bounded_in_blocks_kept_compact_and_expire(monkeypatch):
    """``max_orphans`` counted events, not their size, and kept each one's whole token list for
    the router's lifetime: 64 events of a 30 k-token prompt held 1.92 M Python ints."""
    index = BlockIndex(BS, max_orphans=64)
    prompt = list(range(30_000))
    for i in range(64):
        index.stored(0, [10_000 + i], 99_000 + i, prompt, BS)     # one block each, and its tokens only
    held = sum(len(e[2]) for waiting in index._sources[0].orphans.values() for e in waiting)
    assert held == 64 * BS and index.dropped_orphans == 0
    # a budget in blocks too (64 a permitted event), the oldest orphans dropped first
    index.stored(0, list(range(20_000, 24_050)), 99_500, prompt[:4050 * BS], BS)
    assert index._sources[0].orphan_blocks == 64 * 64 and index.dropped_orphans == 18
    assert 99_017 not in index._sources[0].orphans and 99_018 in index._sources[0].orphans
    # an orphan that waited longer than orphan_ttl_s is dropped, not applied, when its parent comes
    clock = [1000.0]
    monkeypatch.setattr("kvtier.router.index.time.monotonic", lambda: clock[0])
    index = BlockIndex(BS, orphan_ttl_s=30.0)
    index.stored(0, [13], 12, TOKENS[2 * BS:3 * BS], BS)     # waits for 12
    index.stored(0, [22], 21, TOKENS[BS:2 * BS], BS)         # waits for 21
    clock[0] += 10
    assert index.stored(0, [12], None, TOKENS[:BS], BS) == 2     # control: in time
    clock[0] += 31
    assert index.stored(0, [21], None, TOKENS[:BS], BS) == 1 and index.dropped_orphans == 1


def test_lookups_keep_a_hot_prefix_in_a_full_index():
    """The capped index evicted by first store: lookups never refreshed a key, and vLLM publishes
    a block once, so the system prompt every request reads was the first evicted (root first:
    its whole chain unreachable)."""
    def run(read: bool) -> int:
        index = BlockIndex(BS, capacity=16)
        system = list(range(500, 500 + 4 * BS))
        index.stored(0, [1, 2, 3, 4], None, system, BS, shared=True)
        hot = index.keys_of(system)
        for i in range(40):
            if read:
                index.leading_masks(hot)                  # read by every routing decision
            index.stored(0, [100 + i], None, [10_000 + i] * BS, BS, shared=True)   # a one-off prompt
            index.removed(0, [100 + i])                   # vLLM evicts it; the shared tier keeps it
        assert len(index) == 16
        return len(index.leading_masks(hot))
    assert run(read=False) == 0      # control: unread, it is evicted as the oldest
    assert run(read=True) == 4
