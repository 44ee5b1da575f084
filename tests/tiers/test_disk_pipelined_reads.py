"""The disk tier's pipelined reads: ``get_many`` (block i+1 read while block i is verified) and the
pieced read of large blocks (two requests in flight, hashed behind them). Every read lands in a
page-aligned buffer poisoned before it, so that these are the direct paths, not the staged ones."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from kvtier.core.payload import HEADER_NBYTES
from kvtier.tiers import direct_io
from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import LAST_PIECE, PAGE, PIECED_MIN, aligned_buffer, read_pieces
from kvtier.tiers.disk import DiskTier
from tests.tiers.test_disk import _flip  # one byte flipped in place

SMALL = 64 * 1024
POISON = 0xA5


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def data(i: int, nbytes: int = SMALL) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def poisoned(nbytes: int) -> np.ndarray:
    out = aligned_buffer(nbytes)
    out.fill(POISON)
    return out


DAMAGES = {
    "payload-bit": lambda p, n: _flip(p, PAGE + n // 2),
    "last-byte": lambda p, n: _flip(p, PAGE + n - 1),
    "header-bit": lambda p, n: _flip(p, 40),
    "record-bit": lambda p, n: _flip(p, HEADER_NBYTES + 9),
    "truncated": lambda p, n: os.truncate(p, PAGE + n // 2),
    "empty": lambda p, n: os.truncate(p, 0),
    "grown": lambda p, n: open(p, "ab").write(b"\0" * PAGE),
}


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(tmp_path / "d", 1 << 30)
    yield t
    t.close()


@pytest.mark.parametrize("nbytes", [SMALL, SMALL + 100, 4096, 1])
def test_get_many_returns_every_block_into_poisoned_buffers(tier, nbytes):
    for i in range(12):
        assert tier.put(k(i), data(i, nbytes)) is Status.OK
    keys = [k(i) for i in range(12)] + [k(99)]  # one absent
    outs = [poisoned(nbytes) for _ in keys]
    statuses = tier.get_many(keys, outs)
    assert statuses == [Status.OK] * 12 + [Status.MISS]
    for i in range(12):
        assert np.array_equal(outs[i], data(i, nbytes)), i
    assert tier.stats.hits == 12 and tier.stats.misses == 1


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_get_many_never_returns_a_damaged_block_and_serves_the_others(tier, damage):
    for i in range(8):
        tier.put(k(i), data(i))
    path = tier.path_of(k(3))
    DAMAGES[damage](path, SMALL)
    outs = [poisoned(SMALL) for _ in range(8)]
    statuses = tier.get_many([k(i) for i in range(8)], outs)
    assert statuses[3] is Status.CORRUPT
    assert statuses[:3] + statuses[4:] == [Status.OK] * 7
    assert all(np.array_equal(outs[i], data(i)) for i in range(8) if i != 3)
    assert tier.stats.verify_failures == 1
    assert not os.path.exists(path) and not tier.contains(k(3))
    tier.check_integrity(deep=True)


def test_get_many_a_block_renamed_onto_another_key_is_corrupt(tier):
    for i in range(4):
        tier.put(k(i), data(i))
    os.replace(tier.path_of(k(1)), tier.path_of(k(2)))
    statuses = tier.get_many([k(i) for i in range(4)], [poisoned(SMALL) for _ in range(4)])
    assert statuses == [Status.OK, Status.MISS, Status.CORRUPT, Status.OK]


def test_get_many_wrong_buffer_size_is_bad_size_and_keeps_the_block(tier):
    tier.put(k(1), data(1))
    tier.put(k(2), data(2))
    outs = [poisoned(SMALL), poisoned(SMALL + PAGE)]
    assert tier.get_many([k(1), k(2)], outs) == [Status.OK, Status.BAD_SIZE]
    assert tier.contains(k(2)) and tier.stats.verify_failures == 0


def test_get_many_a_block_removed_by_another_process_is_a_miss(tier):
    tier.put(k(1), data(1))
    tier.put(k(2), data(2))
    os.unlink(tier.path_of(k(1)))
    assert tier.get_many([k(1), k(2)], [poisoned(SMALL), poisoned(SMALL)]) == [Status.MISS, Status.OK]
    assert not tier.contains(k(1))


def test_get_many_refuses_a_read_only_buffer_before_any_read(tier):
    tier.put(k(1), data(1))
    ro = aligned_buffer(SMALL)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        tier.get_many([k(1), k(1)], [poisoned(SMALL), ro])
    assert tier.stats.hits == 0


def _timeline(tier, monkeypatch) -> list[tuple[str, int, float, float]]:
    """(what, block, start, end) of every file read and every verification of the next get."""
    events: list[tuple[str, int, float, float]] = []
    lock = threading.Lock()
    paths = {tier.path_of(k(i)): i for i in range(8)}
    real_open = direct_io.BlockIO.open_read
    real_judge = DiskTier._judge_read
    real_whole = DiskTier._verified_whole
    real_read = DiskTier._read_verified

    def open_read(self, path):
        t0 = time.perf_counter()
        fd = real_open(self, path)
        with lock:
            events.append(("read", paths[path], t0, t0))
        return fd

    def judge(self, key, dst, job, got):
        t0 = time.perf_counter()
        time.sleep(0.02)  # a slow verification: the next read should not wait for it
        status = real_judge(self, key, dst, job, got)
        with lock:
            events.append(("verify", int.from_bytes(key, "big"), t0, time.perf_counter()))
        return status

    def verified_whole(keys, dsts, jobs, run):  # the fast path: a request's blocks at once
        t0 = time.perf_counter()
        time.sleep(0.02)
        whole = real_whole(keys, dsts, jobs, run)
        with lock:
            events.extend(("verify", int.from_bytes(key, "big"), t0, time.perf_counter()) for key in keys)
        return whole

    def read_verified(self, fd, base, key, dst):
        t0 = time.perf_counter()
        time.sleep(0.02)
        status = real_read(self, fd, base, key, dst)
        with lock:
            events.append(("verify", int.from_bytes(key, "big"), t0, time.perf_counter()))
        return status

    monkeypatch.setattr(direct_io.BlockIO, "open_read", open_read)
    monkeypatch.setattr(DiskTier, "_judge_read", judge)
    monkeypatch.setattr(DiskTier, "_verified_whole", staticmethod(verified_whole))
    monkeypatch.setattr(DiskTier, "_read_verified", read_verified)
    return events


def _reads_during_verification(events) -> int:
    """How many blocks' reads started before the verification of the block before them ended."""
    verify = {i: (a, b) for what, i, a, b in events if what == "verify"}
    return sum(1 for what, i, t, _ in events if what == "read" and i - 1 in verify and t < verify[i - 1][1])


