"""A reader's stale entry of a packed block whose extent's inode number went to a *block file of
its own* (s31 a3 D3; the s30 a15 D5 class).

Two disk tiers share a directory. The reader indexed k(2) packed in the writer's extent; the
writer removed k(1) and k(2) (the extent with them) and stored k(2) again with ``put``, a file of
its own, which the file system (ext4: at once) gave the freed extent's inode number. The reader's
get finds the extent's own name gone and asks whether the block's name still links to that
extent: a block file has no table, and the check used to fall back to the inode number alone, so
the reader removed the writer's good block, lost to every process and every restart. Now only a
table that names the extent (or, where it is damaged, a first page that is no block header) makes
the name the extent's.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from tests.tiers.test_disk_inode_reuse import REUSE_TRIES, data, k, read, readable_after_restart


def _stale_extent_entry_whose_number_a_block_file_got(tmp_path) -> tuple[DiskTier, DiskTier, str]:
    for attempt in range(REUSE_TRIES):
        root = tmp_path / f"try{attempt}"
        writer = DiskTier(root, 1 << 24, direct_io=False)
        reader = DiskTier(root, 1 << 24, direct_io=False)
        assert writer.put_many([k(1), k(2)], [data(1), data(2)]) == [Status.OK] * 2
        assert reader.contains(k(2))  # indexed packed in the writer's extent
        old = os.lstat(writer.path_of(k(2))).st_ino
        assert writer.delete(k(1)) and writer.delete(k(2))  # the extent goes with them
        assert writer.put(k(2), data(2)) is Status.OK  # stored again: a file of its own
        if os.lstat(writer.path_of(k(2))).st_ino == old:
            return writer, reader, str(root)
        writer.close()
        reader.close()
    pytest.skip(f"this file system gave no new block file a freed inode number in {REUSE_TRIES} tries")


@pytest.mark.parametrize("how", ["get", "get_many"])
def test_a_stale_packed_entry_never_removes_a_block_file_that_got_its_extents_number(tmp_path, how):
    writer, reader, root = _stale_extent_entry_whose_number_a_block_file_got(tmp_path)
    try:
        status, out = read(reader, k(2), how)
        assert os.path.exists(writer.path_of(k(2))), "the reader removed the writer's good block file"
        assert status is Status.OK and np.array_equal(out, data(2))  # read where the name holds it now
        assert readable_after_restart(root, k(2))
        reader.check_integrity(deep=True)
        writer.check_integrity(deep=True)
    finally:
        writer.close()
        reader.close()
