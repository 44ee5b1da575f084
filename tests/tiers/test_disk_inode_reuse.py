"""Two disk tiers on one directory (two processes' views; shared directories are supported), the
reader holding a stale entry for a block the writer removed and stored again (s30 a15 D5).

The reader used to judge "is the name still the file I indexed?" by the inode number alone, and a
file system hands a freed number out again (ext4 at once): the writer's new extent got the number
of the extent the reader had indexed, so the reader, finding that extent's own name gone, took the
block's name for a leftover link to it and removed it -- the writer's good copy, lost to every
process and every restart. And a block the reader indexed as a file of its own, which the writer
had since packed into an extent, was read as a block file, failed ("unreadable header or wrong
key") and was removed as corrupt. Now a name is removed only while it holds the very file indexed
and read (an extent known by its table, which names it); otherwise the stale entry is forgotten and
the get reads the block where the name holds it now.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import aligned_buffer
from kvtier.tiers.disk import DiskTier

NB = 16384
#: tries at making the writer's new extent get the old one's inode number (ext4: the first, mostly)
REUSE_TRIES = 20


def k(i: int) -> bytes:
    return bytes([i]) * 32


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, NB, dtype=np.uint8)


def read(tier: DiskTier, key: bytes, how: str) -> tuple[Status, np.ndarray]:
    """A read of ``key`` by ``get`` or by ``get_many`` (a page-aligned buffer: the pipelined path)."""
    out = aligned_buffer(NB)
    status = tier.get(key, out) if how == "get" else tier.get_many([key], [out])[0]
    return status, out


def readable_after_restart(root, key: bytes) -> bool:
    fresh = DiskTier(root, 1 << 24, direct_io=False)
    try:
        status, out = read(fresh, key, "get")
        return status is Status.OK and np.array_equal(out, data(key[0]))
    finally:
        fresh.close()


def failed_verification(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "failed verification" in r.getMessage()]


def _stale_extent_entry_with_its_number_reused(tmp_path) -> tuple[DiskTier, DiskTier, str]:
    """A writer and a reader on one directory: the reader indexed k(2) packed after k(1) in the
    writer's extent; the writer removed both (the extent with them) and packed k(2) again, first
    now, in a new extent that got the old one's inode number. Skips where the file system never
    hands that number out again."""
    for attempt in range(REUSE_TRIES):
        root = tmp_path / f"try{attempt}"
        writer = DiskTier(root, 1 << 24, direct_io=False)
        reader = DiskTier(root, 1 << 24, direct_io=False)
        assert writer.put_many([k(1), k(2)], [data(1), data(2)]) == [Status.OK] * 2
        assert reader.contains(k(2))
        old = os.lstat(writer.path_of(k(2))).st_ino
        assert writer.delete(k(1)) and writer.delete(k(2))
        assert writer.put_many([k(2), k(3)], [data(2), data(3)]) == [Status.OK] * 2
        if os.lstat(writer.path_of(k(2))).st_ino == old:
            return writer, reader, str(root)
        writer.close()
        reader.close()
    pytest.skip(f"this file system gave no new extent a freed inode number in {REUSE_TRIES} tries")


@pytest.mark.parametrize("how", ["get", "get_many"])
def test_a_stale_entry_whose_extent_number_went_to_a_new_extent_removes_nothing_and_reads_it(tmp_path, how, caplog):
    writer, reader, root = _stale_extent_entry_with_its_number_reused(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            status, out = read(reader, k(2), how)
        assert os.path.exists(writer.path_of(k(2))), "the reader removed the writer's block"
        assert readable_after_restart(root, k(2))
        assert status is Status.OK and np.array_equal(out, data(2))  # read where the name holds it now
        assert (reader.stats.hits, reader.stats.misses) == (1, 0)
        assert reader.stats.verify_failures == 0 and failed_verification(caplog) == []
        reader.check_integrity(deep=True)
        writer.check_integrity(deep=True)
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("how", ["get", "get_many", "records"])
def test_a_block_file_replaced_by_a_link_into_another_process_extent_is_read_there_not_removed(
        tmp_path, how, caplog):
    writer = DiskTier(tmp_path, 1 << 24, direct_io=False)
    reader = DiskTier(tmp_path, 1 << 24, direct_io=False)
    try:
        assert writer.put(k(1), data(1)) is Status.OK
        assert reader.contains(k(1))  # indexed as a file of its own
        assert writer.delete(k(1))
        assert writer.put_many([k(1), k(2)], [data(1), data(2)]) == [Status.OK] * 2  # its name: a link now
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            if how == "records":
                assert [r.key for r in reader.records()] == []  # what it indexed is not there
                status, out = read(reader, k(1), "get")  # adopted where it is now
            else:
                status, out = read(reader, k(1), how)  # read where the name holds it now
        assert reader.stats.verify_failures == 0 and failed_verification(caplog) == []
        assert os.path.exists(writer.path_of(k(1))), "the reader removed the writer's block"
        assert readable_after_restart(tmp_path, k(1))
        assert status is Status.OK and np.array_equal(out, data(1))
        reader.check_integrity(deep=True)
    finally:
        writer.close()
        reader.close()


def test_a_name_left_linked_to_the_very_extent_whose_own_name_went_is_still_removed(tmp_path):
    """What the check keeps: a name whose extent's own name is gone (a remover killed halfway) still
    links to the extent indexed, by its table: a read removes it (nothing else would find it)."""
    tier = DiskTier(tmp_path, 1 << 24, direct_io=False)
    try:
        assert tier.put_many([k(1), k(2)], [data(1), data(2)]) == [Status.OK] * 2
        extent, _ = tier.locate(k(1))
        os.unlink(extent)
        assert read(tier, k(1), "get")[0] is Status.MISS
        assert not os.path.exists(tier.path_of(k(1)))
        tier.check_integrity()
    finally:
        tier.close()
