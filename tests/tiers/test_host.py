import time

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.policy.eviction import PrefixAwareLRUPolicy
from kvtier.tiers.base import Status
from kvtier.tiers.host import HostTier

BLOCK = 4096


def k(i):
    return i.to_bytes(32, "big")


def data(i):
    return np.full(BLOCK, i % 256, np.uint8)


def test_pinned_block_is_never_evicted_or_overwritten():
    t = HostTier(2 * BLOCK, BLOCK)
    t.put(k(1), data(1))
    t.put(k(2), data(2))
    assert t.pin(k(1))
    assert t.put(k(3), data(3)) is Status.OK  # evicts 2, not pinned 1
    assert t.contains(k(1)) and not t.contains(k(2))
    assert t.pin(k(3))
    assert t.put(k(4), data(4)) is Status.FULL  # everything pinned
    t.check_integrity()
    t.unpin(k(1))
    assert t.put(k(4), data(4)) is Status.OK
    assert not t.contains(k(1))
    t.unpin(k(3))
    t.check_integrity()


def test_borrow_gives_a_zero_copy_read_only_view():
    t = HostTier(4 * BLOCK, BLOCK)
    t.put(k(1), data(7))
    with t.borrow(k(1)) as view:
        assert view is not None and view[0] == 7 and view.nbytes == BLOCK
        with pytest.raises(ValueError):
            view[0] = 1
        # while borrowed, delete hides the block but cannot free its slot
        assert t.delete(k(1))
        assert not t.contains(k(1))
        assert view[0] == 7
        t.check_integrity()
    t.check_integrity()
    assert t.used_bytes == 0
    with t.borrow(k(1)) as view:
        assert view is None


def test_ttl_expires_blocks():
    import time

    t = HostTier(4 * BLOCK, BLOCK, ttl_s=0.05)
    t.put(k(1), data(1))
    assert t.contains(k(1))
    time.sleep(0.08)
    assert not t.contains(k(1))
    assert t.stats.expirations == 1
    t.check_integrity()


@pytest.mark.parametrize("ttl_s", [0, -1, float("nan"), float("inf"), True, "60"])
def test_a_ttl_that_is_no_positive_number_is_refused(ttl_s):
    """0 or less expired every block at once, NaN none ever: refused as DiskTier refuses them."""
    with pytest.raises(ConfigError, match="ttl_s"):
        HostTier(4 * BLOCK, BLOCK, ttl_s=ttl_s)
    assert HostTier(4 * BLOCK, BLOCK, ttl_s=None) and HostTier(4 * BLOCK, BLOCK, ttl_s=2)  # controls


def test_a_put_keeps_the_age_it_is_given():
    """``created`` (wall clock: the block's first write into the store) is the block's age here: a
    block older than the TTL is not stored (OK, counted as expired), a younger one expires when
    its TTL runs out from that time, not from this put."""
    t = HostTier(4 * BLOCK, BLOCK, ttl_s=1.0)
    assert t.put(k(1), data(1), created=time.time() - 5) is Status.OK
    assert not t.contains(k(1)) and t.stats.expirations == 1 and t.used_bytes == 0
    born = time.time() - 0.8
    assert t.put_many([k(2), k(3)], [data(2), data(3)], created=[born, None]) == [Status.OK] * 2
    assert abs(t.created_of(k(2)) - born) < 0.01 and abs(t.created_of(k(3)) - time.time()) < 0.05
    time.sleep(0.4)
    assert not t.contains(k(2)), "1.2 s old: past the TTL counted from its first write"
    assert t.contains(k(3)), "control: a block put without an age is 0.4 s old"
    assert t.created_of(k(9)) is None
    t.check_integrity()


def test_expire_frees_expired_blocks_through_the_eviction_hook():
    """expire() frees what has expired without a look-up, each block through ``on_evict`` (a store
    copies a block not yet copied down), counted as expired, not evicted; a pinned one stays."""
    t = HostTier(8 * BLOCK, BLOCK, ttl_s=0.5)
    handed = []
    t.on_evict = lambda key, view, meta: handed.append((key, bytes(view[:1]), t.created_of(key) is not None))
    for i in range(3):
        t.put(k(i), data(i))
    assert t.expire() == 0, "nothing is due yet"
    assert t.pin(k(2))
    time.sleep(0.6)
    t.put(k(5), data(5))  # young: stays
    assert t.expire() == 2
    assert sorted(handed) == [(k(0), b"\x00", True), (k(1), b"\x01", True)], "the victim is still held during the hook"
    assert t.stats.expirations == 2 and t.stats.evictions == 0
    assert set(t.keys()) == {k(2), k(5)}
    t.unpin(k(2))
    assert t.expire() == 1 and set(t.keys()) == {k(5)}
    t.check_integrity()