def test_get_many_reads_the_next_block_while_one_is_verified(tier, monkeypatch):
    for i in range(8):
        tier.put(k(i), data(i))
    events = _timeline(tier, monkeypatch)
    outs = [poisoned(SMALL) for _ in range(8)]
    assert tier.get_many([k(i) for i in range(8)], outs) == [Status.OK] * 8
    assert all(np.array_equal(outs[i], data(i)) for i in range(8))
    assert _reads_during_verification(events) >= 6, events
    # Positive control: block by block, no read starts while the block before is verified.
    events.clear()
    assert [tier.get(k(i), o) for i, o in enumerate(outs)] == [Status.OK] * 8
    assert _reads_during_verification(events) == 0, events


def test_a_failing_verification_is_raised_and_leaves_no_helper_behind(tier, monkeypatch):
    for i in range(4):
        tier.put(k(i), data(i))

    def boom(*args):
        raise RuntimeError("verification broke")

    monkeypatch.setattr(DiskTier, "_verified_whole", staticmethod(boom))  # the path whole reads take
    with pytest.raises(RuntimeError, match="verification broke"):
        tier.get_many([k(i) for i in range(4)], [poisoned(SMALL) for _ in range(4)])
    monkeypatch.undo()
    assert tier.get_many([k(i) for i in range(4)], [poisoned(SMALL) for _ in range(4)]) == [Status.OK] * 4


