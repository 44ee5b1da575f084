"""The disk tier beyond the shared contract: files, crashes, restarts, sharing, full disks."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.payload import HEADER_NBYTES, BlockMeta
from kvtier.errors import ConfigError, TierError
from kvtier.policy.eviction import PrefixAwareLRUPolicy
from kvtier.tiers import direct_io
from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import PAGE, aligned_buffer, temp_tag
from kvtier.tiers.disk import MAX_ANNOTATION, BlockRecord, DiskTier
from tests.tiers.disk_writer import content_of, key_of, size_of
from tests.tmpfs import mounted_tmpfs

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16 * 1024
ON_DISK = PAGE + BLOCK  # a block file: header page + payload


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def data(i: int, nbytes: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def read(tier: DiskTier, key: bytes, nbytes: int = BLOCK) -> tuple[Status, np.ndarray]:
    out = np.zeros(nbytes, np.uint8)
    return tier.get(key, out), out


def temp_files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*.tmp")]


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(tmp_path / "d", 64 * ON_DISK)
    yield t
    t.close()


# -- format and buffers ---------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 100_000, (5 << 20) + 3])
def test_any_size_round_trips_from_aligned_and_unaligned_buffers(tmp_path, nbytes):
    with DiskTier(tmp_path, 64 << 20) as t:
        want = data(nbytes, nbytes)
        aligned = aligned_buffer(nbytes)
        aligned[:] = want
        unaligned = np.empty(nbytes + 1, np.uint8)[1:]  # numpy memory is never page aligned at +1
        unaligned[:] = want
        for i, src in enumerate((aligned, unaligned)):
            assert t.put(k(i), src) is Status.OK
            for out in (aligned_buffer(nbytes), np.zeros(nbytes + 1, np.uint8)[1:]):
                out[:] = 0
                assert t.get(k(i), out) is Status.OK
                assert np.array_equal(out, want)
        size = os.path.getsize(t.path_of(k(0)))
        assert size == PAGE + -(-nbytes // PAGE) * PAGE
        t.check_integrity(deep=True)


def test_buffered_fallback_keeps_the_same_format(tmp_path):
    with DiskTier(tmp_path, 1 << 20, direct_io=False) as t:
        assert t.direct_io is False
        t.put(k(1), data(1))
    with DiskTier(tmp_path, 1 << 20) as t:  # reopened with O_DIRECT where supported
        status, out = read(t, k(1))
        assert status is Status.OK and np.array_equal(out, data(1))


def test_o_direct_is_really_used_where_the_probe_says_it_works(tmp_path, monkeypatch):
    """Every block file the tier writes or reads is opened with O_DIRECT (as the kernel reports
    it for the open file, F_GETFL) when the probe says the file system takes it; buffered otherwise."""
    import fcntl

    supported = direct_io.probe_direct_io(str(tmp_path))
    opened: list[tuple[str, bool]] = []  # (write or read, O_DIRECT set on the open file)
    for kind in ("open_write", "open_read"):
        real = getattr(direct_io.BlockIO, kind)

        def spy(self, path, _real=real, _kind=kind):
            fd = _real(self, path)
            opened.append((_kind, bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
            return fd

        monkeypatch.setattr(direct_io.BlockIO, kind, spy)
    with DiskTier(tmp_path / "d", 1 << 20) as t:
        assert t.direct_io is supported
        aligned = aligned_buffer(BLOCK)
        aligned[:] = data(1)
        assert t.put(k(1), aligned) is Status.OK
        assert t.put(k(2), data(2)) is Status.OK  # numpy memory: staged through aligned buffers
        out = aligned_buffer(BLOCK)
        assert t.get(k(1), out) is Status.OK and np.array_equal(out, data(1))
        assert read(t, k(2))[0] is Status.OK
    assert {kind for kind, _ in opened} == {"open_write", "open_read"}
    assert all(direct is supported for _, direct in opened), opened


def test_o_direct_probe_falls_back_or_refuses(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", no_direct)
    with DiskTier(tmp_path / "a", 1 << 20) as t:
        assert t.direct_io is False
        assert t.put(k(1), data(1)) is Status.OK
        assert read(t, k(1))[0] is Status.OK
    with pytest.raises(TierError, match="direct_io='auto'"):
        DiskTier(tmp_path / "b", 1 << 20, direct_io=True)


def test_invalid_configuration_names_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="capacity_bytes"):
        DiskTier(tmp_path, 0)
    with pytest.raises(ConfigError, match="ttl_s"):
        DiskTier(tmp_path, 1 << 20, ttl_s=-1)
    with pytest.raises(ConfigError, match="direct_io"):
        DiskTier(tmp_path, 1 << 20, direct_io="yes")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(TierError, match="writable directory"):
        DiskTier(tmp_path / "file", 1 << 20)
    with DiskTier(tmp_path / "d", 1 << 20) as t:
        with pytest.raises(ValueError, match="32-byte"):
            t.put(b"short", data(1))
        with pytest.raises(ValueError, match="writable"):
            t.get(k(1), bytes(BLOCK))


def test_block_larger_than_capacity_is_too_large(tmp_path):
    with DiskTier(tmp_path, 4 * PAGE) as t:
        assert t.put(k(1), data(1)) is Status.TOO_LARGE
        assert t.stats.put_failures == 1
        t.check_integrity()


def test_wrong_buffer_size_is_bad_size_and_keeps_the_block(tier):
    tier.put(k(1), data(1))
    assert read(tier, k(1), BLOCK + PAGE)[0] is Status.BAD_SIZE  # other file size
    assert read(tier, k(1), BLOCK - 1)[0] is Status.BAD_SIZE  # same page count
    assert read(tier, k(1))[0] is Status.OK
    assert tier.stats.verify_failures == 0


# -- never wrong: torn, corrupt, truncated, renamed -------------------------------------
def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: _flip(p, PAGE + BLOCK // 2), id="payload-bit"),
        pytest.param(lambda p: _flip(p, 40), id="header-bit"),
        pytest.param(lambda p: _flip(p, HEADER_NBYTES + 9), id="record-bit"),  # the parent link
        pytest.param(lambda p: os.truncate(p, PAGE + BLOCK // 2), id="truncated-mid-page"),
        pytest.param(lambda p: os.truncate(p, PAGE + PAGE), id="truncated-to-a-page"),
        pytest.param(lambda p: os.truncate(p, 0), id="empty"),
        pytest.param(lambda p: open(p, "ab").write(b"\0" * PAGE), id="grown"),
    ],
)
def test_damaged_file_is_corrupt_counted_and_removed(tier, damage):
    tier.put(k(1), data(1))
    path = tier.path_of(k(1))
    damage(path)
    status, _ = read(tier, k(1))
    assert status is Status.CORRUPT
    assert tier.stats.verify_failures == 1
    assert not os.path.exists(path)
    assert not tier.contains(k(1))
    assert tier.put(k(1), data(1)) is Status.OK  # and it can be stored again
    assert read(tier, k(1))[0] is Status.OK
    tier.check_integrity(deep=True)


def test_block_renamed_onto_another_key_is_corrupt(tier):
    tier.put(k(1), data(1))
    tier.put(k(2), data(2))
    os.replace(tier.path_of(k(1)), tier.path_of(k(2)))  # k(2)'s name now holds k(1)'s bytes
    assert read(tier, k(2))[0] is Status.CORRUPT
    assert read(tier, k(1))[0] is Status.MISS
    tier.check_integrity(deep=True)


def test_a_failed_write_leaves_neither_a_block_nor_a_temp_file(tier, monkeypatch):
    tier.put(k(1), data(1))

    def crash(fd):
        raise OSError(errno.EIO, "injected I/O error")

    monkeypatch.setattr(direct_io.os, "fsync", crash)
    assert tier.put(k(2), data(2)) is Status.ERROR
    monkeypatch.undo()
    assert not os.path.exists(tier.path_of(k(2)))
    assert temp_files(Path(tier.path)) == []
    assert read(tier, k(1))[0] is Status.OK
    assert tier.stats.errors == 1 and tier.stats.put_failures == 1
    tier.check_integrity(deep=True)


# -- restart recovery ---------------------------------------------------------------------
def test_restart_finds_every_published_block(tmp_path):
    sizes = {i: 1000 * i + 1 for i in range(1, 30)}
    with DiskTier(tmp_path, 64 << 20) as t:
        for i, n in sizes.items():
            assert t.put(k(i), data(i, n)) is Status.OK
        used = t.used_bytes
    with DiskTier(tmp_path, 64 << 20) as t:
        assert set(t.keys()) == {k(i) for i in sizes}
        assert t.used_bytes == used
        for i, n in sizes.items():
            status, out = read(t, k(i), n)
            assert status is Status.OK and np.array_equal(out, data(i, n))
        t.check_integrity(deep=True)


def test_restart_keeps_publication_order_for_lru(tmp_path):
    with DiskTier(tmp_path, 3 * ON_DISK) as t:
        for i in range(3):
            t.put(k(i), data(i))
            os.utime(t.path_of(k(i)), (1000 + i, 1000 + i))  # distinct mtimes, oldest first
    with DiskTier(tmp_path, 3 * ON_DISK) as t:
        evicted = []
        t.on_evict = lambda key, view, meta: evicted.append(key)
        t.put(k(3), data(3))
        assert evicted == [k(0)]


def test_restart_removes_dead_writers_temp_files_only(tmp_path):
    with DiskTier(tmp_path, 1 << 20) as t:
        t.put(k(1), data(1))
        shard = Path(t.path_of(k(1))).parent
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    host = temp_tag().split(".", 2)[2]
    dead_tmp = shard / f".{k(2).hex()}.abcd1234.{dead_pid}.{host}.tmp"
    live_tmp = shard / f".{k(3).hex()}.abcd1234.{os.getppid()}.{host}.tmp"  # our parent is alive
    old_remote = shard / f".{k(4).hex()}.abcd1234.1.some-other-node.tmp"
    fresh_remote = shard / f".{k(5).hex()}.abcd1234.1.some-other-node.tmp"
    foreign = shard / "README"
    for p in (dead_tmp, live_tmp, old_remote, fresh_remote, foreign):
        p.write_bytes(b"partial")
    os.utime(old_remote, (time.time() - 7200, time.time() - 7200))
    with DiskTier(tmp_path, 1 << 20) as t:
        assert not dead_tmp.exists() and not old_remote.exists()
        assert live_tmp.exists() and fresh_remote.exists() and foreign.exists()
        assert set(t.keys()) == {k(1)}


def test_restart_drops_implausible_files(tmp_path):
    with DiskTier(tmp_path, 1 << 20) as t:
        t.put(k(1), data(1))
        t.put(k(2), data(2))
        os.truncate(t.path_of(k(2)), 100)  # not a whole number of pages: never a block of ours
    with DiskTier(tmp_path, 1 << 20) as t:
        assert set(t.keys()) == {k(1)}
        assert t.stats.verify_failures == 1
        t.check_integrity(deep=True)


# -- shared directories ---------------------------------------------------------------
def test_blocks_written_by_another_tier_on_the_same_directory_are_found(tmp_path):
    with DiskTier(tmp_path, 1 << 20) as a, DiskTier(tmp_path, 1 << 20) as b:
        a.put_many([k(1), k(2)], [data(1), data(2)])
        assert b.used_bytes == 0
        assert b.lookup_prefix([k(1), k(2), k(3), k(4)]) == 2
        status, out = read(b, k(2))
        assert status is Status.OK and np.array_equal(out, data(2))
        assert b.put(k(1), data(1)) is Status.OK and b.stats.puts == 0  # already there: no write
        assert b.used_bytes == 2 * ON_DISK
        a.delete(k(1))
        assert read(b, k(1))[0] is Status.MISS  # gone under b's index: a miss, forgotten
        b.check_integrity()
        a.check_integrity()


def test_processes_writing_the_same_keys_at_once_stay_correct(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.tiers.disk_writer", str(tmp_path), "--keys", "40", "--seed", str(s), "--wait"],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for s in range(3)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:  # release them together
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    assert not (tmp_path / "WRONG").exists()
    assert temp_files(tmp_path) == []
    with DiskTier(tmp_path, 1 << 30) as t:
        assert len(list(t.keys())) == 40
        for i in range(40):
            out = np.empty(size_of(key_of(i)), np.uint8)
            assert t.get(key_of(i), out) is Status.OK
            assert np.array_equal(out, content_of(key_of(i)))
        t.check_integrity(deep=True)


# -- disk full -------------------------------------------------------------------------
def test_enospc_mid_write_fails_cleanly(tier, monkeypatch):
    for i in range(3):
        tier.put(k(i), data(i))
    real = direct_io.pwrite_all
    calls = []

    def fill_up(fd, buf, offset):
        calls.append(offset)
        if len(calls) > 1:  # the first write lands, then the medium is full
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, buf, offset)

    monkeypatch.setattr(direct_io, "pwrite_all", fill_up)
    assert tier.put(k(9), data(9, 3 * BLOCK + 5)) is Status.FULL
    monkeypatch.undo()
    assert tier.stats.put_failures == 1 and tier.stats.errors == 0
    assert temp_files(Path(tier.path)) == []
    assert not tier.contains(k(9))
    for i in range(3):
        status, out = read(tier, k(i))
        assert status is Status.OK and np.array_equal(out, data(i))
    tier.check_integrity(deep=True)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "mnt", "2m") as mnt:
        yield mnt


def test_a_real_full_file_system_fails_puts_cleanly(tiny_tmpfs):
    # Capacity far above the medium: the file system, not the tier, runs out. A put then evicts to
    # make room (tests/tiers/test_disk_full.py); with every block pinned nothing can be: FULL.
    with DiskTier(tiny_tmpfs, 64 << 20) as t:
        n = 256 * 1024 + 100
        stored, status = [], Status.OK
        for i in range(40):
            status = t.put(k(i), data(i, n))
            if status is not Status.OK:
                break
            assert t.pin(k(i))
            stored.append(i)
        assert status is Status.FULL
        assert 2 <= len(stored) < 40
        assert t.stats.put_failures == 1
        assert temp_files(tiny_tmpfs) == []
        for i in stored:
            got, out = read(t, k(i), n)
            assert got is Status.OK and np.array_equal(out, data(i, n))
        t.check_integrity(deep=True)
        t.delete(k(stored[0]))  # room again
        assert t.put(k(99), data(99, n)) is Status.OK


# -- TTL, eviction, pins -----------------------------------------------------------------
def test_ttl_expires_blocks_in_process_and_across_restarts(tmp_path):
    with DiskTier(tmp_path, 1 << 20, ttl_s=0.2) as t:
        t.put(k(1), data(1))
        assert t.contains(k(1))
        time.sleep(0.25)
        assert read(t, k(1))[0] is Status.MISS
        assert t.stats.expirations == 1
        assert not os.path.exists(t.path_of(k(1)))
        t.put(k(2), data(2))
        t.put(k(3), data(3))
        os.utime(t.path_of(k(2)), (time.time() - 60, time.time() - 60))
        t.check_integrity()
    with DiskTier(tmp_path, 1 << 20, ttl_s=30) as t:
        assert set(t.keys()) == {k(3)}
        assert t.stats.expirations == 1


def test_expire_sweeps_without_access(tmp_path):
    with DiskTier(tmp_path, 1 << 20, ttl_s=0.1) as t:
        t.put_many([k(1), k(2)], [data(1), data(2)])
        assert t.pin(k(2))
        time.sleep(0.15)
        assert t.expire() == 1  # the pinned one stays
        assert set(t.keys()) == {k(2)}
        t.unpin(k(2))
        t.check_integrity(deep=True)


@pytest.mark.parametrize("ttl_s", [0, -1, float("nan"), float("inf"), "60"])
def test_a_ttl_that_is_no_positive_number_is_refused(tmp_path, ttl_s):
    with pytest.raises(ConfigError, match="ttl_s"):
        DiskTier(tmp_path, 1 << 20, ttl_s=ttl_s)


def test_a_put_keeps_the_age_it_is_given_across_restarts(tmp_path):
    """``created`` (the block's first write into the store, wall clock) is its age here and in its
    file's mtime, so a restart reads the same age; a block already past the TTL is not written (OK,
    counted as expired). Control: a put without an age is as old as its publication."""
    born = time.time() - 40
    with DiskTier(tmp_path, 1 << 20, ttl_s=60) as t:
        assert t.put(k(1), data(1), created=born) is Status.OK
        assert t.put(k(2), data(2)) is Status.OK
        assert t.put(k(3), data(3), created=time.time() - 61) is Status.OK
        assert not t.contains(k(3)) and not os.path.exists(t.path_of(k(3))) and t.stats.expirations == 1
        assert abs(t.created_of(k(1)) - born) < 0.01 and abs(os.stat(t.path_of(k(1))).st_mtime - born) < 0.01
        assert time.time() - t.created_of(k(2)) < 5
        t.check_integrity(deep=True)
    with DiskTier(tmp_path, 1 << 20, ttl_s=60) as t:
        assert abs(t.created_of(k(1)) - born) < 0.01, "the age read back at a restart is the one given"
    with DiskTier(tmp_path, 1 << 20, ttl_s=30) as t:  # a shorter retention: the 40 s old block goes
        assert set(t.keys()) == {k(2)}


def test_a_batch_keeps_each_blocks_age_and_its_extent_the_oldest(tmp_path):
    """A packed batch: each block keeps its own age while indexed; the extent's one mtime (every
    name links to it) is the oldest block's, so after a restart none outlives its TTL. A block older
    than PACK_AGE_MAX_S goes as a file of its own (an extent that old looks like a dead writer's to a
    restart in another process)."""
    from kvtier.tiers.disk_writes import PACK_AGE_MAX_S

    now = time.time()
    ages = [now - 5, now - 1, None, now - PACK_AGE_MAX_S - 5]
    with DiskTier(tmp_path, 1 << 20, ttl_s=3600) as t:
        assert t.put_many([k(i) for i in range(4)], [data(i) for i in range(4)], created=ages) == [Status.OK] * 4
        extent = t.locate(k(0))[0]
        assert t.locate(k(1))[0] == extent == t.locate(k(2))[0] != t.path_of(k(0))
        assert t.locate(k(3))[0] == t.path_of(k(3)), "an old block is a file of its own"
        assert abs(t.created_of(k(1)) - ages[1]) < 0.01 and t.created_of(k(2)) >= now
        assert abs(os.stat(extent).st_mtime - ages[0]) < 0.01
        assert abs(os.stat(t.path_of(k(3))).st_mtime - ages[3]) < 0.01
        with pytest.raises(ValueError, match="creation times"):
            t.put_many([k(7), k(8)], [data(7), data(8)], created=[now])
        t.check_integrity(deep=True)
    with DiskTier(tmp_path, 1 << 20, ttl_s=3600) as t:
        assert all(abs(t.created_of(k(i)) - ages[0]) < 0.01 for i in range(3))
        assert abs(t.created_of(k(3)) - ages[3]) < 0.01


def test_expiry_finds_expired_blocks_behind_young_ones(tmp_path):
    """Blocks are indexed as they arrive, not in age order: one adopted from another process (here a
    second tier on the directory, which backdates its file) sits behind a younger one. expire() must
    find it. Old code: the purge stopped at the first unexpired block and left it (to be evicted,
    and demoted)."""
    with DiskTier(tmp_path, 1 << 20, ttl_s=1.0) as t, DiskTier(tmp_path, 1 << 20) as other:
        assert t.put(k(1), data(1)) is Status.OK
        assert other.put(k(2), data(2)) is Status.OK
        old = time.time() - 0.6
        os.utime(other.path_of(k(2)), (old, old))
        assert t.contains(k(2))  # adopted, indexed after the younger k(1)
        time.sleep(0.5)
        assert t.expire() == 1 and set(t.keys()) == {k(1)}
        assert t.stats.expirations == 1
        t.check_integrity(deep=True)


def test_lru_eviction_order_and_hook_bytes(tmp_path):
    with DiskTier(tmp_path, 3 * ON_DISK) as t:
        seen = []

        def hook(key, view, meta):
            seen.append((key, bytes(view) == data(key[-1]).tobytes(), meta))

        t.on_evict = hook
        meta = BlockMeta("float16", (2, 2, 16, 32), 16)
        for i in range(3):
            t.put(k(i), data(i), meta=meta)
        read(t, k(0))  # 0 is now the most recent
        t.put(k(3), data(3))
        t.put(k(4), data(4))
        assert [s[0] for s in seen] == [k(1), k(2)]
        assert all(ok for _, ok, _ in seen)
        assert seen[0][2] == meta
        assert not os.path.exists(t.path_of(k(1)))
        assert set(t.keys()) == {k(0), k(3), k(4)}
        assert t.stats.evictions == 2
        t.check_integrity(deep=True)


def test_prefix_aware_eviction_takes_leaves_first(tmp_path):
    with DiskTier(tmp_path, 3 * ON_DISK, policy=PrefixAwareLRUPolicy()) as t:
        evicted = []
        t.on_evict = lambda key, view, meta: evicted.append(key)
        t.put_many([k(0), k(1), k(2)], [data(i) for i in range(3)])  # one chain 0 -> 1 -> 2
        read(t, k(2))  # touching the leaf does not save it from going before its ancestors
        t.put(k(5), data(5))
        t.put(k(6), data(6))
        assert evicted == [k(2), k(1)]
        t.check_integrity()


def test_pinned_blocks_are_skipped_and_all_pinned_is_full(tmp_path):
    with DiskTier(tmp_path, 2 * ON_DISK) as t:
        t.put(k(1), data(1))
        t.put(k(2), data(2))
        assert t.pin(k(1))
        assert t.put(k(3), data(3)) is Status.OK  # evicts 2, not pinned 1
        assert t.contains(k(1)) and not t.contains(k(2))
        assert t.pin(k(3))
        assert t.put(k(4), data(4)) is Status.FULL
        t.unpin(k(1))
        t.unpin(k(3))
        assert t.put(k(4), data(4)) is Status.OK
        with pytest.raises(ValueError, match="not pinned"):
            t.unpin(k(4))
        t.check_integrity(deep=True)


def test_corrupt_victim_is_not_handed_to_the_hook(tmp_path):
    with DiskTier(tmp_path, 2 * ON_DISK) as t:
        hooked = []
        t.on_evict = lambda key, view, meta: hooked.append(key)
        t.put(k(1), data(1))
        t.put(k(2), data(2))
        _flip(t.path_of(k(1)), PAGE + 7)
        t.put(k(3), data(3))
        assert hooked == [] and t.stats.verify_failures == 1 and t.stats.evictions == 1
        t.check_integrity(deep=True)


def test_blocks_demoted_from_a_host_pool_survive_a_restart(tmp_path):
    from kvtier.store.tiered import TieredStore
    from kvtier.tiers.host import HostTier

    keys = [k(i) for i in range(6)]
    store = TieredStore([HostTier(2 * BLOCK, BLOCK), DiskTier(tmp_path, 64 * ON_DISK)])
    store.put(keys, [data(i) for i in range(6)])  # the host pool holds 2: 4 go down to disk
    assert store.tier("disk").stats.puts == 4
    demoted = [i for i in range(6) if not store.tier("host").contains(k(i))]  # the host's choice
    assert len(demoted) == 4
    store.close()
    with DiskTier(tmp_path, 64 * ON_DISK) as t:
        assert set(t.keys()) >= {k(i) for i in demoted}
        for i in demoted:
            status, out = read(t, k(i))
            assert status is Status.OK and np.array_equal(out, data(i))


# -- records: parent links and annotations ---------------------------------------------------
def _chain_then_other(t: DiskTier) -> None:
    """Chain 0 -> 1 -> 2, then an unrelated root 9; publication order 0, 1, 2, 9 (mtimes set)."""
    t.put_many([k(0), k(1), k(2)], [data(i) for i in range(3)])  # parents: the chain
    t.put(k(9), data(9))
    for n, i in enumerate((0, 1, 2, 9)):
        os.utime(t.path_of(k(i)), (1000 + n, 1000 + n), follow_symlinks=False)  # a packed block's name: its link


def test_prefix_aware_eviction_sees_chains_after_a_restart(tmp_path):
    with DiskTier(tmp_path, 4 * ON_DISK, policy=PrefixAwareLRUPolicy()) as t:
        _chain_then_other(t)
    # Reopened: without recorded parents every block is a root and the oldest (0, the chain's
    # root) would go first, stranding 1 and 2. With them, the chain's leaf goes first.
    with DiskTier(tmp_path, 4 * ON_DISK, policy=PrefixAwareLRUPolicy()) as t:
        evicted = []
        t.on_evict = lambda key, view, meta: evicted.append(key)
        t.put(k(5), data(5), parent=None)
        t.put(k(6), data(6), parent=None)
        assert evicted == [k(2), k(1)]
        assert t.contains(k(0)) and t.contains(k(9))
        t.check_integrity(deep=True)


def test_recovery_restores_parents_first_whatever_the_file_order(tmp_path):
    with DiskTier(tmp_path, 4 * ON_DISK, policy=PrefixAwareLRUPolicy()) as t:
        _chain_then_other(t)
        # the child's file is older than its parent's (a write-behind flusher may publish so)
        os.utime(t.path_of(k(2)), (500, 500), follow_symlinks=False)
    with DiskTier(tmp_path, 4 * ON_DISK, policy=PrefixAwareLRUPolicy()) as t:
        evicted = []
        t.on_evict = lambda key, view, meta: evicted.append(key)
        t.put(k(5), data(5), parent=None)
        assert evicted == [k(2)]


def test_annotations_round_trip_and_come_back_after_a_restart(tmp_path):
    notes = {k(i): f"owner-{i}".encode() * 10 for i in range(4)}
    with DiskTier(tmp_path, 64 * ON_DISK) as t:
        t.annotator = lambda key: BlockRecord(parent=k(100), annotation=notes[key])
        t.put(k(0), data(0), meta=BlockMeta("float16", (2, 8), 16))
        t.put_many([k(1), k(2), k(3)], [data(i) for i in (1, 2, 3)])  # the put's parents win
    with DiskTier(tmp_path, 64 * ON_DISK) as t:
        got = {r.key: r for r in t.records()}
        assert set(got) == {k(0), k(1), k(2), k(3)}
        assert {key: r.annotation for key, r in got.items()} == notes
        assert got[k(0)].parent == got[k(1)].parent == k(100)  # put gave none: the annotator's
        assert got[k(2)].parent == k(1) and got[k(3)].parent == k(2)
        assert got[k(0)].nbytes == BLOCK and got[k(0)].header.token_count == 16
        assert all(read(t, key)[0] is Status.OK for key in got)


def test_a_flipped_annotation_is_corrupt_and_never_listed(tmp_path):
    with DiskTier(tmp_path, 64 * ON_DISK) as t:
        t.annotator = lambda key: BlockRecord(annotation=b"tenant=acme;" + key)
        t.put(k(1), data(1))
        t.put(k(2), data(2))
        _flip(t.path_of(k(1)), HEADER_NBYTES + 48 + 3)  # inside the annotation
        _flip(t.path_of(k(2)), HEADER_NBYTES + 48 + 3)
    with DiskTier(tmp_path, 64 * ON_DISK) as t:
        assert read(t, k(1))[0] is Status.CORRUPT  # a read checks the record too
        assert [r.key for r in t.records()] == []  # and so does the listing
        assert t.stats.verify_failures == 2
        assert not os.path.exists(t.path_of(k(1))) and not os.path.exists(t.path_of(k(2)))


def test_a_record_cannot_be_moved_to_another_key(tmp_path):
    with DiskTier(tmp_path, 64 * ON_DISK) as t:
        t.annotator = lambda key: BlockRecord(annotation=b"owner of " + key[-1:])
        t.put(k(1), data(1))
        t.put(k(2), data(2))
        # graft k(1)'s record (and header) onto k(2)'s file, fixing up the header's key is not
        # possible without breaking its check; the record alone is bound to the key too
        page1 = Path(t.path_of(k(1))).read_bytes()[:PAGE]
        with open(t.path_of(k(2)), "r+b") as f:
            f.seek(HEADER_NBYTES)
            f.write(page1[HEADER_NBYTES:])
        assert read(t, k(2))[0] is Status.CORRUPT
        assert read(t, k(1))[0] is Status.OK


def test_an_annotator_that_fails_or_overflows_publishes_nothing(tmp_path):
    with DiskTier(tmp_path, 64 * ON_DISK) as t:
        t.annotator = lambda key: BlockRecord(annotation=b"x" * (MAX_ANNOTATION + 1))
        assert t.put(k(1), data(1)) is Status.ERROR
        t.annotator = lambda key: 1 / 0
        assert t.put(k(2), data(2)) is Status.ERROR
        t.annotator = lambda key: None  # refused (e.g. deleted by its owner meanwhile)
        assert t.put(k(4), data(4)) is Status.ERROR
        assert not any(os.path.exists(t.path_of(k(i))) for i in (1, 2, 4))
        t.annotator = lambda key: BlockRecord(annotation=b"x" * MAX_ANNOTATION)
        assert t.put(k(3), data(3)) is Status.OK and read(t, k(3))[0] is Status.OK
        t.check_integrity(deep=True)
