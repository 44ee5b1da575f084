"""Retention (per-tier TTLs) across an embedded TieredStore: host → disk.

A block's age counts from its first write into the store. Moving it between tiers (a promotion on a
read, inline or in the background; the write-behind copy; a demotion on an eviction or an expiry)
carries that age: no move makes a block younger, each tier serves it only while its age is under
that tier's TTL and refuses (counts as expired) one that arrives older. A dirty block that expires in
DRAM before its copy is made goes down if the tier below still admits it, else its drop is counted.
(The audit of s27, R4-R6.)
"""
from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest

from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier
from tests.store.test_writebehind import Recording

BLOCK = 64 * 1024


def key(i: int) -> bytes:
    return hashlib.sha256(f"ttl/{i}".encode()).digest()


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


def got(store: TieredStore, i: int, **kw) -> str | None:
    """The tier that served block i whole (None: a miss)."""
    out = np.full(BLOCK, 0xA5, np.uint8)
    r = store.get([key(i)], [out], **kw)
    return r.tiers[0] if r.loaded == 1 and np.array_equal(out, data(i)) else None


def host(blocks: int, ttl_s) -> HostTier:
    return HostTier(blocks * BLOCK, BLOCK, ttl_s=ttl_s, prefault=False)


def at(t0: float, s: float) -> None:
    time.sleep(max(0.0, t0 + s - time.monotonic()))


# -- R4: a promoted copy keeps the block's age ------------------------------------------------------
@pytest.mark.parametrize("background", [False, True])
def test_a_promoted_block_is_not_served_past_its_ttl(tmp_path, background):
    """Host and disk keep blocks 1 s. A block read from disk at 0.4 s is promoted into DRAM with its
    age: served there while under 1 s (control), never at 1.4 s. Old code: the promoted copy was
    stamped new and served at 1.4 s (and each read could renew it)."""
    store = TieredStore([host(1, 1.0), DiskTier(tmp_path / "d", 64 * BLOCK, ttl_s=1.0)])
    try:
        t0 = time.monotonic()
        assert store.put([key(0)], [data(0)]) == [Status.OK]
        store.flush_dirty(5.0)
        assert store.put([key(1)], [data(1)]) == [Status.OK]  # evicts block 0 from DRAM (clean: no I/O)
        store.flush_dirty(5.0)
        at(t0, 0.4)
        assert got(store, 0, promote_in_background=background) == "disk"
        if background:
            assert store.wait_promotions(5.0)
        assert got(store, 0) == "host", "control: the promoted copy, 0.4 s old, is served from DRAM"
        at(t0, 1.4)
        assert got(store, 0) is None, "a block 1.4 s old was served by a store whose every tier keeps blocks 1 s"
    finally:
        store.close(flush_timeout_s=0)


# -- R5: an evicted, expired block is not demoted to a fresh life below -------------------------------
def failing_once_for_the_flusher(lower: Recording) -> None:
    """The flusher's copy fails once (a disk hiccup): the block stays not-clean in DRAM."""
    fail_once = {"left": 1}
    original = lower.put

    def put(k, d, *, parent=None, meta=None, **age):
        if threading.current_thread().name == "kvtier-writebehind" and fail_once["left"]:
            fail_once["left"] -= 1
            return Status.ERROR
        return original(k, d, parent=parent, meta=meta, **age)

    lower.put = put


@pytest.mark.parametrize("disk_ttl_s", [0.5, 30.0])
def test_an_evicted_expired_block_goes_down_only_within_the_lower_ttl(tmp_path, disk_ttl_s):
    """DRAM keeps blocks 0.5 s. Block 0's write-behind copy failed, so it stays dirty in DRAM past its
    TTL, and the next put evicts it. With the disk keeping blocks 0.5 s too, the demotion carries its
    age (0.7 s): the disk refuses it (counted) and it is never served at 1.1 s (old code: the disk
    stamped it new and served it). With a disk that keeps blocks 30 s (control), it reaches the disk
    and is served from there."""
    disk = DiskTier(tmp_path / "d", 64 * BLOCK, ttl_s=disk_ttl_s)
    lower = Recording(disk)
    failing_once_for_the_flusher(lower)
    store = TieredStore([host(1, 0.5), lower])
    try:
        t0 = time.monotonic()
        assert store.put([key(0)], [data(0)]) == [Status.OK]
        store.flush_dirty(5.0)
        assert not disk.contains(key(0)), "control: the copy failed, only DRAM holds block 0"
        at(t0, 0.7)  # block 0 is past DRAM's TTL (0.5 s)
        assert store.put([key(1)], [data(1)]) == [Status.OK]  # DRAM full: block 0 leaves it
        store.flush_dirty(5.0)
        at(t0, 1.1)
        if disk_ttl_s < 1:
            assert got(store, 0) is None, "a block 1.1 s old, expired in DRAM at 0.5 s, was served from disk"
            assert disk.stats.expirations == 1, "the disk's refusal of an expired block is counted"
        else:
            assert got(store, 0) == "disk", "control: a dirty block within the disk's TTL reaches it"
            assert abs(disk.created_of(key(0)) - (time.time() - (time.monotonic() - t0))) < 0.1, "with its age"
        assert store.tiers[0].stats.expirations >= 1 and store.tiers[0].stats.evictions == 0
    finally:
        store.close(flush_timeout_s=0)