def test_wrappers_pass_the_age_through():
    """A fault-injecting wrapper keeps ages as the tier it wraps does; a tier that keeps none (the
    null tier) takes the argument and ignores it."""
    from kvtier.tiers.faulty import FaultyTier
    from kvtier.tiers.null import NullTier

    t = FaultyTier(HostTier(4 * BLOCK, BLOCK, ttl_s=60))
    assert t.keeps_age and not NullTier().keeps_age
    born = time.time() - 30
    assert t.put(k(1), data(1), created=born) is Status.OK
    assert t.put(k(2), data(2), created=time.time() - 61) is Status.OK and not t.contains(k(2))
    assert abs(t.created_of(k(1)) - born) < 0.01
    assert NullTier().put(k(1), data(1), created=born) is Status.OK


def test_the_age_queue_stays_bounded_under_churn():
    """Blocks evicted or deleted leave their queue items behind; the queue is rebuilt before those
    outnumber the blocks held (a pool turned over many times within one TTL)."""
    t = HostTier(4 * BLOCK, BLOCK, ttl_s=3600)
    for i in range(2000):
        t.put(k(i), data(i))
        if i % 3 == 0:
            t.delete(k(i))
    assert len(t._ages) <= 2 * 4 + 64 + 1
    t.check_integrity()


def test_too_large_block_is_refused():
    t = HostTier(4 * BLOCK, BLOCK)
    assert t.put(k(1), np.zeros(BLOCK + 1, np.uint8)) is Status.TOO_LARGE


def test_prefix_aware_host_evicts_chain_tail_first():
    t = HostTier(3 * BLOCK, BLOCK, policy=PrefixAwareLRUPolicy())
    chain = [k(i) for i in range(3)]
    t.put_many(chain, [data(i) for i in range(3)])
    evicted = []
    t.on_evict = lambda key, view, meta: evicted.append(key)
    t.put(k(10), data(10))
    assert evicted == [chain[2]]
    assert t.lookup_prefix(chain) == 2


def test_slots_are_page_aligned_for_direct_io():
    t = HostTier(4 * 10_000, 10_000)
    assert t.slot_bytes % 4096 == 0
    t.put(k(1), np.ones(10_000, np.uint8))
    with t.borrow(k(1)) as view:
        assert view.ctypes.data % 4096 == 0


def test_unpin_after_delete_frees_the_slot():
    t = HostTier(2 * BLOCK, BLOCK)
    t.put(k(1), data(1))
    assert t.pin(k(1))
    assert t.delete(k(1))
    t.put(k(1), data(1))  # the same key again, in another slot
    t.check_integrity()
    t.unpin(k(1))  # releases the deleted block's pin: its slot comes back
    t.check_integrity()
    assert t.used_bytes == t.slot_bytes
    assert t.contains(k(1))
    with pytest.raises(ValueError, match="not pinned"):
        t.unpin(k(1))


