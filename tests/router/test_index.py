"""The router's block index: keys from token ids, idempotent, order-tolerant, bounded, resynced."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest

from kvtier.router.events import VllmEvents
from kvtier.router.index import (CPU, GPU, ROOT_SEED, SHARED_BIT, BlockIndex, block_keys, block_keys_reference,
                                 context_seed, worker_bit)
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


def test_a_key_the_lru_drops_takes_every_workers_hash_of_it():
    """A worker's hash outlived its key (each worker's map was capped on its own); now the hashes go
    with their key, so no bit is left that no hash reaches: a key another worker stores again comes
    back with that worker's bit only, and a removal of a forgotten hash does nothing."""
    index = BlockIndex(BS, capacity=2)
    a = [1] * BS
    index.stored(0, [11], None, a, BS)                    # worker 0: key k1
    index.stored(1, [91], None, a, BS)                    # worker 1: same content
    k1 = index.keys_of(a)[0]
    assert index.mask(k1) == worker_bit(0, GPU) | worker_bit(1, GPU)            # control
    index.check_integrity()
    index.stored(0, [12], 11, [2] * BS, BS)               # worker 0: k2, a third hash: k1 (oldest) goes
    assert index.mask(k1) == 0 and len(index) == 1
    assert index.worker_blocks(0) == 1 and index.worker_blocks(1) == 0
    index.check_integrity()
    index.stored(1, [91], None, a, BS)                    # worker 1 stores k1 again
    assert index.mask(k1) == worker_bit(1, GPU)           # worker 0's bit did not come back with it
    index.removed(0, [11])                                # a hash forgotten with its key: nothing
    index.check_integrity()
    index.clear_worker(1)
    assert index.mask(k1) == 0
    index.check_integrity()


def test_the_index_holds_about_capacity_entries_not_workers_plus_one_times_it():
    """``capacity`` capped the mask LRU, but each worker's hash → key map was capped at ``capacity``
    on its own and kept the entries of keys the LRU had dropped: 8 workers each reporting their own
    prompts left 1,000 masks and 8,000 hash entries for a capacity of 1,000 (at the default 4 Mi
    and 16 workers, ~70 M entries, over 10 GB). Now the hashes go with their keys and count
    against ``capacity`` too, however the workers' blocks overlap."""
    cap, workers = 1000, 8
    index = BlockIndex(BS, capacity=cap)
    for w in range(workers):                       # each its own prompts
        for i in range(cap):
            index.stored(w, [(w, i)], None, [w * 1_000_000 + i * BS + t for t in range(BS)], BS, "GPU")
    hashes = sum(index.worker_blocks(w) for w in range(workers))
    assert len(index) == cap                                                    # control
    assert len(index) + hashes <= 2 * cap, f"{len(index)} masks and {hashes} hash entries for capacity {cap}"
    newest = [(workers - 1) * 1_000_000 + (cap - 1) * BS + t for t in range(BS)]
    assert index.mask(index.keys_of(newest)[0]) == worker_bit(workers - 1, GPU)   # the newest kept
    index.check_integrity()
    index = BlockIndex(BS, capacity=cap)
    for i in range(cap):                           # every worker the same prompts (GPU and CPU)
        for w in range(workers):
            index.stored(w, [(w, i)], None, [i * BS + t for t in range(BS)], BS, ("GPU", "CPU")[w % 2])
    hashes = sum(index.worker_blocks(w) for w in range(workers))
    assert hashes <= cap and len(index) >= cap // workers - 1, (len(index), hashes)
    keys = index.keys_of([(cap - 1) * BS + t for t in range(BS)])
    assert index.mask(keys[0]) == sum(worker_bit(w, w % 2) for w in range(workers))   # all of the newest
    index.check_integrity()


def test_a_full_index_stays_consistent_through_any_events():
    """Random stores (chains, orphans, overlapping workers, both media, shared marks), removals,
    worker clears and shared clears against a small capacity: the integrity check after each."""
    rng = np.random.default_rng(7)
    index = BlockIndex(BS, capacity=40, max_orphans=6)
    contents = [[int(t) for t in rng.integers(0, 50, BS)] for _ in range(30)]
    for step in range(3000):
        op = rng.integers(0, 20)
        w = int(rng.integers(0, 4))
        if op < 12:
            n = int(rng.integers(1, 4))
            first = int(rng.integers(0, 60))
            hashes = [first + i for i in range(n)]
            parent = None if rng.integers(0, 3) == 0 else first - 1
            tokens = [t for i in range(n) for t in contents[(first + i) % len(contents)]]
            index.stored(w, hashes, parent, tokens, BS, ("GPU", "CPU")[int(rng.integers(0, 2))],
                         shared=bool(rng.integers(0, 2)))
        elif op < 18:
            index.removed(w, [int(h) for h in rng.integers(0, 60, 3)], ("GPU", "CPU")[int(rng.integers(0, 2))])
        elif op < 19:
            index.clear_worker(w)
        else:
            index.clear_shared()
        index.check_integrity()
    assert len(index) > 0


