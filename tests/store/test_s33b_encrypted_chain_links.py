"""A chain keeps its parent links when the store's upper tier is an EncryptedTier over the host
(s33 r2 D3).

A dirty block whose write-behind mark the backlog's bound dropped is demoted with the parent its
upper tier names (``parent_of``). The encrypting wrapper named none, so under it such a block's
disk record lost the chain, and with it the links a restart restores."""

from __future__ import annotations

import numpy as np

from kvtier.crypto.aead import sealed_nbytes
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.policy.eviction import PrefixAwareLRUPolicy
from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.host import HostTier

BLOCK, CHUNK = 16384, 4096
SLOT = sealed_nbytes(BLOCK, CHUNK)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def data(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251 + 1, np.uint8)


def sealed_host(tmp_path, blocks: int) -> EncryptedTier:
    host = HostTier(blocks * SLOT, SLOT, policy=PrefixAwareLRUPolicy(), prefault=False)
    keyring = Keyring(StaticMasterKey(b"k" * 32), tmp_path / "keys", refresh_s=0.0)
    return EncryptedTier(host, keyring, "tenant", chunk_bytes=CHUNK, threads=1)


def test_a_block_whose_mark_was_dropped_under_a_sealed_host_is_demoted_with_its_parent(tmp_path):
    disk = DiskTier(str(tmp_path / "d"), 1024 * 2 * SLOT, policy=PrefixAwareLRUPolicy(), direct_io=False)
    store = TieredStore([sealed_host(tmp_path, 4), disk], dirty_limit_blocks=1)
    try:
        chain = [key(i) for i in range(4)]
        store.put(chain, [data(i) for i in range(4)])  # the backlog keeps 1 mark: 3 dropped
        assert store.stats()["store"]["writebehind_dropped"] == 3
        store.flush_dirty(10)
        store.put([key(i) for i in range(10, 14)], [data(i) for i in range(10, 14)])  # the chain evicted
        store.flush_dirty(10)
        parents = {record.key: record.parent for record in disk.records()}
        assert [parents.get(k) for k in chain] == [None, *chain[:-1]]
    finally:
        store.close()


def test_the_sealed_host_names_a_held_parent_by_its_block_key(tmp_path):
    tier = sealed_host(tmp_path, 4)
    tier.on_evict = lambda k, view, meta: None  # a store's upper tier: it maps names back to keys
    try:
        assert tier.put(key(0), data(0)) is Status.OK
        assert tier.put(key(1), data(1), parent=key(0)) is Status.OK
        assert tier.parent_of(key(1)) == key(0)
        assert tier.parent_of(key(0)) is None and tier.parent_of(key(7)) is None  # none named; not held
    finally:
        tier.close()
