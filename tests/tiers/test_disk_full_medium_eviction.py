"""Puts on a file system that runs out of room before ``capacity_bytes`` evict what makes room,
and only that (s31 a3 D1, D2, D4, D7; s31 r1 D1-D3).

Real small file systems (root only, as CI runs; skipped otherwise): a tmpfs, and for names that
need a directory block a loop-mounted ext4.

* Out of inodes with bytes free (ext4 full of others' small files, a tmpfs with ``nr_inodes``): the
  limit the medium set stayed at "held + free bytes", eviction made no room, every put was FULL.
* A put that could never fit (more than the tier holds plus the free room) evicted every block
  first, then failed.
* Puts in flight were counted twice (their reservation, and the bytes already missing from the
  free room), so concurrent puts evicted too little and came back FULL.
* A ``put_many`` block whose name found no room (a full ext4's directory needs a new block) was
  ERROR (a warning each, ``errors`` counted), never evicted for and written again.
* A put in flight whose bytes were written (its fsync under way, most of a put's time on a real
  disk) was counted twice again once the file system set the limit: a put that fit once one block
  was evicted evicted it and was refused FULL.
* Out of inodes, a put larger than the bytes the tier held was refused FULL with nothing evicted,
  and a smaller one evicted its size in blocks where one inode was needed.
* Out of inodes with packed blocks (an extent is one inode, a name per block), puts evicted
  packed blocks by bytes, which freed no inode, and came back FULL; a batch whose extent found no
  inode went block by block, an inode each.
* A stream in flight (``put_streams``: every ``EncryptedTier`` put over a disk tier) whose bytes were
  written was still counted twice while it fsync'd (s31 r4 D1).
* An extent with no room was written again after evicting for its blocks only, not its table page:
  the rewrite found no room again, and was written a third time before going block by block (s31
  r4 D2).
* Out of inodes, packed blocks were evicted beside a pinned mate (or names another tier on the
  directory holds), though their extent, its inode, could not go: a put wiped the tier's packed
  blocks for nothing (s31 r4 D3).
* Out of inodes and bytes at once, a put evicted a block file (an inode freed) but never saw the
  inode free while the bytes were short, so the packed blocks skipped for their inode were never
  taken for their bytes: FULL, a block evicted for nothing (s32 a4 D1).
* Under a spent quota, a put that could never fit was measured against the disk's free bytes (a
  quota does not show in statvfs): it evicted the whole tier, then was refused FULL (s32 a4 D2).
* Once the file system set the limit, each extent's table page was left out of both used_bytes
  and the limit: the tier saw a page more room per extent than the file system had, and a stream
  sized within it evicted nothing and was refused FULL (s32 a4 D3).
* An extent evicted whole frees its table page too, which eviction did not see until it was over:
  a put evicted a block more per extent it removed, its room left free, unused (s32 r1 D1).
* A put that fits once the tier's extents are evicted (their blocks and table pages) was refused
  FULL before any eviction: the room the tier could make left the table pages out (s32 r1 D3).
* After a reopen on a full file system (or before a write found it full), the limit was still
  ``capacity_bytes``: a stream, read once, wrote, found no room and was refused FULL where one
  eviction made room; a plain put of the same size was written again (s32 r1 D4).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import PAGE, round_up
from kvtier.tiers.disk import DiskTier
from tests.tmpfs import mounted_tmpfs

HUGE = 1 << 30  # capacity_bytes far above what the file system holds


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def block(i: int, nbytes: int) -> np.ndarray:
    return np.full(nbytes, i % 251, np.uint8)


def exact(tier: DiskTier, i: int, nbytes: int) -> bool:
    out = np.empty(nbytes, np.uint8)
    return tier.get(k(i), out) is Status.OK and np.array_equal(out, block(i, nbytes))


def test_out_of_inodes_with_bytes_free_evicts_to_make_room(tmp_path):
    nb = 60000
    # (the helper's size option carries the inode bound along: the shards take 257 of the 300)
    with mounted_tmpfs(tmp_path / "mnt", "64m,nr_inodes=300") as mnt:
        with DiskTier(mnt / "t", HUGE, direct_io=False) as tier:
            statuses = [tier.put(k(i), block(i, nb)) for i in range(120)]
            fs = os.statvfs(mnt)
            assert fs.f_favail == 0 and fs.f_bavail * fs.f_frsize > 32 << 20  # no inode, many bytes
            assert statuses == [Status.OK] * 120, {s.name: statuses.count(s) for s in set(statuses)}
            assert tier.stats.evictions > 0
            assert all(exact(tier, i, nb) for i in range(110, 120))
            tier.check_integrity(deep=True)


def test_a_put_that_can_never_fit_evicts_nothing(tmp_path):
    nb = 60000
    with mounted_tmpfs(tmp_path / "mnt", "4m") as mnt:
        with DiskTier(mnt / "t", HUGE, direct_io=False) as tier:
            for i in range(10):
                assert tier.put(k(i), block(i, nb)) is Status.OK  # 640 KiB held
            fd = os.open(mnt / "other", os.O_WRONLY | os.O_CREAT, 0o600)  # another writer takes the rest
            try:
                with pytest.raises(OSError):
                    while True:
                        os.write(fd, bytes(1 << 16))
            finally:
                os.close(fd)
            # 2 MiB: more than the 640 KiB held plus the room left, however much is evicted
            assert tier.put(k(99), block(99, 2 << 20)) is Status.FULL
            assert tier.stats.evictions == 0
            assert all(exact(tier, i, nb) for i in range(10))
            tier.check_integrity(deep=True)


def test_concurrent_puts_on_a_full_file_system_all_land(tmp_path):
    nb = (1 << 20) - 4096  # 1 MiB on disk with the header page
    with mounted_tmpfs(tmp_path / "mnt", "24m") as mnt:
        with DiskTier(mnt / "t", HUGE, direct_io=False) as tier:
            with ThreadPoolExecutor(8) as pool:
                statuses = list(pool.map(lambda i: tier.put(k(i), block(i % 8, nb)), range(400)))
            assert statuses.count(Status.FULL) == 0, {s.name: statuses.count(s) for s in set(statuses)}
            assert tier.stats.evictions > 0
            tier.check_integrity(deep=True)


@contextlib.contextmanager
def loop_ext4(tmp_path: Path, size: str, *mkfs_options: str):
    """An ext4 of ``size`` (no blocks kept for root), loop-mounted; skipped where that cannot be done."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("a loop-mounted ext4 needs root and mkfs.ext4")
    image, mnt = tmp_path / "ext4.img", tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", size, str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", *mkfs_options, str(image)], check=True, capture_output=True)
    if subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot loop-mount an ext4 here")
    try:
        yield Path(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.fixture
def small_ext4(tmp_path):
    with loop_ext4(tmp_path, "32M") as mnt:
        yield mnt


def take_every_inode(mnt: Path) -> None:
    """Another user makes empty files until the file system has no inode left (bytes it has)."""
    other = mnt / "other"
    other.mkdir()
    with pytest.raises(OSError) as full:
        for n in range(1 << 20):
            (other / str(n)).touch()
    assert full.value.errno == errno.ENOSPC
    assert os.statvfs(mnt).f_favail == 0


def test_a_put_many_name_with_no_room_is_written_again_after_eviction_not_an_error(small_ext4):
    nb = 60000
    with DiskTier(small_ext4 / "t", HUGE, direct_io=False) as tier:
        statuses: list[Status] = []
        for start in range(0, 4 * 350, 4):  # ~90 MiB through a 32 MiB file system, 4 blocks a batch
            statuses += tier.put_many([k(i) for i in range(start, start + 4)],
                                      [block(i, nb) for i in range(start, start + 4)])
        assert Status.ERROR not in statuses and tier.stats.errors == 0, {s.name: statuses.count(s) for s in set(statuses)}
        assert statuses.count(Status.OK) >= len(statuses) - 8  # (a put may still find no room 3 times: FULL)
        assert all(exact(tier, i, nb) for i in range(4 * 349, 4 * 350))
        tier.check_integrity(deep=True)


class _Pieces:
    """A stream source: ``block(i, nbytes)`` in 64 KiB pieces."""

    def __init__(self, i: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self._data = block(i, nbytes).tobytes()

    def pieces(self):
        for off in range(0, self.nbytes, 1 << 16):
            yield memoryview(self._data[off:off + (1 << 16)])


def _put_as_plain(tier: DiskTier, i: int, nbytes: int) -> Status:
    return tier.put(k(i), block(i, nbytes))


def _put_as_stream(tier: DiskTier, i: int, nbytes: int) -> Status:
    return tier.put_streams([k(i)], [_Pieces(i, nbytes)])[0]


@pytest.mark.parametrize("put_a", [_put_as_plain, _put_as_stream], ids=["put", "put_streams"])
def test_a_put_in_flight_whose_bytes_are_written_is_not_counted_twice(tmp_path, monkeypatch, put_a):
    mib = 1 << 20
    nb = 3 * mib - 4096  # 3 MiB on disk with the header page
    a_syncing, a_may_finish = threading.Event(), threading.Event()
    fsync = os.fsync

    def slow_disk_fsync(fd):  # put A's fsync takes long, as on a real disk (tmpfs syncs at once)
        if threading.current_thread().name == "put A":
            a_syncing.set()
            assert a_may_finish.wait(30)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_disk_fsync)
    with mounted_tmpfs(tmp_path / "mnt", "10m") as mnt:
        with DiskTier(mnt / "t", HUGE, direct_io=False) as tier:
            assert tier.put(k(1), block(1, nb)) is Status.OK  # the tier's one old block
            (mnt / "other").write_bytes(bytes(2 * mib))  # another user's 2 MiB
            result = {}
            a = threading.Thread(target=lambda: result.update(a=put_a(tier, 2, nb)), name="put A")
            a.start()
            try:
                assert a_syncing.wait(30)  # A's 3 MiB written, its fsync under way: 2 MiB free
                # B fits once the old block is evicted (5 MiB free then): it is stored
                assert tier.put(k(3), block(3, nb)) is Status.OK
                assert tier.stats.evictions == 1
            finally:
                a_may_finish.set()
                a.join(30)
            assert result == {"a": Status.OK}
            assert tier.contains(k(2)) and exact(tier, 3, nb)  # (a stream is sealed: no plain get)
            tier.check_integrity(deep=True)


def test_out_of_inodes_a_put_larger_than_the_tier_evicts_one_block_file_for_its_inode(tmp_path):
    with mounted_tmpfs(tmp_path / "mnt", "64m,nr_inodes=400") as mnt:
        with DiskTier(mnt / "t", HUGE, direct_io=False) as tier:
            assert all(tier.put(k(i), block(i, 4096)) is Status.OK for i in range(50))  # 400 KiB held
            take_every_inode(mnt)
            # 1 MiB: more than the tier holds, but the bytes are there; one inode is missing
            assert tier.put(k(1000), block(1000, 1 << 20)) is Status.OK
            assert tier.stats.evictions == 1
            assert tier.put(k(1001), block(1001, 200_000)) is Status.OK  # one inode again, not 200 KB of blocks
            assert tier.stats.evictions == 2
            assert all(exact(tier, i, 4096) for i in range(2, 50))
            assert exact(tier, 1000, 1 << 20) and exact(tier, 1001, 200_000)
            tier.check_integrity(deep=True)


def test_out_of_inodes_packed_blocks_are_evicted_an_extent_at_a_time(tmp_path):
    nb, batch = 4096, 8
    with loop_ext4(tmp_path, "64M", "-N", "400") as mnt:
        with DiskTier(mnt / "t", HUGE, direct_io=False) as tier:
            def put_batch(start: int) -> list[Status]:
                keys = range(start, start + batch)
                return tier.put_many([k(i) for i in keys], [block(i, nb) for i in keys])

            for start in range(0, 20 * batch, batch):  # 20 extents of 8 blocks: 20 inodes
                assert put_batch(start) == [Status.OK] * batch
            take_every_inode(mnt)
            statuses = [s for start in range(20 * batch, 50 * batch, batch) for s in put_batch(start)]
            assert statuses == [Status.OK] * 30 * batch, {s.name: statuses.count(s) for s in set(statuses)}
            # an inode per batch, freed by evicting one extent whole: a block evicted per block stored
            assert tier.stats.evictions == 30 * batch
            assert all(exact(tier, i, nb) for i in range(30 * batch, 50 * batch))  # the newest 20 extents
            # a block file of its own needs an inode too: the oldest extent goes for each
            singles = [tier.put(k(i), block(i, nb)) for i in range(50 * batch, 50 * batch + 20)]
            assert singles == [Status.OK] * 20
            assert all(exact(tier, i, nb) for i in range(50 * batch, 50 * batch + 20))
            tier.check_integrity(deep=True)


def fill_the_rest(mnt: Path, into: str = "other") -> None:
    """Another user takes every free byte of the file system, to the last page (in its file ``into``,
    which may be one it has already, where no inode is left for a new one)."""
    fd = os.open(mnt / into, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 16, 4096):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, bytes(chunk))
    finally:
        os.close(fd)
    assert os.statvfs(mnt).f_bavail == 0


