"""A stream put on a file system the tier shares evicts for its room, also once a write has found
the file system full (s33 a7 D4).

Once a write found no room, the tier's limit is "what it holds plus what was free then", counted
since by its own writes and removals. Another process on the same file system may take the room
the tier freed since (deletes, evictions). A stream is read once and never written again: before
the fix the tier asked statvfs before a stream only while its limit was still ``capacity_bytes``,
so here the stream was written with nothing evicted, found no room and was refused FULL, where
evicting one block made room (a plain put of the same size was written again: OK). Every
``EncryptedTier`` put over a disk tier is a stream: the block was lost to the tier.

A real small tmpfs (root only, as CI runs; skipped otherwise)."""

from __future__ import annotations

from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from tests.tiers.test_disk_full_medium_eviction import (
    HUGE, _put_as_stream, block, exact, fill_the_rest, k)
from tests.tmpfs import mounted_tmpfs

NB = 60000  # 64 KiB on disk with the header page


def test_a_stream_evicts_once_another_writer_took_the_room_the_tier_freed(tmp_path):
    with mounted_tmpfs(tmp_path / "mnt", "1m") as mnt:
        tier = DiskTier(mnt / "t", HUGE, direct_io=False)
        try:
            for i in range(64):  # 64 KiB each into 1 MiB: a write finds the file system full, evicts
                assert tier.put(k(i), block(i, NB)) is Status.OK
                if tier.stats.evictions:
                    break
            assert tier.stats.evictions, "the file system never filled"
            held = [j for j in range(i + 1) if tier.contains(k(j))]
            for j in held[:2]:  # the tier frees room ...
                assert tier.delete(k(j))
            fill_the_rest(mnt)  # ... and another writer on the file system takes it
            evictions = tier.stats.evictions
            assert _put_as_stream(tier, 999, NB) is Status.OK
            assert tier.stats.evictions > evictions  # room was made for it before it was written
            assert tier.contains(k(999))  # (a sealed block: read only through a sink)
            assert all(exact(tier, j, NB) for j in held[2:] if tier.contains(k(j)))
            tier.check_integrity(deep=True)
        finally:
            tier.close()

