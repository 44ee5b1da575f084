"""``HostTier(slabs=False)``: every block a run of whole pages, so the footprint a block is
charged (the server's quotas) is exactly the pool memory it keeps from other blocks.

With slabs, a sub-half-page block is charged one chunk but keeps its whole 64 KiB slab
from reuse while it lives: a tenant keeping one tiny block per slab held ~13x its quota
of the server's pool (tests/server/test_quota_slab_slack.py is the server-side check).
"""

import hashlib

import pytest

from kvtier.tiers.base import Status
from kvtier.tiers.host import PAGE, HostTier
from kvtier.tiers.host_alloc import SLAB_GRANULES

KIB = 1 << 10


def k(i) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def fill(t: HostTier, i, nbytes: int) -> Status:
    status, res = t.reserve(k(i), nbytes)
    if res is not None:
        res.view[:] = 7
        t.commit(res)
    return status


def test_without_slabs_every_block_takes_whole_pages():
    t = HostTier(1024 * KIB, 64 * KIB, prefault=False, slabs=False)
    assert [t.footprint(n) for n in (1, 64, 100, PAGE // 2, PAGE, PAGE + 1)] == [PAGE] * 5 + [2 * PAGE]
    assert t.footprint(64 * KIB) == 64 * KIB and t.slot_bytes == 64 * KIB
    status, res = t.reserve(k("tiny"), 100)
    assert status is Status.OK and res.view.nbytes == 100 and res.view.ctypes.data % PAGE == 0
    t.commit(res)
    assert t.footprint_bytes == PAGE and t.used_bytes == 100
    t.check_integrity()
    # Control: the default pool still packs tiny blocks in size-class chunks.
    with_slabs = HostTier(1024 * KIB, 64 * KIB, prefault=False)
    assert with_slabs.footprint(1) == 64 and with_slabs.footprint(100) == 128
    # A pool of sub-page blocks has cache-line granules either way (no slabs to turn off).
    small = HostTier(10 * 1000, 1000, slabs=False)
    assert small.slot_bytes == 1024 and small.footprint(100) == 128


@pytest.mark.parametrize("slabs", [False, True])
def test_memory_not_charged_to_sparse_tiny_blocks_is_free_for_others(slabs):
    pages = 4 * SLAB_GRANULES
    t = HostTier(pages * PAGE, SLAB_GRANULES * PAGE, prefault=False, slabs=slabs)
    tiny = range(pages)
    for i in tiny:  # without slabs: one page each, the pool is full
        assert fill(t, i, 100) is Status.OK
    for i in tiny:  # keep one block in every stretch of SLAB_GRANULES pages
        if i % SLAB_GRANULES:
            assert t.delete(k(i))
    kept = [i for i in tiny if not i % SLAB_GRANULES]
    charged = sum(t.footprint(100) for _ in kept)
    assert t.footprint_bytes == charged
    # Whatever the kept blocks are not charged for, others may use without evicting them:
    # four blocks of the pages left between them.
    big = (pages - len(kept)) * PAGE // len(kept)
    for j in range(len(kept)):
        assert fill(t, ("big", j), big) is Status.OK
    t.check_integrity()
    if slabs:
        # Why the server runs without slabs: the kept blocks were charged 4 chunks (512 B) and
        # kept a whole 64 KiB slab from reuse, so the blocks that fit in what they were not
        # charged for evicted them.
        assert charged == len(kept) * 128 and t.stats.evictions > 0
        return
    assert charged == len(kept) * PAGE
    assert t.stats.evictions == 0 and all(t.contains(k(i)) for i in kept)
    assert t.footprint_bytes == t.capacity_bytes
