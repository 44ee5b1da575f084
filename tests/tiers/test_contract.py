"""The contract every tier keeps (see kvtier/tiers/base.py), run on every tier."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvtier.tiers.base import Status
from tests.tiers.factories import FACTORIES

BLOCK = 64 * 1024
CAPACITY = 16 * BLOCK


@pytest.fixture(params=FACTORIES, ids=[f.name for f in FACTORIES])
def factory(request):
    return request.param


@pytest.fixture
def tier(factory, tmp_path):
    t = factory.make(tmp_path, CAPACITY, BLOCK)
    yield t
    t.close()


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def block(i: int, nbytes: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def test_put_then_get_returns_the_same_bytes(tier, factory):
    assert tier.put(key(1), block(1)) is Status.OK
    out = np.zeros(BLOCK, np.uint8)
    status = tier.get(key(1), out)
    tier.check_integrity()
    if not factory.retains:
        assert status is Status.MISS
        return
    assert status is Status.OK
    assert np.array_equal(out, block(1))
    assert tier.contains(key(1))
    assert tier.stats.hits >= 1 and tier.stats.bytes_read >= BLOCK


def test_missing_key_is_a_miss_not_an_exception(tier):
    out = np.zeros(BLOCK, np.uint8)
    assert tier.get(key(99), out) is Status.MISS
    assert not tier.contains(key(99))
    assert tier.stats.misses >= 1
    tier.check_integrity()


def test_caller_keeps_ownership_of_put_buffer(tier, factory):
    data = block(2).copy()
    tier.put(key(2), data)
    data[:] = 0  # the tier must have taken a copy
    out = np.zeros(BLOCK, np.uint8)
    if factory.retains:
        assert tier.get(key(2), out) is Status.OK
        assert np.array_equal(out, block(2))


def test_put_of_existing_key_is_an_ok_noop(tier, factory):
    assert tier.put(key(3), block(3)) is Status.OK
    used = tier.used_bytes
    assert tier.put(key(3), block(3)) is Status.OK
    assert tier.used_bytes == used
    tier.check_integrity()


def test_wrong_size_buffer_is_refused(tier, factory):
    tier.put(key(4), block(4))
    out = np.zeros(BLOCK // 2, np.uint8)
    assert tier.get(key(4), out) is not Status.OK


def test_delete(tier, factory):
    tier.put(key(5), block(5))
    assert tier.delete(key(5)) is factory.retains
    assert tier.get(key(5), np.zeros(BLOCK, np.uint8)) is Status.MISS
    assert tier.delete(key(5)) is False
    tier.check_integrity()


def test_lookup_prefix_stops_at_first_gap(tier, factory):
    keys = [key(10 + i) for i in range(5)]
    assert tier.put_many(keys, [block(10 + i) for i in range(5)]) == [Status.OK] * 5
    if not factory.retains:
        assert tier.lookup_prefix(keys) == 0
        return
    assert tier.lookup_prefix(keys) == 5
    tier.delete(keys[2])
    assert tier.lookup_prefix(keys) == 2
    assert tier.contains_many(keys) == [True, True, False, True, True]
    tier.check_integrity()


def test_batch_get_reports_per_key_status(tier, factory):
    tier.put(key(20), block(20))
    outs = [np.zeros(BLOCK, np.uint8) for _ in range(3)]
    statuses = tier.get_many([key(20), key(21), key(20)], outs)
    if factory.retains:
        assert statuses == [Status.OK, Status.MISS, Status.OK]
        assert np.array_equal(outs[2], block(20))
    else:
        assert statuses == [Status.MISS] * 3


def test_keys_lists_what_is_held(tier, factory):
    if not factory.lists_keys:
        pytest.skip("tier names are one-way")
    ks = [key(30 + i) for i in range(3)]
    tier.put_many(ks, [block(30 + i) for i in range(3)])
    assert set(tier.keys()) == (set(ks) if factory.retains else set())


def test_capacity_is_respected_with_eviction(tier, factory):
    if not factory.bounded:
        pytest.skip("tier does not bound its capacity")
    n = CAPACITY // BLOCK * 2
    for i in range(n):
        assert tier.put(key(100 + i), block(100 + i)) is Status.OK
        assert tier.used_bytes <= tier.capacity_bytes
        tier.check_integrity()
    assert tier.stats.evictions >= n // 2 - 1
    # The most recent block survives and reads back intact.
    out = np.zeros(BLOCK, np.uint8)
    assert tier.get(key(100 + n - 1), out) is Status.OK
    assert np.array_equal(out, block(100 + n - 1))


def test_eviction_hook_sees_victim_bytes_before_free(tier, factory):
    if not factory.bounded or not factory.reports_evictions:
        pytest.skip("tier does not report evictions")
    seen: dict[bytes, bool] = {}

    def hook(k, view, meta):
        i = int.from_bytes(k[:4], "big")
        seen[k] = np.array_equal(np.frombuffer(view, np.uint8), block(i))

    tier.on_evict = hook
    for i in range(CAPACITY // BLOCK + 4):
        tier.put(key(200 + i), block(200 + i))
    assert seen, "no eviction reported"
    assert all(seen.values()), "a hook saw bytes that were not the victim's"
    for k in seen:
        assert not tier.contains(k)


def test_concurrent_puts_and_gets_never_return_wrong_bytes(tier, factory):
    errors: list[str] = []

    def worker(t: int) -> None:
        out = np.zeros(BLOCK, np.uint8)
        for j in range(30):
            i = 300 + (t * 7 + j) % 12
            tier.put(key(i), block(i))
            status = tier.get(key(i), out)
            if status is Status.OK and not np.array_equal(out, block(i)):
                errors.append(f"thread {t} read wrong bytes for block {i}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    tier.check_integrity()


def test_a_read_only_output_buffer_is_a_caller_mistake(tier, factory):
    """It raises before any I/O, and the tier keeps working (a remote one is not put into backoff)."""
    if not factory.retains:
        pytest.skip("the tier holds nothing to copy out")
    data = np.arange(BLOCK, dtype=np.uint8)
    assert tier.put(key(70), data) is Status.OK
    frozen = np.zeros(BLOCK, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        tier.get(key(70), frozen)
    with pytest.raises(ValueError, match="read-only"):
        tier.get_many([key(70)], [frozen])
    out = np.zeros(BLOCK, np.uint8)
    assert tier.get(key(70), out) is Status.OK and np.array_equal(out, data)