def test_an_orphan_removed_before_its_parent_came_is_not_credited():
    """The worker stores C (child of P, which the router does not know: P was stored before it
    listened or before a resync), then evicts C (its removal was ignored: an unknown hash), then
    publishes P again: P's arrival credited the orphan C, and vLLM never sends C's removal again.
    A removal strikes the block and the ones after it in the waiting event (its descendants)."""
    p, c = TOKENS[:BS], TOKENS[BS:]
    keys = block_keys(TOKENS, BS)

    def run(removed: list, medium: str = "GPU") -> int:
        index = BlockIndex(BS)
        index.stored(0, [12, 13, 14], 11, c, BS)          # C and its children wait for P (11)
        index.removed(0, removed, medium)
        index.check_integrity()
        index.stored(0, [11], None, p, BS)                # P (again)
        index.check_integrity()
        assert index._sources[0].orphan_count == 0
        return len(index.masks(keys))

    assert run([]) == 4                                   # control: the orphan is credited
    assert run([12]) == 1, "C was credited after the worker removed it"
    assert run([13]) == 2                                 # C kept, its child and grandchild struck
    assert run([14, 14]) == 3
    assert run([12], "CPU") == 4                          # a removal from another tier strikes nothing
    assert run([99]) == 4                                 # nor one of another block
    # two events wait for the same parent; each is struck on its own
    index = BlockIndex(BS)
    index.stored(0, [12], 11, c[:BS], BS)
    index.stored(0, [22, 23], 11, [9] * 2 * BS, BS)
    index.removed(0, [23])
    assert index._sources[0].orphan_count == 2 and index._sources[0].orphan_blocks == 2
    index.removed(0, [12])
    assert index._sources[0].orphan_count == 1 and index._sources[0].orphan_blocks == 1
    index.check_integrity()
    assert index.stored(0, [11], None, p, BS) == 2        # P and 22
    assert len(index.masks(block_keys(p + [9] * 2 * BS, BS))) == 2
    index.check_integrity()


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


def test_striking_an_orphan_keeps_the_hash_lists_of_the_blocks_it_keeps():
    """R2 (low; a publisher that repeats a block hash inside one event). An orphan [25, 11, 25]
    (parent 1) loses 11 to a removal: it keeps [25], but _strike_orphans unlists every hash of the
    struck tail [11, 25] — 25 included — so the kept block is no longer found by a removal: its
    BlockRemoved is ignored, and the parent's arrival credits a block the worker removed."""
    from kvtier.router.index import BlockIndex, block_keys

    bs = 2
    idx = BlockIndex(bs)
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    idx.stored(0, [25, 11, 25], 1, toks[bs:], bs, "CPU")      # waits for parent 1
    idx.removed(0, [11], "CPU")                               # struck from 11 on: [25] waits
    idx.removed(0, [25], "CPU")                               # the kept block goes too
    idx.stored(0, [1], None, toks[:bs], bs, "CPU")             # the parent arrives
    idx.check_integrity()
    assert len(idx.masks(block_keys(toks[:2 * bs], bs))) == 1, "a block the worker removed was credited"


def test_a_prompt_that_begins_with_blocks_of_token_0_is_not_keyed_as_the_prompt_without_them():
    """A block of token 0 (a model's BOS or pad id, ``!`` in Llama 3's vocabulary) digests to 0;
    from a root of 0 the chain's first key was then 0 and the next ones those of the prompt
    without it, so a request was predicted to hit blocks it does not share."""
    text = list(range(1, 17))
    for seed in (ROOT_SEED, context_seed("adapter")):
        with_zeros = block_keys([0] * 8 + text, 8, seed)
        without = block_keys(text, 8, seed)
        assert with_zeros[0] != 0
        assert not set(with_zeros) & set(without), "the prompt's keys reappear after blocks of token 0"
        assert with_zeros == block_keys_reference([0] * 8 + text, 8, seed)
    # (control: the same text after another first block keys apart too, and a prompt keys as itself)
    assert block_keys(text, 8) == block_keys(list(text), 8)
