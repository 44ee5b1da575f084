"""Puts on a file system that runs out of room before ``capacity_bytes`` evict what makes room,
and only that (s31 a3 D1, D2, D4, D7).

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
"""
from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvtier.tiers.base import Status
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


@pytest.fixture
def small_ext4(tmp_path):
    """A 32 MiB ext4 (no blocks kept for root), loop-mounted; skipped where that cannot be done."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("a loop-mounted ext4 needs root and mkfs.ext4")
    image, mnt = tmp_path / "ext4.img", tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", "32M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True, capture_output=True)
    if subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot loop-mount an ext4 here")
    try:
        yield Path(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


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
