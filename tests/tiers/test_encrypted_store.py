"""EncryptedTier inside a store: blocks sealed under a retired epoch (retention) are not taken for
the block by a put, ``contains`` or ``lookup_prefix``; and a store whose upper tier is encrypted
(``encrypt_host``) demotes the dirty blocks it evicts instead of losing them."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from kvtier.crypto.aead import sealed_nbytes
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.host import HostTier

BLOCK = 16384
CHUNK = 4096
SLOT = sealed_nbytes(BLOCK, CHUNK)


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "little")).digest()


def block(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251 + 1, np.uint8)


@pytest.fixture
def keyring(tmp_path):
    return Keyring(StaticMasterKey(b"k" * 32), tmp_path / "keys", refresh_s=0.0)


def sealed_host(keyring, blocks: int = 16) -> EncryptedTier:
    return EncryptedTier(HostTier(blocks * SLOT, SLOT, prefault=False), keyring, "t", chunk_bytes=CHUNK, threads=1)


def sealed_disk(keyring, path) -> EncryptedTier:
    return EncryptedTier(DiskTier(path, 64 * SLOT), keyring, "t", chunk_bytes=CHUNK, threads=1)


def retire_current(keyring) -> None:
    old = keyring.current_epoch("t")
    keyring.rotate("t")
    assert keyring.retire("t", old)


def reads_back(tier, i: int) -> bool:
    out = np.empty(BLOCK, np.uint8)
    return tier.get(key(i), out) is Status.OK and np.array_equal(out, block(i))


# -- retention ---------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [False, True])
def test_a_block_saved_again_after_its_epoch_is_retired_is_readable(keyring, batch):
    tier = sealed_host(keyring)
    keys, blocks = [key(i) for i in range(3)], [block(i) for i in range(3)]
    assert tier.put_many(keys, blocks) == [Status.OK] * 3
    retire_current(keyring)
    if batch:
        assert tier.put_many(keys, blocks) == [Status.OK] * 3
    else:
        assert all(tier.put(k, b) is Status.OK for k, b in zip(keys, blocks))
    assert all(reads_back(tier, i) for i in range(3)), "a put acknowledged a block that cannot be read"


def test_a_block_saved_again_over_a_tier_without_views_after_retirement_is_readable(keyring, tmp_path):
    tier = sealed_disk(keyring, tmp_path / "disk")
    assert tier.put(key(1), block(1)) is Status.OK
    retire_current(keyring)
    assert tier.put(key(1), block(1)) is Status.OK
    assert reads_back(tier, 1)


def test_blocks_under_a_retired_epoch_are_no_hit(keyring):
    tier = sealed_host(keyring)
    keys = [key(i) for i in range(3)]
    tier.put_many(keys, [block(i) for i in range(3)])
    retire_current(keyring)
    assert tier.lookup_prefix(keys) == 0
    assert not any(tier.contains(k) for k in keys)
    assert tier.inner.used_bytes == 0  # they can never be read: deleted


def test_a_get_deletes_a_block_sealed_under_a_retired_epoch(keyring, tmp_path):
    tier = sealed_disk(keyring, tmp_path / "disk")
    tier.put(key(1), block(1))
    retire_current(keyring)
    assert tier.get(key(1), np.empty(BLOCK, np.uint8)) is Status.MISS
    assert not tier.inner.contains(tier.storage_name(key(1)))


def test_blocks_under_live_epochs_stay_hits_and_are_not_sealed_again(keyring):
    tier = sealed_host(keyring)
    tier.put(key(1), block(1))
    keyring.rotate("t")
    tier.put(key(2), block(2))
    retire_current(keyring)  # epoch 1 (key 2's); key 1's epoch 0 stays
    puts = tier.inner.stats.puts
    assert tier.put(key(1), block(1)) is Status.OK
    assert tier.inner.stats.puts == puts, "a block under a live epoch was sealed again"
    assert tier.lookup_prefix([key(1)]) == 1 and tier.contains(key(1)) and reads_back(tier, 1)
    assert tier.lookup_prefix([key(1), key(2)]) == 1


def test_a_key_from_elsewhere_is_not_taken_for_a_retired_one(keyring, tmp_path):
    """A block sealed under a newer epoch another process made (not loaded here yet) is kept."""
    other = Keyring(StaticMasterKey(b"k" * 32), tmp_path / "keys", refresh_s=3600.0, missing_reload_s=3600.0)
    reader = EncryptedTier(HostTier(16 * SLOT, SLOT, prefault=False), other, "t", chunk_bytes=CHUNK, threads=1)
    writer = EncryptedTier(reader.inner, keyring, "t", chunk_bytes=CHUNK, threads=1)
    reader.contains(key(0))  # the reader loads the key store now: epoch 0
    retire_current(keyring)  # epoch 0 retired, epoch 1 current: the reader knows neither yet
    writer.put(key(1), block(1))
    assert not other.retired_any("t")  # (still as loaded: no retirement seen)
    assert reader.contains(key(1)) and reader.lookup_prefix([key(1)]) == 1


# -- an encrypted upper tier in a write-behind store ---------------------------------------------------
def store_over_sealed_host(keyring, blocks: int = 2):
    top = sealed_host(keyring, blocks)
    top.name = "sealed-host"
    below = HostTier(64 * BLOCK, BLOCK, prefault=False)
    below.name = "below"
    return TieredStore([top, below]), top, below


def test_dirty_blocks_evicted_from_an_encrypted_upper_tier_are_demoted(keyring):
    store, _, below = store_over_sealed_host(keyring)
    try:
        keys = [key(i) for i in range(8)]
        assert store.put(keys, [block(i) for i in range(8)]) == [Status.OK] * 8
        store.flush_dirty(10)
        outs = [np.empty(BLOCK, np.uint8) for _ in keys]
        assert store.get(keys, outs, stop_at_miss=False).statuses == [Status.OK] * 8, "an acknowledged block was lost"
        assert all(np.array_equal(out, block(i)) for i, out in enumerate(outs))
        assert store.stats()["store"]["demotions"] >= 6  # the two-block tier evicted the rest before their copy
        assert all(reads_back(below, i) for i in range(8))  # in plaintext, under the block keys
    finally:
        store.close()


def test_a_clean_block_evicted_from_an_encrypted_upper_tier_costs_no_demotion(keyring):
    store, top, _ = store_over_sealed_host(keyring)
    try:
        store.put([key(0)], [block(0)])
        store.flush_dirty(10)
        store.put([key(1), key(2)], [block(1), block(2)])  # the two-block tier evicts key 0, copied already
        stats = store.stats()["store"]
        assert stats["clean_evictions"] >= 1 and stats["demotion_failures"] == 0
        assert not top._keys.get(top.storage_name(key(0)))  # nothing kept for a block it no longer holds
    finally:
        store.close()


def test_an_encrypted_tier_outside_a_store_keeps_no_block_keys(keyring):
    tier = sealed_host(keyring, 2)
    for i in range(4):
        tier.put(key(i), block(i))
    assert tier.on_evict is None and tier._keys == {}


# -- blocks' ages (retention) pass through the encryption ---------------------------------------------
@pytest.mark.parametrize("over", ["disk", "host"])
def test_an_encrypted_tier_passes_each_blocks_age_to_the_tier_below(keyring, tmp_path, over):
    """``created`` reaches the tier below under the storage name (over a disk: streamed; over a host:
    sealed in groups) and ``created_of`` answers by block key; a block already past the TTL below is
    refused there. Control: a put without an age is as old as the put."""
    inner = (DiskTier(tmp_path / "d", 64 * SLOT, ttl_s=60) if over == "disk"
             else HostTier(16 * SLOT, SLOT, ttl_s=60, prefault=False))
    tier = EncryptedTier(inner, keyring, "t", chunk_bytes=CHUNK, threads=1)
    assert tier.keeps_age
    born = time.time() - 30
    assert tier.put(key(1), block(1), created=born) is Status.OK
    assert tier.put_many([key(2), key(3), key(4)], [block(2), block(3), block(4)],
                         created=[born - 1, None, time.time() - 61]) == [Status.OK] * 3
    assert abs(tier.created_of(key(1)) - born) < 0.01
    assert abs(inner.created_of(tier.storage_name(key(1))) - born) < 0.01
    assert abs(tier.created_of(key(2)) - (born - 1)) < 0.01
    assert time.time() - tier.created_of(key(3)) < 5
    assert tier.created_of(key(4)) is None and inner.stats.expirations == 1
    assert all(reads_back(tier, i) for i in (1, 2, 3))
    tier.close()


def test_an_encrypted_upper_tier_demotes_an_expiring_dirty_block_with_its_age(keyring, tmp_path):
    """A sealed DRAM tier whose block expires before its write-behind copy hands it, opened, to the
    tier below with its age (the hook asks the encrypted tier, by block key)."""
    top = EncryptedTier(HostTier(4 * SLOT, SLOT, ttl_s=0.2, prefault=False), keyring, "t",
                        chunk_bytes=CHUNK, threads=1)
    top.name = "sealed-host"
    disk = DiskTier(tmp_path / "d", 64 * SLOT)
    store = TieredStore([top, disk])
    try:
        born = time.time()
        assert top.put(key(1), block(1)) is Status.OK  # in DRAM only, with no dirty mark: no copy
        time.sleep(0.3)
        assert not top.contains(key(1))  # expired: handed to the demotion hook
        assert reads_back(disk, 1) and abs(disk.created_of(key(1)) - born) < 0.2
    finally:
        store.close()