def test_an_extent_with_no_room_is_packed_after_evicting_for_its_table_too(tmp_path):
    nb = 60000  # 64 KiB on disk with the header page; an extent of 2 is 132 KiB with its table page
    with mounted_tmpfs(tmp_path / "mnt", "4m") as mnt:
        with DiskTier(mnt / "t", HUGE, direct_io=False) as tier:
            assert all(tier.put(k(i), block(i, nb)) is Status.OK for i in range(10))
            fill_the_rest(mnt)
            # the extent finds no room; evicting its blocks' 128 KiB alone left none for its table
            assert tier.put_many([k(100), k(101)], [block(100, nb), block(101, nb)]) == [Status.OK] * 2
            assert os.stat(tier.path_of(k(100))).st_nlink == 3  # packed: the extent's name and 2 links
            assert os.path.samefile(tier.path_of(k(100)), tier.path_of(k(101)))
            assert tier.stats.evictions == 3
            assert exact(tier, 100, nb) and exact(tier, 101, nb)
            tier.check_integrity(deep=True)
            used = tier.used_bytes
        with DiskTier(mnt / "t", HUGE, direct_io=False) as reopened:
            assert reopened.used_bytes == used  # the table counted as a restart counts it
            reopened.check_integrity(deep=True)


def test_an_extent_that_finds_no_room_again_goes_block_by_block_not_a_third_time(tmp_path, monkeypatch):
    nb = 60000
    extent_syncs = []
    fsync = os.fsync

    def no_room_for_extents(fd):  # a file system that never has room for an extent (its blocks it has)
        # (an extent's temp file: ".<its stem, with dashes>.<tag>.tmp"; a block file's: ".<key hex>.<tag>.tmp")
        if "-" in os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).split(".")[1]:
            extent_syncs.append(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", no_room_for_extents)
    with DiskTier(tmp_path / "t", HUGE, direct_io=False) as tier:
        statuses = tier.put_many([k(i) for i in range(4)], [block(i, nb) for i in range(4)])
        assert statuses == [Status.OK] * 4  # block by block
        assert len(extent_syncs) == 2  # written, and once again after making room: no third time
        assert all(os.stat(tier.path_of(k(i))).st_nlink == 1 for i in range(4))
        assert all(exact(tier, i, nb) for i in range(4))
        assert not [name for _, _, names in os.walk(tmp_path / "t") for name in names if ".kvx" in name]
        tier.check_integrity(deep=True)


def test_out_of_inodes_packed_blocks_whose_extent_cannot_go_are_not_evicted(tmp_path):
    nb, batch = 4096, 8
    with loop_ext4(tmp_path, "64M", "-N", "400") as mnt:
        with DiskTier(mnt / "t", HUGE, direct_io=False) as tier, \
                DiskTier(mnt / "t", HUGE, direct_io=False) as other:  # another tier on the directory
            for start in range(0, 10 * batch, batch):  # 10 extents of 8, a block of each pinned (being read)
                keys = range(start, start + batch)
                assert tier.put_many([k(i) for i in keys], [block(i, nb) for i in keys]) == [Status.OK] * batch
                assert tier.pin(k(start + 3))
            # an extent the other tier wrote, one block of which this one has found (its other names: the other's)
            shared = range(500, 500 + batch)
            assert other.put_many([k(i) for i in shared], [block(i, nb) for i in shared]) == [Status.OK] * batch
            assert exact(tier, 500, nb)
            assert tier.put(k(1000), block(1000, nb)) is Status.OK  # a block file of its own, the newest
            take_every_inode(mnt)
            assert tier.put(k(1001), block(1001, nb)) is Status.OK  # finds no inode: evicts for one
            assert tier.stats.evictions == 1  # the block file: the only victim whose inode can go
            assert not tier.contains(k(1000))
            assert all(exact(tier, i, nb) for i in [*range(10 * batch), 500, 1001])
            tier.check_integrity(deep=True)


def take_every_inode_and_byte(mnt: Path) -> None:
    take_every_inode(mnt)
    fill_the_rest(mnt, into="other/0")  # (no inode left for a file of its own)


def _pin_a_mate(tier: DiskTier, other: DiskTier, nb: int) -> list[int]:
    """An extent of 8 with one block pinned (being read): its inode cannot go. The blocks held."""
    assert tier.put_many([k(i) for i in range(8)], [block(i, nb) for i in range(8)]) == [Status.OK] * 8
    assert tier.pin(k(3))
    return list(range(8))


def _share_with_another_tier(tier: DiskTier, other: DiskTier, nb: int) -> list[int]:
    """An extent of 8 the other tier on the directory wrote, 4 blocks of which this one found: the
    other's 4 names keep its inode. The blocks held here."""
    assert other.put_many([k(i) for i in range(8)], [block(i, nb) for i in range(8)]) == [Status.OK] * 8
    assert all(exact(tier, i, nb) for i in range(4))
    return list(range(4))


@pytest.mark.parametrize("extent_kept_by", [_pin_a_mate, _share_with_another_tier], ids=["pinned_mate", "shared_dir"])
def test_out_of_inodes_and_bytes_packed_blocks_skipped_for_their_inode_are_evicted_for_their_bytes(
        tmp_path, extent_kept_by):
    nb = 60000  # 64 KiB on disk with the header page
    with mounted_tmpfs(tmp_path / "mnt", "4m,nr_inodes=300") as mnt:
        with DiskTier(mnt / "t", HUGE, direct_io=False) as tier, DiskTier(mnt / "t", HUGE, direct_io=False) as other:
            held = extent_kept_by(tier, other, nb)
            assert tier.put(k(50), block(50, 4096)) is Status.OK  # a block file of its own: 8 KiB, an inode
            take_every_inode_and_byte(mnt)
            # evicting k(50) frees the inode; a packed block (its place erased, a hole) the bytes
            assert tier.put(k(99), block(99, nb)) is Status.OK
            assert tier.stats.evictions == 2 and not tier.contains(k(50)) and not tier.contains(k(0))
            assert all(exact(tier, i, nb) for i in [*held[1:], 99])
            tier.check_integrity()


def spent_quota(monkeypatch, path: Path, quota: int) -> None:
    """A quota of ``quota`` bytes on the files under ``path`` (what they take: a hole punched is
    free; each inode once, for names are links), as EDQUOT from the fsync of the write that passes
    it (statvfs does not show a quota)."""
    fsync = os.fsync

    def taken() -> int:
        files = {(st.st_dev, st.st_ino): st.st_blocks * 512 for st in
                 (os.lstat(os.path.join(top, name)) for top, _, names in os.walk(path) for name in names)}
        return sum(files.values())

    def quota_fsync(fd):
        if taken() > quota:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", quota_fsync)


def test_under_a_spent_quota_a_put_that_can_never_fit_evicts_nothing(tmp_path, monkeypatch):
    nb = 60000  # 64 KiB on disk with the header page
    quota = 10 * (64 << 10)
    with mounted_tmpfs(tmp_path / "mnt", "16m") as mnt, DiskTier(mnt / "t", HUGE, direct_io=False) as tier:
        spent_quota(monkeypatch, mnt / "t", quota)  # (a tmpfs: what a file takes is exact pages)
        assert all(tier.put(k(i), block(i, nb)) is Status.OK for i in range(11))  # the 11th spends the quota
        assert tier.stats.evictions == 1
        # 2 MiB: more than the quota lets the tier hold, however much is evicted (the disk has room)
        assert tier.put(k(99), block(99, 2 << 20)) is Status.FULL
        assert tier.stats.evictions == 1
        assert all(exact(tier, i, nb) for i in range(1, 11))
        # the quota, not what the tier holds now, bounds a put: 384 KiB fits once one block goes
        assert all(tier.delete(k(i)) for i in range(1, 6))
        assert tier.put(k(100), block(100, 6 * (64 << 10) - 4096)) is Status.OK
        assert tier.stats.evictions == 2 and not tier.contains(k(6))
        assert all(exact(tier, i, nb) for i in range(7, 11)) and exact(tier, 100, 6 * (64 << 10) - 4096)
        tier.check_integrity(deep=True)


def test_under_a_spent_quota_extents_written_and_evicted_leave_the_tier_its_room(tmp_path, monkeypatch):
    nb = 60000  # 64 KiB on disk with the header page; an extent of 2 is 132 KiB with its table page
    quota = 10 * (64 << 10)
    with mounted_tmpfs(tmp_path / "mnt", "16m") as mnt, DiskTier(mnt / "t", HUGE, direct_io=False) as tier:
        spent_quota(monkeypatch, mnt / "t", quota)
        assert all(tier.put(k(i), block(i, nb)) is Status.OK for i in range(11))  # the 11th spends the quota
        # packed pairs, many times what the quota holds: a table page taken off the limit for each
        # would never come back (a quota's limit does not rise again), and the tier would shrink
        for j in range(200, 300, 2):
            assert tier.put_many([k(j), k(j + 1)], [block(j, nb), block(j + 1, nb)]) == [Status.OK] * 2
        assert tier.used_bytes >= quota - (64 << 10)  # (short of the quota by less than a pair's extent)
        assert all(exact(tier, i, nb) for i in range(296, 300))
        tier.check_integrity(deep=True)


def test_table_pages_written_under_a_full_file_systems_limit_leave_its_room(tmp_path):
    nb = 60000  # 64 KiB on disk with the header page; an extent of 2 is 132 KiB with its table page
    with mounted_tmpfs(tmp_path / "mnt", "4m") as mnt:
        with DiskTier(mnt / "t", HUGE, direct_io=False) as tier:
            assert all(tier.put(k(i), block(i, nb)) is Status.OK for i in range(10))
            fill_the_rest(mnt)
            assert tier.put(k(10), block(10, nb)) is Status.OK  # no room: the file system sets the limit
            assert tier.stats.evictions == 1
            assert all(tier.delete(k(i)) for i in range(1, 10))  # 576 KiB free again
            for j in range(100, 108, 2):  # 4 extents: 512 KiB of blocks, 16 KiB of table pages
                assert tier.put_many([k(j), k(j + 1)], [block(j, nb), block(j + 1, nb)]) == [Status.OK] * 2
            assert tier.stats.evictions == 1
            free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
            # a stream a page larger than the room left: it evicts for it (it is read once: a write
            # that finds no room is FULL)
            assert tier.put_streams([k(99)], [_Pieces(99, free)])[0] is Status.OK
            assert tier.stats.evictions == 2 and not tier.contains(k(10))
            assert tier.contains(k(99)) and all(exact(tier, i, nb) for i in range(100, 108))
            tier.check_integrity(deep=True)
            used = tier.used_bytes
        with DiskTier(mnt / "t", HUGE, direct_io=False) as reopened:
            assert reopened.used_bytes == used  # table pages left out of used_bytes, as a restart counts
            reopened.check_integrity(deep=True)


def _free(mnt: Path) -> int:
    fs = os.statvfs(mnt)
    return fs.f_bavail * fs.f_frsize


def _full_file_system_holding_extents(tier: DiskTier, mnt: Path, nb: int, extents: int) -> list[int]:
    """The file system full (another writer), its limit set; the tier holding ``extents`` extents of
    2 blocks of ``nb`` bytes, written in order (the first is the least recently used). Their keys."""
    assert all(tier.put(k(i), block(i, 60000)) is Status.OK for i in range(10))
    fill_the_rest(mnt)
    assert tier.put(k(10), block(10, 60000)) is Status.OK  # no room: the file system sets the limit
    assert all(tier.delete(k(i)) for i in range(1, 11))  # the tier holds nothing now
    keys = list(range(1000, 1000 + 2 * extents))
    for j in keys[::2]:
        assert tier.put_many([k(j), k(j + 1)], [block(j, nb), block(j + 1, nb)]) == [Status.OK] * 2
    return keys


@pytest.mark.parametrize("nb, extents, gone", [(60000, 4, 1), (4096, 30, 20)], ids=["one of 4 extents", "20 of 30 small ones"])
def test_a_put_evicts_the_extents_that_make_its_room_and_no_block_more(tmp_path, nb, extents, gone):
    file_bytes = 2 * (PAGE + round_up(nb)) + PAGE  # an extent: 2 blocks and a table page
    with mounted_tmpfs(tmp_path / "mnt", "4m") as mnt:
        with DiskTier(mnt / "t", HUGE, direct_io=False) as tier:
            keys = _full_file_system_holding_extents(tier, mnt, nb, extents)
            evictions = tier.stats.evictions
            # exactly the room of the `gone` least recently used extents' files, with what is free
            need = _free(mnt) + gone * file_bytes
            assert tier.put(k(99), block(99, need - PAGE)) is Status.OK
            assert tier.stats.evictions - evictions == 2 * gone
            assert [i for i in keys if tier.contains(k(i))] == keys[2 * gone:]
            assert _free(mnt) == 0  # no room evicted for nothing
            assert all(exact(tier, i, nb) for i in keys[2 * gone:]) and exact(tier, 99, need - PAGE)
            tier.check_integrity(deep=True)


def test_a_put_that_fits_once_the_tiers_extents_go_evicts_them(tmp_path):
    nb = 60000  # 64 KiB on disk with the header page; an extent of 2 is 132 KiB with its table page
    with mounted_tmpfs(tmp_path / "mnt", "4m") as mnt:
        with DiskTier(mnt / "t", HUGE, direct_io=False) as tier:
            assert tier.put(k(3), block(3, nb)) is Status.OK
            assert tier.put_many([k(1), k(2)], [block(1, nb), block(2, nb)]) == [Status.OK] * 2
            fill_the_rest(mnt)
            assert tier.put(k(4), block(4, nb)) is Status.OK  # no room: the file system sets the limit; k(3) goes
            assert tier.delete(k(4)) and not tier.contains(k(3))
            fill_the_rest(mnt)  # another writer takes the room k(4) left: the tier holds the extent alone
            # 132 KiB on disk: more than the extent's blocks and the free room, exactly its whole file
            assert tier.put(k(9), block(9, (128 << 10))) is Status.OK
            assert tier.stats.evictions == 3 and not tier.contains(k(1)) and not tier.contains(k(2))
            assert exact(tier, 9, 128 << 10)
            tier.check_integrity(deep=True)


@pytest.mark.parametrize("reopened", [True, False], ids=["after a reopen", "before any write found it full"])
def test_a_stream_on_a_full_file_system_whose_limit_is_still_capacity_evicts_for_it(tmp_path, reopened):
    nb = 60000  # 64 KiB on disk with the header page
    with mounted_tmpfs(tmp_path / "mnt", "4m") as mnt:
        tier = DiskTier(mnt / "t", HUGE, direct_io=False)
        try:
            assert all(tier.put(k(i), block(i, nb)) is Status.OK for i in range(10))
            assert _put_as_stream(tier, 10, nb) is Status.OK  # with room: nothing evicted for it
            assert tier.stats.evictions == 0
            fill_the_rest(mnt)
            if reopened:
                tier.close()
                tier = DiskTier(mnt / "t", HUGE, direct_io=False)
            # read once, it cannot be written again: the tier asks the file system before it starts
            assert _put_as_stream(tier, 99, nb) is Status.OK
            assert tier.stats.evictions == 1 and not tier.contains(k(0))
            assert tier.contains(k(99)) and all(exact(tier, i, nb) for i in range(1, 10))
            tier.check_integrity(deep=True)
        finally:
            tier.close()