def test_borrow_runs_merges_only_pool_adjacent_blocks_in_key_order_and_releases_every_pin():
    t = HostTier(8 * BLOCK, BLOCK)
    # Pool order 0, 1, 3, 2: keys 0..1 are adjacent, 2 sits after 3 (a run must split twice).
    for i in (0, 1, 3, 2):
        assert t.put(k(i), data(i)) is Status.OK
    hits, read = t.stats.hits, t.stats.bytes_read
    with t.borrow_runs([k(i) for i in range(5)], BLOCK) as runs:  # key 4 is absent: the run stops there
        assert [r.nbytes // BLOCK for r in runs] == [2, 1, 1]
        got = np.concatenate(runs).reshape(-1, BLOCK)
        assert [int(row[0]) for row in got] == [0, 1, 2, 3], "runs out of key order"
        assert all((row == row[0]).all() for row in got)
        assert not any(r.flags.writeable for r in runs)
        assert (t.stats.hits - hits, t.stats.bytes_read - read) == (4, 4 * BLOCK)
        assert t.delete(k(0)) and not t.contains(k(0))  # deleted while borrowed: hidden at once
        assert t.put(k(5), data(5)) is Status.OK  # and its memory not reused yet
        assert int(runs[0][0]) == 0
    assert t.used_bytes == 4 * BLOCK  # key 0 went with the last unpin
    t.check_integrity()
    with t.borrow_runs([k(9)], BLOCK) as runs:
        assert runs == []
    with t.borrow_runs([k(1)], 2 * BLOCK) as runs:
        assert runs == []  # another size than asked for ends the run
    t.close()


def test_get_many_counts_each_miss_once_and_says_what_get_says():
    """``HostTier.get_many`` finds the misses under one hold of the lock: the same statuses and
    counts as a ``get`` per block (a wrong size is BAD_SIZE, a read-only buffer an error)."""
    import numpy as np

    from kvtier.tiers.base import Status
    from kvtier.tiers.host import HostTier

    nb = 4096
    blocks = {i: np.full(nb, i, np.uint8) for i in range(4)}
    many, one = HostTier(16 * nb, nb), HostTier(16 * nb, nb)
    for tier in (many, one):
        for i in (0, 2):
            assert tier.put(bytes([i]) * 32, blocks[i]) is Status.OK
    keys = [bytes([i]) * 32 for i in (0, 1, 2, 3, 2)]
    outs = [np.zeros(nb, np.uint8) for _ in range(4)] + [np.zeros(nb // 2, np.uint8)]
    twin = [np.zeros_like(out) for out in outs]
    got = many.get_many(keys, outs)
    assert got == [one.get(key, out) for key, out in zip(keys, twin)]
    assert got == [Status.OK, Status.MISS, Status.OK, Status.MISS, Status.BAD_SIZE]
    assert np.array_equal(outs[0], blocks[0]) and np.array_equal(outs[2], blocks[2])
    assert (many.stats.hits, many.stats.misses) == (one.stats.hits, one.stats.misses) == (2, 3)
    frozen = np.zeros(nb, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        many.get_many([bytes([1]) * 32], [frozen])  # a miss, but the buffer is the caller's mistake


@pytest.mark.parametrize("first_fails", [True, False])
def test_a_second_writer_of_a_key_being_written_keeps_its_own_copy(first_fails):
    """A reservation of a key another writer is still filling was answered "nothing to do": when the
    first writer then aborted (torn upload, bad checksum), the second writer's acknowledged block
    was never stored. Now each writer fills its own copy, and the first to commit is the block."""
    t = HostTier(8 * BLOCK, BLOCK)
    status, first = t.reserve(k(1), BLOCK)
    assert status is Status.OK and first is not None
    status, second = t.reserve(k(1), BLOCK)
    assert status is Status.OK and second is not None and second.view.ctypes.data != first.view.ctypes.data
    first.view[:] = 1
    second.view[:] = 1
    assert not t.contains(k(1))  # nothing visible before a commit
    t.check_integrity()
    assert t.commit(second) is True
    if first_fails:
        t.abort(first)
    else:
        assert t.commit(first) is False  # the same bytes are held already: this copy is freed
    out = np.empty(BLOCK, np.uint8)
    assert t.get(k(1), out) is Status.OK and (out == 1).all()
    assert t.used_bytes == BLOCK
    t.check_integrity()


def test_a_rival_of_a_committed_key_is_freed_and_an_aborted_first_writer_leaves_it_to_the_rival():
    t = HostTier(8 * BLOCK, BLOCK)
    _, first = t.reserve(k(1), BLOCK)
    _, second = t.reserve(k(1), BLOCK)
    _, third = t.reserve(k(1), BLOCK)
    t.abort(first)  # the first writer goes: the key is free to be reserved anew
    _, fourth = t.reserve(k(1), BLOCK)
    t.check_integrity()
    for res in (second, third, fourth):
        res.view[:] = 3
    assert [t.commit(third), t.commit(second), t.commit(fourth)] == [True, False, False]
    assert t.contains(k(1)) and t.used_bytes == BLOCK
    assert t.reserve(k(1), BLOCK) == (Status.OK, None)  # held: nothing to do
    t.check_integrity()
    assert t.delete(k(1)) and t.used_bytes == 0
    t.check_integrity()
