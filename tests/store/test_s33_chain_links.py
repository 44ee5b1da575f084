"""A chain keeps its parent links as its blocks move between tiers (s33 a7 D1-D3).

Every case failed before its fix; each tier runs prefix-lru, whose contract is that a block goes
only after all its descendants held there (lookups are longest-prefix: a chain whose first block
went is useless in that tier).

* D1: the host evicts a dirty chain leaf first, so the disk tier received children before their
  parent and filed them all as roots: after a read of the chain, disk pressure evicted its first
  block and kept the rest. A block evicted while its write-behind copy was in flight was demoted
  with no parent at all.
* D2: promotions (inline and background) filed every promoted block as a root in the host: host
  pressure then evicted the chain's first block.
* D3: a block whose write-behind mark the backlog's bound dropped was demoted with no parent: its
  disk record lost the chain (and with it the links a restart restores).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvtier.policy.eviction import PrefixAwareLRUPolicy
from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier

BLOCK = 4096
ON_DISK = 2 * BLOCK  # a block file: its header page and the payload


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def data(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251, np.uint8)


def keys(lo: int, n: int) -> list[bytes]:
    return [key(i) for i in range(lo, lo + n)]


def datas(lo: int, n: int) -> list[np.ndarray]:
    return [data(i) for i in range(lo, lo + n)]


def host(blocks: int, **kw) -> HostTier:
    return HostTier(blocks * BLOCK, BLOCK, policy=PrefixAwareLRUPolicy(), prefault=False, **kw)


def disk(path, blocks: int, cls=DiskTier) -> DiskTier:
    return cls(str(path), blocks * ON_DISK, policy=PrefixAwareLRUPolicy(), direct_io=False)


def held_is_a_prefix(tier, chain) -> bool:
    """Whether what ``tier`` holds of ``chain`` is a prefix of it (no block without its parent)."""
    held = [tier.contains(k) for k in chain]
    return held == sorted(held, reverse=True)


def read(store: TieredStore, chain, **kw) -> None:
    outs = [np.empty(BLOCK, np.uint8) for _ in chain]
    assert store.get(chain, outs, **kw).loaded == len(chain)
    store.wait_promotions(10)
    assert all(np.array_equal(out, data(int.from_bytes(k, "big"))) for k, out in zip(chain, outs))


def recorded_parents(tier: DiskTier, chain) -> list:
    records = {r.key: r.parent for r in tier.records()}
    return [records.get(k) for k in chain]


# -- D1 --------------------------------------------------------------------------------------------
def test_a_chain_demoted_leaf_first_is_evicted_from_the_disk_tier_leaf_first(tmp_path):
    fast, slow = host(4), disk(tmp_path / "d", 9)
    store = TieredStore([fast, slow])
    try:
        chain, other = keys(0, 4), keys(10, 4)
        assert store.put(chain, datas(0, 4)) == [Status.OK] * 4
        assert store.put(other, datas(10, 4)) == [Status.OK] * 4  # the host demotes the chain: leaf first
        store.flush_dirty(10)
        assert all(slow.contains(k) for k in chain)
        read(store, chain, promote_in_background=True)
        store.delete(other)
        for lo in (20, 30):  # 6 more blocks into 9 slots holding the chain's 4: the disk evicts one
            store.put(keys(lo, 3), datas(lo, 3))
            store.flush_dirty(10)
        assert slow.stats.evictions == 1
        assert held_is_a_prefix(slow, chain), [slow.contains(k) for k in chain]
        assert slow.lookup_prefix(chain) == 3
    finally:
        store.close()


class GatedDisk(DiskTier):
    """A disk tier whose next ``put_many`` (the write-behind flusher's copy) runs a hook first."""

    before_put_many = None

    def put_many(self, keys, datas, **kw):
        hook, self.before_put_many = self.before_put_many, None
        if hook is not None:
            hook()
        return super().put_many(keys, datas, **kw)


def test_a_block_evicted_while_its_copy_is_in_flight_is_demoted_with_its_parent(tmp_path):
    """A source tier that lends no views (a disk tier) does not pin the blocks it copies: one may be
    evicted, and demoted, while the flusher holds its mark."""
    upper, lower = disk(tmp_path / "upper", 4), disk(tmp_path / "lower", 64, cls=GatedDisk)
    upper.name, lower.name = "upper", "lower"
    store = TieredStore([upper, lower])
    try:
        chain = keys(0, 4)

        def evict_the_chain_from_the_upper_tier():
            for i in range(10, 14):  # stored in the upper tier alone: the chain goes down
                assert upper.put(key(i), data(i)) is Status.OK

        lower.before_put_many = evict_the_chain_from_the_upper_tier
        assert store.put(chain, datas(0, 4)) == [Status.OK] * 4
        store.flush_dirty(10)
        assert lower.before_put_many is None, "the flusher never copied"
        assert not any(upper.contains(k) for k in chain) and store.stats()["store"]["demotions"] == 4
        assert recorded_parents(lower, chain) == [None, *chain[:-1]]
    finally:
        store.close()


# -- D2 --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
def test_a_promoted_chain_is_evicted_from_the_host_leaf_first(tmp_path, background):
    fast, slow = host(6), disk(tmp_path / "d", 1024)
    store = TieredStore([fast, slow])
    try:
        chain = keys(0, 4)
        store.put(chain, datas(0, 4))
        store.flush_dirty(10)
        for lo in (10, 20):  # the chain leaves the host (clean: the disk holds it)
            store.put(keys(lo, 3), datas(lo, 3))
            store.flush_dirty(10)
        assert not any(fast.contains(k) for k in chain)
        read(store, chain, promote_in_background=background)
        assert all(fast.contains(k) for k in chain), "not promoted"
        store.put(keys(30, 3), datas(30, 3))  # the host evicts 3: its 2 older blocks, then one of the chain
        assert held_is_a_prefix(fast, chain), [fast.contains(k) for k in chain]
        assert fast.lookup_prefix(chain) == 3
    finally:
        store.close()


# -- D3 --------------------------------------------------------------------------------------------
def test_a_block_whose_mark_was_dropped_is_demoted_with_its_parent(tmp_path):
    store = TieredStore([host(4), disk(tmp_path / "d", 1024)], dirty_limit_blocks=1)
    try:
        chain = keys(0, 4)
        store.put(chain, datas(0, 4))  # the backlog keeps 1 mark: those of the first 3 are dropped
        assert store.stats()["store"]["writebehind_dropped"] == 3
        store.flush_dirty(10)          # the last one is copied
        store.put(keys(10, 4), datas(10, 4))  # the chain is evicted: the first 3 are demoted
        store.flush_dirty(10)
        assert store.stats()["store"]["demotions"] == 3
        # (the records are what a restart links the disk tier's blocks by)
        assert recorded_parents(store.tiers[1], chain) == [None, *chain[:-1]]
    finally:
        store.close()


def test_the_host_names_the_parent_of_a_block_it_hands_to_the_hook_also_when_it_expires():
    tier = host(4, ttl_s=0.1)
    named = []
    tier.on_evict = lambda k, view, meta: named.append((k, tier.parent_of(k)))
    try:
        assert tier.put(key(0), data(0)) is Status.OK
        assert tier.put(key(1), data(1), parent=key(0)) is Status.OK
        assert tier.parent_of(key(1)) == key(0) and tier.parent_of(key(0)) is None
        time.sleep(0.25)
        assert tier.expire() == 2
        assert sorted(named) == [(key(0), None), (key(1), key(0))]
        assert tier.parent_of(key(1)) is None  # gone
    finally:
        tier.close()
