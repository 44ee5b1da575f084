"""A remover killed between the two unlinks of a packed block's last name leaves no "corrupt" block.

Removing the last block of an extent unlinks the extent's own name first, then the block's name
(see :mod:`kvtier.tiers.disk_extents`). A SIGKILL in between leaves the block's name as the only
link to the whole extent: a file whose first page is the extent's table, not a block header. A
restart took it for a block file of its own, and the first read judged it CORRUPT (a verification
failure), which the SIGKILL test (``tests/tiers/test_disk_kill.py``, packed extents) caught on a
loaded machine. The restart must finish that removal instead: nothing was torn, nothing is wrong.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import PAGE
from kvtier.tiers.disk import DiskTier


def _key(i: int) -> bytes:
    return hashlib.sha256(b"s33-kill-removal/%d" % i).digest()


def _payload(i: int, nbytes: int = 3 * PAGE + 100) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def _left_as_a_killed_remover_leaves_it(path: Path) -> tuple[bytes, bytes, Path]:
    """Two blocks packed in one extent, one evicted, and the removal of the other cut off right
    after the extent's own name went: (removed key, key whose name is left, that name)."""
    gone, last = _key(0), _key(1)
    with DiskTier(path, 1 << 30) as tier:
        assert tier.put_many([gone, last], [_payload(0), _payload(1)]) == [Status.OK, Status.OK]
        assert tier.delete(gone)
        name = Path(tier.path_of(last))
    (extent,) = path.rglob("*.kvx")
    assert extent.stat().st_ino == name.stat().st_ino and name.stat().st_nlink == 2
    extent.unlink()  # what _remove does first; SIGKILL lands before the block's name goes
    assert name.stat().st_nlink == 1
    return gone, last, name


def test_restart_finishes_a_removal_killed_between_the_extent_and_its_last_name(tmp_path):
    gone, last, name = _left_as_a_killed_remover_leaves_it(tmp_path)
    with DiskTier(tmp_path, 1 << 30) as tier:
        assert last not in set(tier.keys()) and gone not in set(tier.keys())
        assert tier.get(last, np.empty(_payload(1).nbytes, np.uint8)) is Status.MISS
        assert tier.stats.verify_failures == 0, "an interrupted removal is no corrupt block"
        assert tier.used_bytes == 0
        tier.check_integrity(deep=True)
    assert not name.exists(), "the removal the killed process began is finished"
    assert not any(tmp_path.rglob("*.kvx")) and not any(tmp_path.rglob("*.tmp"))


def test_a_block_file_of_its_own_is_still_indexed_at_restart(tmp_path):
    key = _key(2)
    with DiskTier(tmp_path, 1 << 30) as tier:
        assert tier.put(key, _payload(2)) is Status.OK
    with DiskTier(tmp_path, 1 << 30) as tier:
        out = np.empty(_payload(2).nbytes, np.uint8)
        assert tier.get(key, out) is Status.OK and np.array_equal(out, _payload(2))
        assert tier.stats.verify_failures == 0
    assert os.path.exists(tier.path_of(key))
