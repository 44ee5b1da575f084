"""A remover killed while it removes a packed block's last name leaves no "corrupt" block.

Removing the last block of an extent used to unlink the extent's own name first, then the block's
name: a SIGKILL in between left the block's name as the only link to the whole extent, a file whose
first page is the extent's table, which a restart took for a block file and whose first read counted
a corrupt block (the SIGKILL test, ``tests/tiers/test_disk_kill.py``, packed extents, caught it on a
loaded machine). The name is now renamed to a temp name of the remover first: whatever moment the
kill lands, a restart finds a dead writer's temp file (reaped by its name, nothing read) and an
extent that no block reaches (reclaimed) -- and reads no page of any block file to tell.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import PAGE
from kvtier.tiers.disk import DiskTier


def _key(i: int) -> bytes:
    return hashlib.sha256(b"s33-kill-removal/%d" % i).digest()


def _payload(i: int, nbytes: int = 3 * PAGE + 100) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def _packed_pair(path: Path) -> tuple[bytes, bytes, Path, Path]:
    """Two blocks packed in one extent, one deleted: (deleted key, last key, its name, the extent)."""
    gone, last = _key(0), _key(1)
    with DiskTier(path, 1 << 30) as tier:
        assert tier.put_many([gone, last], [_payload(0), _payload(1)]) == [Status.OK, Status.OK]
        assert tier.delete(gone)
        name = Path(tier.path_of(last))
    (extent,) = path.rglob("*.kvx")
    assert extent.stat().st_ino == name.stat().st_ino and name.stat().st_nlink == 2
    return gone, last, name, extent


def _dead_temp_name(name: Path) -> Path:
    """The temp name a remover that has died gave ``name`` (its pid: one no process holds)."""
    from kvtier.child_process import host_tag
    pid = 2 ** 22 + 12345  # above any pid_max default: never a live process
    return name.parent / f".{name.name[:-4]}.0123abcd.{pid}.{host_tag()}.tmp"


@pytest.mark.parametrize("killed_after", ["the rename", "the extent's own name went"])
def test_a_restart_after_a_remover_killed_mid_removal_finds_no_block_and_no_corrupt_one(tmp_path, killed_after):
    gone, last, name, extent = _packed_pair(tmp_path)
    name.rename(_dead_temp_name(name))  # what _remove_last_name does first
    if killed_after == "the extent's own name went":
        extent.unlink()
    with DiskTier(tmp_path, 1 << 30) as tier:
        assert last not in set(tier.keys()) and gone not in set(tier.keys())
        assert tier.get(last, np.empty(_payload(1).nbytes, np.uint8)) is Status.MISS
        assert tier.stats.verify_failures == 0, "an interrupted removal is no corrupt block"
        assert tier.used_bytes == 0
        tier.check_integrity(deep=True)
    assert not any(tmp_path.rglob("*.tmp")) and not name.exists()
    # (an extent no block reaches is reclaimed once its writer is gone or it is older than any write
    # takes: its writer here is this live, young process, which may still be linking its names)


def test_the_last_name_of_an_extent_is_removed_with_it_and_leaves_nothing(tmp_path):
    gone, last, name, extent = _packed_pair(tmp_path)
    with DiskTier(tmp_path, 1 << 30) as tier:
        assert tier.delete(last)
        assert tier.used_bytes == 0
    assert not name.exists() and not extent.exists() and not any(tmp_path.rglob("*.tmp"))


def test_a_block_file_of_its_own_is_still_indexed_at_restart(tmp_path):
    key = _key(2)
    with DiskTier(tmp_path, 1 << 30) as tier:
        assert tier.put(key, _payload(2)) is Status.OK
    with DiskTier(tmp_path, 1 << 30) as tier:
        out = np.empty(_payload(2).nbytes, np.uint8)
        assert tier.get(key, out) is Status.OK and np.array_equal(out, _payload(2))
        assert tier.stats.verify_failures == 0
    assert os.path.exists(tier.path_of(key))


def test_an_extent_whose_own_name_cannot_be_removed_keeps_its_last_block_whole_and_the_retry_cleans_up(
        tmp_path, monkeypatch):
    """The last name is parked under a temp name, then the extent's own name refused (EIO): the name
    is put back, the block stays whole and withheld, and the retry removes the extent and the name
    (left parked, the retry took the ordinary path and left the extent and the temp on disk,
    uncounted: audit s33 r12 D1)."""
    import errno

    import kvtier.tiers.disk as disk

    gone, last, name, extent = _packed_pair(tmp_path)
    real = disk._unlink_name
    refused = []

    def refuse_the_extent_once(path):
        if path.endswith(".kvx") and not refused:
            refused.append(path)
            raise OSError(errno.EIO, "injected", path)
        return real(path)

    with DiskTier(tmp_path, 1 << 30) as tier:
        monkeypatch.setattr(disk, "_unlink_name", refuse_the_extent_once)
        assert not tier.delete(last) and refused
        assert name.exists() and not any(tmp_path.rglob("*.tmp")), "the name is put back"
        assert tier.delete(last)
        tier.check_integrity(deep=True)
        assert tier.used_bytes == 0
    assert not name.exists() and not extent.exists() and not any(tmp_path.rglob("*.tmp"))
