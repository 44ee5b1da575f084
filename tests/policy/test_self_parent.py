"""A block named as its own parent (a caller's bug, or a record written by any process on a shared
mount) is a plain root for prefix-lru. Before the fix (audit s26, D1) ``on_insert(key, parent=key)``
raised KeyError halfway through, left the policy inconsistent (a host tier then failed its
integrity check and could not delete the block), and a disk tier holding such a record could no
longer be opened: its restart scan raised the same KeyError."""

from __future__ import annotations

import numpy as np

from kvtier.policy.eviction import PrefixAwareLRUPolicy
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier

from tests.policy.test_eviction import take

BLOCK = 4096


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_a_self_parent_insert_is_a_plain_root():
    p = PrefixAwareLRUPolicy()
    p.on_insert(k(1), k(1))
    p.on_insert(k(2), k(1))           # a real child of it: k1 is no leaf now
    p.on_insert(k(3))
    assert len(p) == 3
    assert take(p, 3) == [k(2), k(1), k(3)]   # k1 a leaf once k2 is gone, and older than k3
    assert len(p) == 0 and not p._parent and not p._children and not p._born


def test_records_that_name_each_other_as_parents_make_no_cycle():
    p = PrefixAwareLRUPolicy()
    p.on_insert(k(1), k(2))           # k2 not held yet: k1 is a root
    p.on_insert(k(2), k(1))           # k2 a child of k1, not k1 of k2 as well
    assert take(p, 2) == [k(2), k(1)]


def test_a_host_tier_put_naming_itself_as_parent_leaves_the_tier_whole():
    tier = HostTier(8 * BLOCK, BLOCK, policy=PrefixAwareLRUPolicy(), prefault=False)
    try:
        assert tier.put(k(1), np.ones(BLOCK, np.uint8), parent=k(1)) is Status.OK
        tier.check_integrity()
        assert tier.delete(k(1))
        tier.check_integrity()
        assert tier.put(k(1), np.ones(BLOCK, np.uint8)) is Status.OK   # and its slot came back
    finally:
        tier.close()


def test_a_disk_tier_holding_a_self_parent_record_still_opens(tmp_path):
    path = str(tmp_path / "disk")
    tier = DiskTier(path, 64 * BLOCK, policy=PrefixAwareLRUPolicy())
    try:
        assert tier.put(k(1), np.ones(BLOCK, np.uint8), parent=k(1)) is Status.OK
        assert tier.put(k(2), np.full(BLOCK, 2, np.uint8), parent=k(1)) is Status.OK
        # control: the record on disk does name the block as its own parent (what the scan reads)
        assert {r.key: r.parent for r in tier.records()} == {k(1): k(1), k(2): k(1)}
    finally:
        tier.close()
    reopened = DiskTier(path, 64 * BLOCK, policy=PrefixAwareLRUPolicy())
    try:
        reopened.check_integrity()
        out = np.empty(BLOCK, np.uint8)
        assert reopened.get(k(1), out) is Status.OK and out[0] == 1
        assert reopened.get(k(2), out) is Status.OK and out[0] == 2
        assert take(reopened._policy, 2) == [k(2), k(1)]   # the child first, as for any chain
    finally:
        reopened.close()
