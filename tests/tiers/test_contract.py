"""The contract every tier keeps (see kvtier/tiers/base.py), run on every tier."""

from __future__ import annotations

import random
import sys
import threading
import time

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


def test_a_held_block_survives_delete_reput_and_another_callers_unpin(tier, factory):
    """The eviction race in slow motion: a reader holds a block; someone deletes it and puts
    the same key again (a new copy); a third caller pins and unpins that key. The reader's
    view must stay intact until *its* release: another caller's unpin is not its release."""
    hold, pin, unpin = (getattr(tier, name, None) for name in ("hold", "pin", "unpin"))
    if hold is None or pin is None:
        pytest.skip("the tier has no holds and pins")
    tier.put(key(80), block(80))
    held = hold(key(80))
    assert held is not None
    assert tier.delete(key(80))
    assert tier.put(key(80), block(80)) is Status.OK  # the same key again: a new copy
    assert pin(key(80))  # pins the live copy ...
    unpin(key(80))  # ... and releases that pin, not the reader's hold
    for i in range(81, 81 + 2 * CAPACITY // BLOCK):  # reuse every byte the tier can free
        tier.put(key(i), block(i))
    assert np.array_equal(held.view, block(80)), "a held block was freed by another caller's unpin"
    held.release()
    tier.check_integrity()


# -- the eviction race ------------------------------------------------------------------------
# Larger blocks than the rest of the suite (copies long enough for another thread to
# evict, delete and reuse memory in the middle of one), of four sizes (so that a pool of
# mixed sizes has to find room around pinned blocks), 96 of them: about 3.75x capacity.
RACE_BLOCK = 256 * 1024
RACE_CAPACITY = 16 * RACE_BLOCK
RACE_KEYS = 96
RACE_THREADS = 4
#: per thread: at least RACE_MIN_OPS, more while RACE_SECONDS last (fast tiers race longer)
RACE_MIN_OPS, RACE_MAX_OPS, RACE_SECONDS = 200, 20_000, 1.5
RACE_BASE = 1000
RACE_HOT = (1, 3, 5, 7)


def race_size(i: int) -> int:
    return RACE_BLOCK // 4 * (1 + i % 4)


def _race_worker(tier, blocks, t: int, errors: list[str]) -> None:
    """Random puts, gets, pinned and held reads under eviction pressure, and deletes.

    Even blocks are never deleted, so a block this thread has pinned must read back
    whole; odd ones are deleted often, also while other threads read or hold them.
    """
    rng = random.Random(t)
    pin, unpin, hold = (getattr(tier, name, None) for name in ("pin", "unpin", "hold"))
    outs = {n: np.empty(n, np.uint8) for n in {race_size(i) for i in range(4)}}

    def read(i: int, must_hit: bool, why: str) -> None:
        out = outs[race_size(i)]
        out.fill(0xA5)  # poisoned: a get that reports OK without writing is caught
        status = tier.get(key(RACE_BASE + i), out)
        if status is Status.OK:
            if not np.array_equal(out, blocks[i]):
                errors.append(f"thread {t}: wrong bytes for block {i} ({why})")
        elif status is not Status.MISS or must_hit:
            errors.append(f"thread {t}: get of block {i} ({why}) returned {status.name}")

    def pressure() -> None:  # evict around a pinned / held block while it is in use
        for _ in range(3):
            j = rng.randrange(RACE_KEYS)
            tier.put(key(RACE_BASE + j), blocks[j])

    deadline = time.monotonic() + RACE_SECONDS
    for n in range(RACE_MAX_OPS):
        if n >= RACE_MIN_OPS and time.monotonic() > deadline:
            break
        # a third of the operations on a few hot odd blocks, so that reads and deletes meet
        i = rng.choice(RACE_HOT) if rng.random() < 0.33 else rng.randrange(RACE_KEYS)
        k = key(RACE_BASE + i)
        op = rng.random()
        if op < 0.3:
            status = tier.put(k, blocks[i])
            if status not in (Status.OK, Status.FULL):  # FULL: every evictable block pinned at once
                errors.append(f"thread {t}: put of block {i} returned {status.name}")
        elif op < 0.55:
            read(i, False, "plain")
        elif op < 0.7 and pin is not None:
            if pin(k):
                try:
                    pressure()
                    read(i, i % 2 == 0, "pinned")
                finally:
                    unpin(k)
        elif op < 0.8 and hold is not None:
            held = hold(k)
            if held is not None:
                try:
                    pressure()
                    if i % 2 and rng.random() < 0.5:
                        tier.delete(k)
                    if not np.array_equal(held.view, blocks[i]):
                        errors.append(f"thread {t}: a held view of block {i} changed under eviction")
                finally:
                    held.release()
        elif op < 0.9:
            # delete an odd block and put it back: its memory is freed and reused at once,
            # under any reader of it that does not hold it properly
            j = i | 1
            tier.delete(key(RACE_BASE + j))
            tier.put(key(RACE_BASE + (j + 4) % RACE_KEYS), blocks[(j + 4) % RACE_KEYS])  # same size
            tier.put(key(RACE_BASE + j), blocks[j])
        else:
            ids = [i, (i + 1) % RACE_KEYS, (i + 7) % RACE_KEYS]
            bufs = [np.full(race_size(j), 0x5A, np.uint8) for j in ids]
            for j, status, got in zip(ids, tier.get_many([key(RACE_BASE + j) for j in ids], bufs), bufs):
                if status is Status.OK and not np.array_equal(got, blocks[j]):
                    errors.append(f"thread {t}: get_many returned wrong bytes for block {j}")
                elif status not in (Status.OK, Status.MISS):
                    errors.append(f"thread {t}: get_many of block {j} returned {status.name}")


def test_eviction_race_with_pins_and_holds_never_returns_wrong_bytes(factory, tmp_path):
    """Threads put, read, pin, hold and delete ~4x capacity of distinct blocks at once: every
    read is the exact bytes or a miss, a pinned block is never evicted, a held view never
    changes, and the accounting is intact afterwards."""
    tier = factory.make(tmp_path, RACE_CAPACITY, RACE_BLOCK)
    blocks = [np.random.default_rng(RACE_BASE + i).integers(0, 256, race_size(i), dtype=np.uint8)
              for i in range(RACE_KEYS)]
    assert sum(b.nbytes for b in blocks) >= 3 * RACE_CAPACITY
    errors: list[str] = []
    crashed: list[BaseException] = []

    def run(t: int) -> None:
        try:
            _race_worker(tier, blocks, t, errors)
        except BaseException as exc:  # a tier raising is a failure too; report it, do not hang
            crashed.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(RACE_THREADS)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads far more often than the 5 ms default: more interleavings
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    finally:
        sys.setswitchinterval(interval)
    try:
        assert not any(th.is_alive() for th in threads), "a thread is stuck (deadlock?)"
        assert not crashed, f"a thread raised: {crashed[0]!r}"
        assert errors == [], errors[:10]
        tier.check_integrity()
        if factory.bounded:
            assert tier.used_bytes <= tier.capacity_bytes
            assert tier.stats.evictions > 0, "no eviction happened: the test raced nothing"
        for i, want in enumerate(blocks):  # what is left reads back whole, or not at all
            out = np.full(want.nbytes, 0xA5, np.uint8)
            status = tier.get(key(RACE_BASE + i), out)
            assert status in (Status.OK, Status.MISS), (i, status)
            assert status is not Status.OK or np.array_equal(out, want), f"block {i} reads back wrong"
    finally:
        tier.close()


def test_bounded_reads_holds_for_memory_and_calls_with_a_deadline_not_for_disk(tier, factory):
    """``bounded_reads``: the vLLM connector waits for a small read inside an engine step only
    where a read ends or fails within a known bound. A wrapper (encryption, faults) keeps its
    inner tier's answer; a disk read, which no deadline bounds, never has it."""
    base = factory.name.removeprefix("encrypted-").removeprefix("faulty-")
    assert tier.bounded_reads is (base in {"host", "remote", "mooncake"}), factory.name