# -- large blocks: shrinking pieces, hashed behind the reads ---------------------------------
LARGE = [PIECED_MIN, 2 * PIECED_MIN + 100, 3 * PIECED_MIN - 5]


@pytest.mark.parametrize("nbytes", LARGE)
def test_read_pieces_cover_the_payload_in_page_aligned_pieces(nbytes):
    pieces = read_pieces(nbytes)
    assert pieces[0][0] == 0 and sum(n for _, n in pieces) == nbytes
    assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))
    assert all(off % PAGE == 0 for off, _ in pieces)
    assert 3 <= len(pieces) <= 6 and pieces[-1][1] <= LAST_PIECE


@pytest.mark.parametrize("nbytes", LARGE)
def test_large_blocks_are_read_in_pieces_into_poisoned_buffers(tier, monkeypatch, nbytes):
    requests: list[int] = []
    real = os.preadv

    def spy(fd, iov, offset):
        requests.append(offset)
        return real(fd, iov, offset)

    monkeypatch.setattr(direct_io.os, "preadv", spy)
    src = data(7, nbytes)
    assert tier.put(k(7), src) is Status.OK
    out = poisoned(nbytes)
    assert tier.get(k(7), out) is Status.OK
    assert np.array_equal(out, src)
    assert len(requests) == len(read_pieces(nbytes))  # the pieced path ran
    requests.clear()
    out2 = poisoned(nbytes)
    assert tier.get_many([k(7)], [out2]) == [Status.OK] and np.array_equal(out2, src)


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_large_block_is_corrupt_and_removed(tier, damage):
    nbytes = 2 * PIECED_MIN + 100
    tier.put(k(1), data(1, nbytes))
    path = tier.path_of(k(1))
    DAMAGES[damage](path, nbytes)
    assert tier.get(k(1), poisoned(nbytes)) is Status.CORRUPT
    assert tier.stats.verify_failures == 1 and not os.path.exists(path)


def test_a_flip_in_the_first_and_in_the_last_piece_are_both_caught(tier):
    nbytes = 2 * PIECED_MIN
    for i, offset in enumerate([PAGE + 1, PAGE + nbytes - LAST_PIECE + 5]):
        tier.put(k(i), data(i, nbytes))
        _flip(tier.path_of(k(i)), offset)
        assert tier.get(k(i), poisoned(nbytes)) is Status.CORRUPT


# -- the store's get reads a disk run with one get_many -------------------------------------
def test_the_store_reads_what_the_host_lacks_with_one_disk_get_many(tmp_path, monkeypatch):
    from kvtier.store.tiered import TieredStore
    from kvtier.tiers.host import HostTier

    disk = DiskTier(tmp_path / "d", 1 << 30)
    for i in range(8):
        disk.put(k(i), data(i))
    calls: list[int] = []
    real = DiskTier.get_many

    def spy(self, keys, outs):
        calls.append(len(keys))
        return real(self, keys, outs)

    monkeypatch.setattr(DiskTier, "get_many", spy)
    with TieredStore([HostTier(1 << 22, SMALL), disk], promote=False) as store:
        store.tiers[0].put(k(0), data(0))
        outs = [poisoned(SMALL) for _ in range(8)]
        result = store.get([k(i) for i in range(8)], outs)
        assert result.loaded == 8 and result.tiers == ["host"] + ["disk"] * 7
        assert all(np.array_equal(outs[i], data(i)) for i in range(8))
        assert calls == [7]  # the seven blocks the host lacks, in one call
        # A block no tier holds ends the usable prefix; what follows is reported a miss.
        disk.delete(k(4))
        result = store.get([k(i) for i in range(8)], [poisoned(SMALL) for _ in range(8)])
        assert result.loaded == 4 and result.statuses[4:] == [Status.MISS] * 4


