"""Background promotion (TieredStore.get(..., promote_in_background=True)): blocks read from a
slower tier reach the faster one later, read again by key, verified, never from the reader's buffer."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest

from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.faulty import Faults, FaultyTier
from kvtier.tiers.host import HostTier

BLOCK = 64 << 10
POISON = 0xFF


def keys_of(n: int, salt: bytes = b"") -> list[bytes]:
    return [hashlib.sha256(salt + i.to_bytes(4, "little")).digest() for i in range(n)]


def blocks_of(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, BLOCK, dtype=np.uint8) for _ in range(n)]  # no 0xFF-only block


def poisoned(n: int) -> list[np.ndarray]:
    return [np.full(BLOCK, POISON, np.uint8) for _ in range(n)]


def on_disk_only(tmp_path, n: int, *, host_blocks: int = 64, below=lambda disk: disk):
    """A store [host, disk] whose disk holds ``n`` blocks and whose host holds none."""
    disk = DiskTier(tmp_path / "disk", 64 << 20)
    keys, blocks = keys_of(n), blocks_of(n)
    assert disk.put_many(keys, blocks) == [Status.OK] * n
    host = HostTier(host_blocks * BLOCK, BLOCK)
    store = TieredStore([host, below(disk)], write_mode="write-through")
    return store, host, disk, keys, blocks


def host_copy(host: HostTier, key: bytes) -> np.ndarray | None:
    out = np.full(BLOCK, POISON, np.uint8)
    return out if host.get(key, out) is Status.OK else None


def test_a_background_promotion_lands_and_equals_the_source_though_the_reader_reused_its_buffers(tmp_path):
    store, host, _, keys, blocks = on_disk_only(tmp_path, 8)
    try:
        outs = poisoned(8)
        result = store.get(keys, outs, promote_in_background=True)
        assert result.loaded == 8 and result.tiers == ["disk"] * 8
        assert all(np.array_equal(o, b) for o, b in zip(outs, blocks))
        for out in outs:  # the reader's buffers are its own again at once
            out[:] = POISON
        assert store.wait_promotions(10.0)
        for key, block in zip(keys, blocks):
            got = host_copy(host, key)
            assert got is not None, "a block read from disk was never promoted"
            assert np.array_equal(got, block), "the promoted copy differs from the source"
        assert store.lookup(keys).tiers == ["host"] * 8
        assert store.stats()["store"]["promotions"] == 8
        store.check_integrity()
    finally:
        store.close()


def test_promotion_waits_for_the_reads_of_a_load_to_end(tmp_path):
    store, host, _, keys, _ = on_disk_only(tmp_path, 4)
    try:
        with store.reading():
            assert store.get(keys, poisoned(4), promote_in_background=True).loaded == 4
            time.sleep(0.2)
            assert host.lookup_prefix(keys) == 0, "a promotion ran while the load was still reading"
        assert store.wait_promotions(10.0)
        assert host.lookup_prefix(keys) == 4
    finally:
        store.close()


def test_a_block_in_promotion_is_invisible_until_verified_and_whole(tmp_path):
    faulty: list[FaultyTier] = []

    def slow(disk):
        faulty.append(FaultyTier(disk))
        faulty[0].name = "disk"
        return faulty[0]

    store, host, _, keys, blocks = on_disk_only(tmp_path, 1, below=slow)
    try:
        assert store.get(keys, poisoned(1), promote_in_background=True).loaded == 1
        faulty[0].faults = Faults(delay_s=0.5)  # the promoter's read of the source is slow
        seen = []
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:  # a reader of the fast tier meanwhile
            got = host_copy(host, keys[0])
            seen.append(got is None or np.array_equal(got, blocks[0]))
        assert all(seen), "a reader saw a half-written promotion"
        assert host_copy(host, keys[0]) is None, "published before its read finished"
        assert store.wait_promotions(10.0)
        assert np.array_equal(host_copy(host, keys[0]), blocks[0])
    finally:
        store.close()


def test_a_block_torn_on_disk_before_its_promotion_is_not_promoted(tmp_path):
    store, host, disk, keys, blocks = on_disk_only(tmp_path, 2)
    try:
        with store.reading():
            assert store.get(keys, poisoned(2), promote_in_background=True).loaded == 2
            path, base = disk.locate(keys[1])  # its own file, or its place in a packed extent
            with open(path, "r+b") as f:  # torn after the read, before the promotion
                f.seek(base + 4096 + 100)
                byte = f.read(1)
                f.seek(base + 4096 + 100)
                f.write(bytes([byte[0] ^ 0x5A]))
        assert store.wait_promotions(10.0)
        assert np.array_equal(host_copy(host, keys[0]), blocks[0])
        assert host_copy(host, keys[1]) is None, "a block that failed verification was promoted"
        assert store.stats()["store"]["promotion_failures"] == 1
        host.check_integrity()  # the aborted reservation left no memory behind
        assert host.used_bytes == BLOCK
    finally:
        store.close()


def test_a_block_deleted_before_or_during_its_promotion_stays_deleted(tmp_path):
    faulty: list[FaultyTier] = []

    def slow(disk):
        faulty.append(FaultyTier(disk))
        faulty[0].name = "disk"
        return faulty[0]

    store, host, _, keys, _ = on_disk_only(tmp_path, 2, below=slow)
    try:
        with store.reading():
            assert store.get(keys, poisoned(2), promote_in_background=True).loaded == 2
            store.delete([keys[0]])  # queued: dropped
        faulty[0].faults = Faults(delay_s=0.3)
        time.sleep(0.1)  # the promoter is now reading keys[1] (slowly)
        deleter = threading.Thread(target=store.delete, args=([keys[1]],))
        deleter.start()
        deleter.join()
        faulty[0].faults = Faults()
        assert store.wait_promotions(10.0)
        assert host.lookup_prefix(keys[:1]) == 0 and not host.contains(keys[1]), "an erased block came back"
        assert store.lookup(keys).hit_blocks == 0
        host.check_integrity()
    finally:
        store.close()


def test_the_promotion_queue_is_bounded_and_counts_what_it_drops(tmp_path):
    disk = DiskTier(tmp_path / "disk", 64 << 20)
    keys, blocks = keys_of(6), blocks_of(6)
    disk.put_many(keys, blocks)
    host = HostTier(64 * BLOCK, BLOCK)
    store = TieredStore([host, disk], write_mode="write-through", promotion_limit_blocks=2)
    try:
        with store.reading():
            assert store.get(keys, poisoned(6), promote_in_background=True).loaded == 6
        assert store.wait_promotions(10.0)
        stats = store.stats()["store"]
        assert stats["promotions_dropped"] == 4
        assert [host.contains(k) for k in keys] == [False] * 4 + [True] * 2  # the newest wait, the oldest go
    finally:
        store.close()


def test_close_with_promotions_waiting_returns_and_closes_the_tiers(tmp_path):
    store, host, _, keys, _ = on_disk_only(tmp_path, 8)
    with store.reading():
        store.get(keys, poisoned(8), promote_in_background=True)
        store.close()  # the load's caller closes mid-load: nothing hangs, nothing is promoted after
    assert store.wait_promotions(0.1)


@pytest.mark.parametrize("background", [False, True])
def test_promotion_after_a_miss_in_the_fast_tier_is_marked_clean_for_write_behind(tmp_path, background):
    disk = DiskTier(tmp_path / "disk", 64 << 20)
    keys, blocks = keys_of(2), blocks_of(2)
    disk.put_many(keys, blocks)
    host = HostTier(2 * BLOCK, BLOCK)  # room for two: a third block evicts one
    store = TieredStore([host, disk])  # write-behind
    try:
        assert store.get(keys, poisoned(2), promote_in_background=background).loaded == 2
        assert store.wait_promotions(10.0)
        assert host.lookup_prefix(keys) == 2
        store.put(keys_of(1, b"new"), blocks_of(1, seed=9))  # evicts a promoted block
        stats = store.stats()["store"]
        assert stats["clean_evictions"] == 1 and stats["demotions"] == 0, "a promoted block was written back"
    finally:
        store.close()