# -- R6: a dirty block expiring in DRAM before its copy -------------------------------------------------
@pytest.mark.parametrize("disk_ttl_s", [None, 0.4])
def test_a_dirty_block_expiring_in_dram_reaches_the_tier_below_or_is_counted(tmp_path, disk_ttl_s):
    """DRAM keeps blocks 0.3 s. Block 1's copy waits behind a slow batch for 0.5 s and expires in DRAM
    meanwhile. A disk without limit still gets it (old code: DRAM's expiry freed it silently and the
    flusher found it gone: in no tier, writebehind_dropped=0). A disk that keeps blocks 0.4 s refuses
    it, at 0.5 s old, and counts it."""
    disk = DiskTier(tmp_path / "d", 64 * BLOCK, ttl_s=disk_ttl_s)
    lower = Recording(disk)
    lower.gate = threading.Event()
    store = TieredStore([host(8, 0.3), lower])
    try:
        assert store.put([key(0)], [data(0)]) == [Status.OK]
        assert lower.flusher_waiting.wait(5.0)  # the flusher is copying block 0, held by a slow disk
        assert store.put([key(1)], [data(1)]) == [Status.OK]  # dirty, waiting behind block 0's batch
        time.sleep(0.5)  # block 1 outlives DRAM's TTL while it waits
        lower.gate.set()
        assert store.flush_dirty(5.0).dropped == 0
        stats = store.stats()
        if disk_ttl_s is None:
            assert disk.contains(key(1)), (
                f"an acknowledged block was never copied below (DRAM's TTL freed it first; "
                f"writebehind_dropped={stats['store']['writebehind_dropped']}); the disk keeps blocks without limit")
            assert got(store, 1) == "disk"
        else:
            assert not disk.contains(key(1))
            assert stats["tiers"]["disk"]["expirations"] >= 1, "the drop of an expired dirty block is counted"
        assert stats["tiers"]["host"]["expirations"] >= 1
    finally:
        store.close(flush_timeout_s=0)


def test_the_write_behind_copy_carries_the_blocks_age(tmp_path):
    """DRAM keeps blocks without limit, the disk 0.6 s. A copy held up 0.8 s carries the block's age:
    the disk refuses it (counted) and DRAM still serves it; a copy made at once lands with the age it
    had in DRAM (control)."""
    disk = DiskTier(tmp_path / "d", 64 * BLOCK, ttl_s=0.6)
    lower = Recording(disk)
    store = TieredStore([host(8, None), lower])
    try:
        assert store.put([key(0)], [data(0)]) == [Status.OK]
        store.flush_dirty(5.0)
        assert disk.contains(key(0)), "control: a young block's copy lands"
        lower.gate = threading.Event()
        assert store.put([key(1)], [data(1)]) == [Status.OK]
        assert lower.flusher_waiting.wait(5.0)
        time.sleep(0.8)
        lower.gate.set()
        store.flush_dirty(5.0)
        assert not disk.contains(key(1)), "a copy 0.8 s old stored by a disk that keeps blocks 0.6 s"
        assert disk.stats.expirations == 1
        assert got(store, 1) == "host"
        assert abs(disk.created_of(key(0)) - store.tiers[0].created_of(key(0))) < 0.05, "control: with its age"
    finally:
        store.close(flush_timeout_s=0)


def test_the_flusher_expires_dram_blocks_without_a_look_up(tmp_path):
    """Expired blocks do not sit in DRAM until something looks them up: the write-behind flusher
    expires them between batches (clean ones are just freed)."""
    store = TieredStore([host(8, 0.5), DiskTier(tmp_path / "d", 64 * BLOCK)])
    try:
        assert store.put([key(0)], [data(0)]) == [Status.OK]
        store.flush_dirty(5.0)
        time.sleep(0.6)
        assert store.put([key(1)], [data(1)]) == [Status.OK]  # wakes the flusher
        store.flush_dirty(5.0)
        deadline = time.monotonic() + 5.0  # (between batches: maybe just after the flush ended)
        while store.tiers[0].used_bytes != BLOCK and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.tiers[0].used_bytes == BLOCK, "block 0 expired and was freed without any look-up"
        assert store.stats()["store"]["clean_evictions"] == 1  # it was on disk already: no I/O
    finally:
        store.close(flush_timeout_s=0)
