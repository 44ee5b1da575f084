import numpy as np
import pytest

from kvtier.core.keys import block_keys
from kvtier.core.namespace import Namespace
from kvtier.errors import LayoutError
from kvtier.store.context import ContextCache
from kvtier.store.tiered import TieredStore, WriteMode
from kvtier.tiers.base import Status
from kvtier.tiers.faulty import Faults, FaultyTier
from kvtier.tiers.host import HostTier


def host(name, blocks, layout):
    t = HostTier(blocks * layout.block_nbytes, layout.block_nbytes)
    t.name = name
    return t


def make_blocks(layout, n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(layout.block_shape).astype(np.float16) for _ in range(n)]


def empty_outs(layout, n):
    return [np.zeros(layout.block_shape, np.float16) for _ in range(n)]


@pytest.fixture
def two_tier(small_layout):
    store = TieredStore([host("fast", 4, small_layout), host("slow", 64, small_layout)])
    yield store
    store.close()


def test_eviction_never_loses_a_block_whether_copied_behind_or_demoted(two_tier, small_ns):
    cache = ContextCache(two_tier, small_ns)
    tokens = np.arange(10 * small_ns.layout.block_tokens)
    keys = cache.keys(tokens)
    blocks = make_blocks(small_ns.layout, 10)
    assert cache.save(keys, blocks) == [Status.OK] * 10
    two_tier.check_integrity()
    assert two_tier.flush_dirty(30.0).dropped == 0
    stats = two_tier.stats()
    # each of the 6 evicted blocks went down once: by the write-behind copy (then its
    # eviction was free) or, still dirty when evicted, by a synchronous demotion
    assert stats["store"]["demotions"] + stats["store"]["clean_evictions"] == 6
    assert stats["tiers"]["fast"]["evictions"] == 6
    assert stats["tiers"]["slow"]["puts"] == 10  # after the flush every block is below too
    assert stats["tiers"]["fast"]["used_bytes"] == 4 * small_ns.layout.block_nbytes
    match = cache.lookup(tokens)
    assert match.hit_blocks == 10
    assert match.tiers == ["slow"] * 10  # the slow tier holds the whole chain: one run
    outs = empty_outs(small_ns.layout, 10)
    result = cache.load(keys, outs)
    assert result.loaded == 10
    assert all(np.array_equal(a, b) for a, b in zip(outs, blocks))
    two_tier.check_integrity()


def test_lookup_is_longest_prefix_across_tiers(two_tier, small_ns):
    cache = ContextCache(two_tier, small_ns)
    tokens = np.arange(6 * small_ns.layout.block_tokens)
    keys = cache.keys(tokens)
    cache.save(keys, make_blocks(small_ns.layout, 6))
    # remove block 3 from every tier: blocks 4 and 5 become useless
    assert two_tier.delete([keys[3]]) >= 1
    assert cache.lookup(tokens).hit_blocks == 3
    result = cache.load(keys, empty_outs(small_ns.layout, 6))
    assert result.loaded == 3
    assert result.statuses[3] is Status.MISS


def test_promotion_copies_slow_hits_into_the_fast_tier(two_tier, small_ns):
    cache = ContextCache(two_tier, small_ns)
    keys = cache.keys(np.arange(8 * small_ns.layout.block_tokens))
    cache.save(keys, make_blocks(small_ns.layout, 8))
    first = keys[:2]  # demoted to "slow" by now
    assert two_tier.lookup(first).tiers == ["slow", "slow"]
    result = cache.load(first, empty_outs(small_ns.layout, 2))
    assert result.tiers == ["slow", "slow"]
    assert two_tier.lookup(first).tiers == ["fast", "fast"]


def test_a_failing_tier_falls_back_to_the_next(small_layout, small_ns):
    fast = FaultyTier(host("fast", 16, small_layout))
    fast.name = "fast"
    slow = host("slow", 16, small_layout)
    store = TieredStore([fast, slow], write_mode=WriteMode.WRITE_THROUGH)
    cache = ContextCache(store, small_ns)
    keys = cache.keys(np.arange(3 * small_layout.block_tokens))
    blocks = make_blocks(small_layout, 3)
    cache.save(keys, blocks)
    fast.faults = Faults(get_error=1.0)
    outs = empty_outs(small_layout, 3)
    result = cache.load(keys, outs)
    assert result.loaded == 3 and result.tiers == ["slow"] * 3
    assert all(np.array_equal(a, b) for a, b in zip(outs, blocks))
    fast.faults = Faults(down=True)
    slow.delete(keys[0])
    result = cache.load(keys, outs)
    # A dead tier degrades to a miss (reported as ERROR so it can be counted), never an exception.
    assert result.loaded == 0 and result.statuses[0] is Status.ERROR
    store.close()


def test_layout_mismatch_is_a_clear_error(two_tier, small_ns):
    cache = ContextCache(two_tier, small_ns)
    keys = cache.keys(np.arange(small_ns.layout.block_tokens))
    wrong = np.zeros((2, 2, 2, 8, 32), np.float16)
    with pytest.raises(LayoutError, match="block 0 has shape"):
        cache.save(keys, [wrong])
    with pytest.raises(LayoutError, match="output buffer 0"):
        cache.load(keys, [np.zeros(10, np.float16)])


def test_tenants_never_see_each_other(two_tier, small_ns):
    a = ContextCache(two_tier, small_ns.with_tenant("a"))
    b = ContextCache(two_tier, small_ns.with_tenant("b"))
    tokens = np.arange(3 * small_ns.layout.block_tokens)
    a.save(a.keys(tokens), make_blocks(small_ns.layout, 3))
    assert a.lookup(tokens).hit_blocks == 3  # control
    assert b.lookup(tokens).hit_blocks == 0


def test_async_load_and_save(two_tier, small_ns):
    cache = ContextCache(two_tier, small_ns)
    keys = cache.keys(np.arange(4 * small_ns.layout.block_tokens))
    blocks = make_blocks(small_ns.layout, 4)
    assert cache.save_async(keys, blocks).result(timeout=10) == [Status.OK] * 4
    outs = empty_outs(small_ns.layout, 4)
    assert cache.load_async(keys, outs).result(timeout=10).loaded == 4
    two_tier.flush()
    assert all(np.array_equal(a, b) for a, b in zip(outs, blocks))


def test_duplicate_tier_names_are_rejected(small_layout):
    with pytest.raises(ValueError, match="distinct"):
        TieredStore([host("x", 1, small_layout), host("x", 1, small_layout)])


def test_namespace_block_keys_match_context_keys(small_ns):
    tokens = np.arange(2 * small_ns.layout.block_tokens)
    store = TieredStore([host("h", 2, small_ns.layout)])
    assert ContextCache(store, small_ns).keys(tokens) == block_keys(small_ns, tokens)
    assert ContextCache(store, Namespace("other", small_ns.layout)).keys(tokens) != block_keys(small_ns, tokens)
    store.close()
