"""PrefixAwareLRUPolicy ("prefix-lru") under use the eviction tests do not pin: many hits on a
tier that never fills, and a parent deleted and stored again. Each case failed before its fix
(audit s25, D10-D11): the heap grew by one entry per hit, and a restored parent was charged
its old child's removal."""

from __future__ import annotations

import numpy as np

from kvtier.policy.eviction import PrefixAwareLRUPolicy
from kvtier.tiers.base import Status
from kvtier.tiers.host import HostTier

from tests.policy.test_eviction import take

BLOCK = 4096


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def data(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251, np.uint8)


# -- D10: the heap follows the blocks held, not the hits ----------------------------------------
def test_hits_on_a_cached_prefix_do_not_grow_the_policy():
    policy = PrefixAwareLRUPolicy()
    tier = HostTier(64 * BLOCK, BLOCK, policy=policy, prefault=False)
    try:
        assert tier.put(k(0), data(0)) is Status.OK
        assert tier.put(k(1), data(1), parent=k(0)) is Status.OK     # chain 0 -> 1 (1 the leaf)
        out = np.empty(BLOCK, np.uint8)
        for _ in range(20_000):                                          # a hot system prompt
            assert tier.get(k(1), out) is Status.OK
            assert tier.put(k(1), data(1), parent=k(0)) is Status.OK     # re-puts touch it too
        assert len(policy) == 2 and len(policy._heap) <= 2 * len(policy) + 65, len(policy._heap)
        tier.check_integrity()
    finally:
        tier.close()


def test_the_order_survives_the_heap_being_rebuilt():
    """Enough touches to rebuild the heap many times; the order is the one LRU-among-leaves gives."""
    p = PrefixAwareLRUPolicy()
    p.on_insert("a")
    p.on_insert("b", "a")
    p.on_insert("c", "b")
    p.on_insert("x")
    p.on_insert("y", "x")
    for i in range(1000):
        p.on_access("ac"[i % 2])       # touching an ancestor does not make it a leaf
    p.on_access("y")
    assert len(p._heap) <= 2 * len(p) + 65
    assert take(p, 5) == ["c", "b", "a", "y", "x"]


# -- D11: a parent removed and stored again ------------------------------------------------------
def test_a_restored_parent_is_not_evicted_before_its_new_child():
    """0 is deleted (TTL expiry, an erase, a failed checksum) while its child 1 stays, then
    stored again with a new child 2. Removing the old child 1 must not make 0 a leaf."""
    policy = PrefixAwareLRUPolicy()
    tier = HostTier(3 * BLOCK, BLOCK, policy=policy, prefault=False)
    evicted = []
    tier.on_evict = lambda key, *rest: evicted.append(key)
    try:
        tier.put(k(0), data(0))
        tier.put(k(1), data(1), parent=k(0))
        assert tier.delete(k(0))                       # parent gone, child 1 keeps its link
        tier.put(k(0), data(0))                        # the parent stored again
        tier.put(k(2), data(2), parent=k(0))           # its new child
        assert tier.delete(k(1))                       # the old child goes
        tier.put(k(7), data(7))                        # an unrelated root: the pool is full
        assert tier.put(k(8), data(8)) is Status.OK    # one is evicted: the LRU leaf, 2
        assert evicted == [k(2)], evicted
        assert tier.contains(k(0)) and tier.contains(k(7))
        tier.check_integrity()
    finally:
        tier.close()


def test_the_child_count_of_a_reinserted_parent_counts_only_its_new_children():
    p = PrefixAwareLRUPolicy()
    p.on_insert("a")
    p.on_insert("b", "a")
    p.on_remove("a")                 # b becomes a root
    p.on_insert("a")
    p.on_insert("c", "a")
    p.on_remove("b")
    assert take(p, 2) == ["c", "a"]
    # without a new child, the restored parent is a leaf at once and evictable (not stuck at -1)
    q = PrefixAwareLRUPolicy()
    q.on_insert("a")
    q.on_insert("b", "a")
    q.on_remove("a")
    q.on_insert("a")
    q.on_remove("b")
    assert take(q, 1) == ["a"] and len(q) == 0


def test_an_orphan_still_links_a_child_inserted_under_it():
    """Positive control for the links: a root left by its parent's removal is itself a parent."""
    p = PrefixAwareLRUPolicy()
    p.on_insert("a")
    p.on_insert("b", "a")
    p.on_remove("a")
    p.on_insert("c", "b")
    assert take(p, 2) == ["c", "b"]
