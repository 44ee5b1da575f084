"""A promotion into a tier whose TTL the block has outlived is no promotion (regression audit of s27, F2).

A tier with a ``ttl_s`` answers a put of a block already older than it with OK and stores nothing.
The promotion paths took that OK for a promotion: counted it, marked the block clean in a tier that
does not hold it; through an encrypted upper tier every such read sealed the block for nothing and
kept its storage name -> block key for good (the DRAM tier never held, so never evicted, the name).
Now ``Tier.admits(created)`` is asked first: the promotion skips such a tier, and ``EncryptedTier``
neither seals nor remembers such a block. A block within the TTL is promoted and counted as before.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.host import HostTier
from tests.tiers.test_encrypted_store import BLOCK, CHUNK, SLOT, block, key

N = 40
PLAIN = 65536


def read(store: TieredStore, k: bytes, nbytes: int, background: bool) -> list:
    out = np.empty(nbytes, np.uint8)
    got = store.get([k], [out], promote_in_background=background)
    if background:
        assert store.wait_promotions(10.0)
    return got.tiers


@pytest.mark.parametrize("background", [False, True])
def test_a_promotion_the_upper_ttl_refused_is_not_counted_as_one(tmp_path, background):
    """DRAM keeps blocks 0.3 s, the disk without limit. Block 1, 0.5 s old, is served by the disk on
    every read and never counted as promoted (old code: 5 promotions, none stored). Control: block 2,
    young, only on disk, is promoted on its first read and counted, then served by DRAM."""
    host = HostTier(4 * PLAIN, PLAIN, ttl_s=0.3, prefault=False)
    disk = DiskTier(tmp_path / "d", 1 << 24)
    store = TieredStore([host, disk])
    try:
        assert store.put([key(1)], [np.ones(PLAIN, np.uint8)]) == [Status.OK]
        store.flush_dirty(10.0)
        time.sleep(0.5)
        for _ in range(5):
            assert read(store, key(1), PLAIN, background) == ["disk"]
        assert host.used_bytes == 0
        assert store.stats()["store"]["promotions"] == 0, "promotions counted that stored nothing"
        assert store.put([key(2)], [np.full(PLAIN, 2, np.uint8)]) == [Status.OK]
        store.flush_dirty(10.0)
        assert host.delete(key(2))
        assert read(store, key(2), PLAIN, background) == ["disk"]
        assert store.stats()["store"]["promotions"] == 1, "control: a young block is promoted and counted"
        assert read(store, key(2), PLAIN, background) == ["host"]
        host.check_integrity()
    finally:
        store.close(flush_timeout_s=0)


def test_an_encrypted_upper_tier_keeps_no_key_for_a_promotion_its_ttl_refused(tmp_path, monkeypatch):
    """A sealed DRAM tier keeping blocks 0.3 s over a disk without limit: 40 blocks read from disk once
    past that age are neither sealed nor named in its name -> key map (old code: 40 entries kept after
    the disk deleted every block). Control: a young block read from disk is promoted, sealed and
    named (DRAM holds it: its eviction needs the key)."""
    keyring = Keyring(StaticMasterKey(b"k" * 32), tmp_path / "keys", refresh_s=0.0)
    top = EncryptedTier(HostTier(4 * SLOT, SLOT, ttl_s=0.3, prefault=False), keyring, "t",
                        chunk_bytes=CHUNK, threads=1)
    top.name = "sealed-host"
    disk = DiskTier(tmp_path / "d", 256 * SLOT)  # keeps blocks longer than DRAM (no TTL)
    store = TieredStore([top, disk])
    sealed = []
    seal = top._seal
    monkeypatch.setattr(top, "_seal", lambda *a: (sealed.append(a[1]), seal(*a))[1])
    try:
        for i in range(N):
            assert store.put([key(i)], [block(i)])
        store.flush_dirty(10.0)
        time.sleep(0.5)
        top.expire()
        sealed.clear()
        for i in range(N):  # served by the disk; the DRAM copy is refused (older than its TTL)
            out = np.empty(BLOCK, np.uint8)
            assert store.get([key(i)], [out]).loaded == 1 and np.array_equal(out, block(i))
        assert top.inner.used_bytes == 0, "control: DRAM refused every promotion"
        assert sealed == [], f"{len(sealed)} blocks sealed for a DRAM tier that refused them"
        for i in range(N):
            disk.delete(key(i))
        assert len(top._keys) == 0, f"{len(top._keys)} name->key entries kept for blocks no tier holds"
        assert store.stats()["store"]["promotions"] == 0
        # control: a young block read from disk is promoted into the sealed DRAM tier
        assert store.put([key(100)], [block(100)])
        store.flush_dirty(10.0)
        assert top.delete(key(100))
        sealed.clear()
        out = np.empty(BLOCK, np.uint8)
        assert store.get([key(100)], [out]).tiers == ["disk"]
        assert len(sealed) == 1 and list(top._keys.values()) == [key(100)]
        assert store.get([key(100)], [out]).tiers == ["sealed-host"] and np.array_equal(out, block(100))
        assert store.stats()["store"]["promotions"] == 1
    finally:
        store.close(flush_timeout_s=0)


@pytest.mark.parametrize("inner", ["host", "disk"])  # grouped seal-then-put, and streamed (disk)
def test_an_encrypted_tier_neither_seals_nor_names_a_block_its_inner_ttl_refuses(tmp_path, monkeypatch, inner):
    """``put`` / ``put_many`` of blocks older than the inner tier's TTL answer OK and touch nothing: no
    sealing (no data-key use), no name remembered, counted as expired; the young ones in the same batch
    are sealed, remembered and stored (control)."""
    keyring = Keyring(StaticMasterKey(b"k" * 32), tmp_path / "keys", refresh_s=0.0)
    below = (HostTier(16 * SLOT, SLOT, ttl_s=1.0, prefault=False) if inner == "host"
             else DiskTier(tmp_path / "d", 64 * SLOT, ttl_s=1.0))
    tier = EncryptedTier(below, keyring, "t", chunk_bytes=CHUNK, threads=1)
    tier.on_evict = lambda *a: None  # a store's hook: names are remembered
    writes = []
    key_for_write = keyring.key_for_write
    monkeypatch.setattr(keyring, "key_for_write", lambda *a, **kw: (writes.append(a), key_for_write(*a, **kw))[1])
    old, young = time.time() - 5.0, time.time()
    try:
        assert tier.put(key(0), block(0), created=old) is Status.OK
        assert tier.put_many([key(1), key(2), key(3)], [block(1), block(2), block(3)],
                             created=[old, young, old]) == [Status.OK] * 3
        assert len(writes) == 1, f"{len(writes)} blocks sealed; only one was young enough to be stored"
        assert set(tier._keys.values()) == {key(2)}, "only the stored block's name is remembered"
        assert [tier.contains(key(i)) for i in range(4)] == [False, False, True, False]
        assert below.stats.expirations == 3
        out = np.empty(BLOCK, np.uint8)
        assert tier.get(key(2), out) is Status.OK and np.array_equal(out, block(2))
        assert tier.put(key(4), block(4), created=young) is Status.OK and tier.contains(key(4)), "control"
        below.check_integrity()
    finally:
        tier.close()
