"""TieredStore.delete when a tier cannot remove a copy (audit s26/audit_faults D2): the disk tier's
file system refuses the unlink. The delete is not reported done (DeleteRefused, after every tier
was asked), and no tier serves the block again; once the file system allows it, a delete again
finishes the erasure."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from kvtier.errors import TierError
from kvtier.store.tiered import DeleteRefused, TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier

NB = 8192


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, NB, dtype=np.uint8)


@pytest.fixture
def refusing(monkeypatch):
    """``refusing["on"] = True``: every unlink of a block or extent fails with EACCES (the
    tier's shard not writable by this user), as a read-only file system would with EROFS."""
    state = {"on": False}
    real = os.unlink

    def unlink(path, *a, **kw):
        if state["on"] and not os.fspath(path).endswith(".tmp"):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", unlink)
    return state


@pytest.mark.parametrize("write_mode", ["write-through", "write-behind"])
def test_a_delete_the_disk_refuses_raises_and_the_block_is_served_by_no_tier(tmp_path, refusing, write_mode):
    disk = DiskTier(tmp_path / "d", 1 << 22)
    store = TieredStore([HostTier(8 * NB, NB), disk], write_mode=write_mode)
    try:
        keys = [k(1), k(2)]
        assert store.put(keys, [data(1), data(2)]) == [Status.OK] * 2
        store.flush_dirty(10)
        assert store.lookup(keys).hit_blocks == 2 and disk.contains(k(1))  # control: on disk too
        refusing["on"] = True
        with pytest.raises(DeleteRefused) as caught:
            store.delete([k(1)])
        assert isinstance(caught.value, TierError)
        assert caught.value.removed == 1  # the host copy
        assert [r.key for r in caught.value.refused] == [k(1)]
        assert os.path.lexists(disk.path_of(k(1)))  # the disk copy is still there...
        out = np.empty(NB, np.uint8)
        assert store.get([k(1)], [out]).statuses == [Status.MISS]  # ...but served by no tier
        assert store.lookup(keys).hit_blocks == 0
        assert store.get([k(2)], [out]).statuses == [Status.OK]  # the other block is untouched
        store.check_integrity()
        refusing["on"] = False
        assert store.delete([k(1)]) == 1  # the disk copy, removed now
        assert not os.path.lexists(disk.path_of(k(1)))
        assert store.get([k(1)], [out]).statuses == [Status.MISS]
    finally:
        refusing["on"] = False
        store.close()


def test_a_delete_of_blocks_already_gone_raises_nothing(tmp_path):
    """Control: ENOENT is a normal delete."""
    disk = DiskTier(tmp_path / "d", 1 << 22)
    store = TieredStore([HostTier(8 * NB, NB), disk], write_mode="write-through")
    try:
        assert store.put([k(1)], [data(1)]) == [Status.OK]
        os.unlink(disk.path_of(k(1)))
        assert store.delete([k(1), k(3)]) == 2  # the host copy, and the disk's index entry
        assert store.delete([k(1)]) == 0
    finally:
        store.close()