def test_judging_a_wrong_size_needs_no_second_lease(tier):
    """A size mismatch is judged on the helper from the header page the reader read: with the
    lease pool exhausted by the get itself it must not wait for another lease (a deadlock)."""
    tier._io.close()
    tier._io = direct_io.BlockIO(tier.direct_io, leases=1)
    for i in range(3):
        tier.put(k(i), data(i))
    os.truncate(tier.path_of(k(2)), PAGE + SMALL // 2)
    result: list = []
    outs = [poisoned(SMALL), poisoned(SMALL + PAGE), poisoned(SMALL)]
    worker = threading.Thread(target=lambda: result.append(tier.get_many([k(0), k(1), k(2)], outs)), daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "get_many waited for a lease it holds"
    assert result == [[Status.OK, Status.BAD_SIZE, Status.CORRUPT]]


def test_a_disk_tier_starts_its_verifying_helpers_at_open_not_in_its_first_load(tmp_path):
    def helpers() -> int:
        return sum(t.name.startswith("kvtier-disk") for t in threading.enumerate())

    before = helpers()
    tier = DiskTier(tmp_path / "d", 8 << 20)
    try:
        # the helpers a pipelined get_many hands verification to exist before any get
        assert helpers() - before == tier._io._pool._max_workers >= 2
    finally:
        tier.close()
    assert helpers() == before  # and close stops them


def test_the_last_request_is_judged_on_the_reading_thread_after_the_others(tier, monkeypatch):
    """No hand-off behind the last read: the helper judges the blocks before it (in order), the
    caller the last request's; a lone request needs no helper at all."""
    for i in range(8):
        assert tier.put(k(i), data(i)) is Status.OK  # a file per block: eight requests
    assert tier.put_many([k(i) for i in range(8, 12)], [data(i) for i in range(8, 12)]) == [Status.OK] * 4
    seen: list[tuple[int, str]] = []
    real_whole = DiskTier._verified_whole

    def verified_whole(keys, dsts, jobs, run):  # a request's blocks, verified at once
        seen.extend((int.from_bytes(key, "big"), threading.current_thread().name) for key in keys)
        return real_whole(keys, dsts, jobs, run)

    monkeypatch.setattr(DiskTier, "_verified_whole", staticmethod(verified_whole))
    me = threading.current_thread().name
    outs = [poisoned(SMALL) for _ in range(8)]
    assert tier.get_many([k(i) for i in range(8)], outs) == [Status.OK] * 8
    assert all(np.array_equal(outs[i], data(i)) for i in range(8))
    assert [i for i, _ in seen] == list(range(8))  # in order
    assert [name == me for _, name in seen] == [False] * 7 + [True]
    seen.clear()
    outs = [poisoned(SMALL) for _ in range(4)]  # one packed run: one request
    assert tier.get_many([k(i) for i in range(8, 12)], outs) == [Status.OK] * 4
    assert all(np.array_equal(outs[j], data(8 + j)) for j in range(4))
    assert seen == [(i, me) for i in range(8, 12)]


def test_a_damaged_block_in_the_last_request_is_corrupt_and_the_others_served(tier):
    for i in range(6):
        assert tier.put(k(i), data(i)) is Status.OK
    _flip(tier.path_of(k(5)), PAGE + SMALL // 2)
    outs = [poisoned(SMALL) for _ in range(6)]
    assert tier.get_many([k(i) for i in range(6)], outs) == [Status.OK] * 5 + [Status.CORRUPT]
    assert all(np.array_equal(outs[i], data(i)) for i in range(5))
    assert not tier.contains(k(5))
