"""The write-behind flusher's ``HostTier.expire()`` hands each expired block to the demotion hook
outside the DRAM lock (regression audit of s27, F1).

A dirty block that expires in DRAM is demoted (a lower-tier put: a file write and fsync, a network
call). The sweep used to demote every due block inside one hold of the host lock: with a backlog
behind a slow lower tier, every DRAM read and write of the process waited for all of them (2.46 s in
the audit). Now the due blocks become misses under the lock, are demoted with it released, and are
freed after; a delete of such a key waits for its demotion, as it waits for an eviction's (the
eviction holds the lock), so the copy that lands is deleted with the rest.
"""
from __future__ import annotations

import hashlib
import threading
import time

import numpy as np

from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.faulty import Faults, FaultyTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.wrapper import WrappingTier

B = 64 * 1024


def key(i: int) -> bytes:
    return hashlib.sha256(b"stall/%d" % i).digest()


def block(i: int) -> np.ndarray:
    return np.full(B, i % 251, np.uint8)


class Gated(WrappingTier):
    """The lower tier; ``gate`` (when set) holds every put until opened; ``entered`` says one waits."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.name = inner.name
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def put(self, key, data, *, parent=None, meta=None, **age):
        if self.gate is not None:
            self.entered.set()
            self.gate.wait()
        return self.inner.put(key, data, parent=parent, meta=meta, **age)

    def contains(self, key):
        return self.inner.contains(key)

    def get(self, key, out):
        return self.inner.get(key, out)

    def delete(self, key):
        return self.inner.delete(key)

    def keys(self):
        return self.inner.keys()


def quick(call, limit_s: float = 1.0) -> bool:
    """Whether ``call()`` returns within ``limit_s`` (run on a thread: a stalled one is left behind)."""
    done = threading.Event()
    threading.Thread(target=lambda: (call(), done.set()), daemon=True).start()
    return done.wait(limit_s)


def test_dram_lookups_do_not_wait_for_the_expiry_sweeps_demotions(tmp_path):
    """A burst of 60 dirty blocks the flusher cannot copy within DRAM's TTL (0.5 s; 4 blocks per batch,
    50 ms per lower-tier put): the sweep demotes the expired ones, one put each, while an unrelated DRAM
    look-up never waits long (old code: 2.46 s). Control: the demoted blocks reach the disk with their
    age, and the pool's accounting holds."""
    host = HostTier(128 * B, B, ttl_s=0.5, prefault=False)
    disk = DiskTier(tmp_path / "d", 512 * B, direct_io=False)
    lower = FaultyTier(disk, Faults(delay_s=0.05))  # 50 ms a put
    store = TieredStore([host, lower], writebehind_batch_blocks=4)
    try:
        t0 = time.monotonic()
        born = time.time()
        assert store.put([key(i) for i in range(60)], [block(i) for i in range(60)]) == [Status.OK] * 60
        worst = 0.0
        while time.monotonic() < t0 + 3.5:
            s = time.monotonic()
            host.contains(key(10_000))  # an unrelated DRAM look-up (a miss)
            worst = max(worst, time.monotonic() - s)
            time.sleep(0.005)
        assert store.flush_dirty(10.0).dropped == 0
        demoted = store.stats()["store"]["demotions"]
        assert demoted > 10, "control: the sweep demoted the expired dirty blocks"
        assert worst < 0.5, f"a DRAM look-up waited {worst:.2f} s behind the expiry sweep's demotions"
        for i in range(60):  # every acknowledged block is below (copied or demoted), with its age
            assert disk.contains(key(i)), f"block {i} was lost"
            assert abs(disk.created_of(key(i)) - born) < 0.3, f"block {i} went down without its age"
        host.check_integrity()
        assert host.used_bytes == 0 and host.stats.expirations == 60
    finally:
        store.close(flush_timeout_s=0)


def test_a_delete_waits_for_the_expiry_demotion_of_its_key(tmp_path):
    """A block expires in DRAM before any copy of it (written straight into the host pool, as the
    server writes): the sweep demotes it, the lower tier's put held up. Meanwhile DRAM answers at once
    (the block is a miss there), and a delete of the block waits for the demotion, then removes the
    copy it landed: the erased block is in no tier (a delete that went by would have left the copy)."""
    host = HostTier(8 * B, B, ttl_s=0.2, prefault=False)
    disk = DiskTier(tmp_path / "d", 64 * B, direct_io=False)
    lower = Gated(disk)
    store = TieredStore([host, lower])
    gate = lower.gate = threading.Event()
    try:
        assert host.put(key(0), block(0)) is Status.OK and host.put(key(1), block(1)) is Status.OK
        time.sleep(0.3)
        sweep = threading.Thread(target=host.expire)
        sweep.start()
        assert lower.entered.wait(5.0), "the sweep demotes the expired blocks"
        assert quick(lambda: host.contains(key(5))), "a DRAM look-up waited for the demotion's put"
        assert not host.contains(key(0)) and not host.contains(key(1)), "expired: misses at once"
        removed = []
        deleting = threading.Thread(target=lambda: removed.append(store.delete([key(0)])))
        deleting.start()
        time.sleep(0.2)
        assert deleting.is_alive(), "the delete waits for the demotion of its key"
        gate.set()
        sweep.join(5.0)
        deleting.join(5.0)
        assert removed == [1], "the copy the demotion landed was deleted"
        assert not disk.contains(key(0)), "an erased block came back below DRAM"
        out = np.empty(B, np.uint8)
        assert store.get([key(0)], [out]).loaded == 0
        assert disk.contains(key(1)), "control: the other expired block went down"
        host.check_integrity()
        assert host.used_bytes == 0, "the demoted blocks' memory is freed"
        assert store.stats()["store"]["demotions"] == 2
    finally:
        gate.set()
        store.close(flush_timeout_s=0)


def test_a_put_of_a_key_being_demoted_stores_it_anew(tmp_path):
    """While the sweep demotes an expired block (outside the lock), the key is a miss in DRAM: a put of
    it stores a fresh copy there, which the sweep's end does not free."""
    host = HostTier(8 * B, B, ttl_s=0.2, prefault=False)
    lower = Gated(DiskTier(tmp_path / "d", 64 * B, direct_io=False))
    store = TieredStore([host, lower])
    gate = lower.gate = threading.Event()
    try:
        assert host.put(key(0), block(0)) is Status.OK
        time.sleep(0.3)
        sweep = threading.Thread(target=host.expire)
        sweep.start()
        assert lower.entered.wait(5.0)
        stored = []
        assert quick(lambda: stored.append(host.put(key(0), block(0)))), "a DRAM put waited for the demotion"
        assert stored == [Status.OK] and host.contains(key(0))
        host.check_integrity()
        gate.set()
        sweep.join(5.0)
        out = np.empty(B, np.uint8)
        assert host.get(key(0), out) is Status.OK and (out == 0).all()
        assert host.used_bytes == B
        host.check_integrity()
    finally:
        gate.set()
        store.close(flush_timeout_s=0)
