"""Two threads of one disk tier storing the same key at once, a ``put`` (a file of its own) and a
``put_many`` (packed in an extent; write-behind and a demotion, say): the file I/O of both runs
outside the lock, so whichever rename (or link) reaches the block's name last wins it, and each
settles under the lock afterwards in either order. The index must then describe the file at the
name, and ``used_bytes`` what the tier holds on disk: the copy that lost its name is gone (a file
of its own) or a dead place in its extent (counted until the extent goes)."""
from __future__ import annotations

import os
import threading

import numpy as np

from kvtier.tiers import disk_extents
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier

NB = 8192
WAIT_S = 10.0


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, NB, dtype=np.uint8)


def block_bytes_on_disk(root) -> int:
    """Bytes the tier's files hold, extent tables left out (the tier does not count them)."""
    by_inode: dict[int, tuple[str, os.stat_result]] = {}
    extents: dict[int, str] = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            by_inode.setdefault(st.st_ino, (path, st))
            if name.endswith(disk_extents.EXTENT_SUFFIX):
                extents[st.st_ino] = path
    total = 0
    for ino, (path, st) in by_inode.items():
        total += disk_extents.allocated_bytes(path, st)
        if ino in extents:  # whichever of its names the walk met first
            fd = os.open(extents[ino], os.O_RDONLY)
            try:
                total -= disk_extents.read_table(fd, st.st_size).nbytes
            finally:
                os.close(fd)
    return total


def settled(tier: DiskTier, root, where: str) -> None:
    """The index describes the file at k(1)'s name; the accounting what is on disk, also after a
    restart; both blocks read back."""
    tier.check_integrity(deep=True)
    assert tier.used_bytes == block_bytes_on_disk(root), (
        f"used_bytes {tier.used_bytes} != {block_bytes_on_disk(root)} bytes of blocks on disk")
    path, offset = tier.locate(k(1))
    if where == "own":
        assert (path, offset) == (tier.path_of(k(1)), 0)
        assert os.lstat(path).st_nlink == 1
    else:
        assert path.endswith(disk_extents.EXTENT_SUFFIX) and offset > 0
        assert os.lstat(path).st_ino == os.lstat(tier.path_of(k(1))).st_ino
    for i in (1, 2):
        got = np.empty(NB, np.uint8)
        assert tier.get(k(i), got) is Status.OK and np.array_equal(got, data(i))
    again = DiskTier(root, 1 << 24, direct_io=False)
    try:
        assert again.used_bytes == tier.used_bytes
    finally:
        again.close()


def test_a_put_whose_rename_replaced_a_packed_name_counts_its_file(tmp_path):
    """put_many links k(1) and settles inside put's write window; put's rename then replaces the
    link: put indexes its own file, and k(1)'s place in the extent is dead."""
    tier = DiskTier(tmp_path, 1 << 24, direct_io=False)
    try:
        real = tier._write

        def racing(key, write, mtime=None):
            tier._write = real
            assert tier.put_many([key, k(2)], [data(1), data(2)]) == [Status.OK] * 2
            return real(key, write, mtime)

        tier._write = racing
        assert tier.put(k(1), data(1)) is Status.OK
        settled(tier, tmp_path, "own")
    finally:
        tier.close()


def test_a_put_whose_file_a_packed_link_replaced_keeps_the_packed_entry(tmp_path):
    """put_many passes its checks; put renames its file; put_many links k(1) over it and settles;
    put settles last: the name holds the extent, which stays indexed; put's file is gone and not
    counted."""
    tier = DiskTier(tmp_path, 1 << 24, direct_io=False)
    real_write, real_extent = tier._write, tier._write_extent
    many_writing, go_many, renamed, many_done = (threading.Event() for _ in range(4))
    results: dict[str, object] = {}

    def gated_extent(*args):  # put_many: its checks passed, its extent not yet written
        many_writing.set()
        assert go_many.wait(WAIT_S)
        return real_extent(*args)

    def gated_write(key, write, mtime=None):  # put: renamed, not yet settled
        status = real_write(key, write, mtime)
        renamed.set()
        assert many_done.wait(WAIT_S)
        return status

    tier._write, tier._write_extent = gated_write, gated_extent

    def putting_many():
        results["put_many"] = tier.put_many([k(1), k(2)], [data(1), data(2)])
        many_done.set()

    def putting():
        results["put"] = tier.put(k(1), data(1))

    one, many = threading.Thread(target=putting), threading.Thread(target=putting_many)
    try:
        many.start()
        assert many_writing.wait(WAIT_S)
        one.start()
        assert renamed.wait(WAIT_S)
        go_many.set()
        many.join(WAIT_S)
        one.join(WAIT_S)
        assert results == {"put": Status.OK, "put_many": [Status.OK] * 2}
        tier._write, tier._write_extent = real_write, real_extent
        settled(tier, tmp_path, "extent")
    finally:
        go_many.set()
        many_done.set()
        tier.close()


def test_a_put_many_whose_link_a_put_replaced_counts_its_place_dead(tmp_path):
    """put_many links k(1); put renames its file over the link and settles first; put_many settles
    last: the name holds put's file, which stays indexed; k(1)'s place in the extent is dead."""
    tier = DiskTier(tmp_path, 1 << 24, direct_io=False)
    real_write, real_link = tier._write, tier._link_all
    in_write, linked, go_write, put_done = (threading.Event() for _ in range(4))
    results: dict[str, object] = {}

    def gated_write(key, write, mtime=None):  # put: its checks passed, its file not yet renamed
        in_write.set()
        assert go_write.wait(WAIT_S)
        return real_write(key, write, mtime)

    def gated_link(rel, keys):  # put_many: linked, not yet settled
        done = real_link(rel, keys)
        linked.set()
        assert put_done.wait(WAIT_S)
        return done

    tier._write, tier._link_all = gated_write, gated_link

    def putting():
        results["put"] = tier.put(k(1), data(1))
        put_done.set()

    def putting_many():
        results["put_many"] = tier.put_many([k(1), k(2)], [data(1), data(2)])

    one, many = threading.Thread(target=putting), threading.Thread(target=putting_many)
    try:
        one.start()
        assert in_write.wait(WAIT_S)
        many.start()
        assert linked.wait(WAIT_S)
        go_write.set()
        one.join(WAIT_S)
        many.join(WAIT_S)
        assert results == {"put": Status.OK, "put_many": [Status.OK] * 2}
        tier._write, tier._link_all = real_write, real_link
        settled(tier, tmp_path, "own")
    finally:
        go_write.set()
        put_done.set()
        tier.close()
