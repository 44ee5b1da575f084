"""An encrypted tier whose keyring cannot name a block (its tenant's key file unreadable) does not
answer a delete "not stored": the sealed copy stays below, so the removal is refused -- reported to
the store, which raises ``DeleteRefused`` (an erasure is never reported done) -- and the block is
withheld, removed at the next look at its key once the key file reads again. (0254380 answered
every keyring failure of a delete as "not stored": the erasure was reported done, and the block
was served again once the file read again, or after a restart: audit s33 a2 D1.)"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.core.keys import BlockKey
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.store.tiered import DeleteRefused, TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.encrypted import EncryptedTier

NBYTES = 4096


def _key_file(keys_dir):
    (path,) = (f for f in keys_dir.glob("*.json") if f.name != "keystore-check.json")  # the tenant's keys
    return path


def _sealed_store(tmp_path) -> tuple[TieredStore, DiskTier]:
    # refresh_s=0: the keyring looks at its file at every use, so a failure shows at once
    keyring = Keyring(StaticMasterKey(bytes(range(32))), tmp_path / "keys", refresh_s=0.0)
    disk = DiskTier(tmp_path / "disk", 16 << 20, direct_io=False)
    return TieredStore([EncryptedTier(disk, keyring, "acme", threads=1)]), disk


def test_a_delete_the_keyring_cannot_name_is_refused_and_the_block_is_removed_once_it_can(tmp_path):
    store, disk = _sealed_store(tmp_path)
    key, data = BlockKey(bytes(range(32))), np.arange(NBYTES, dtype=np.uint8)
    out = np.zeros(NBYTES, np.uint8)
    try:
        assert store.put([key], [data]) == [Status.OK]
        key_file = _key_file(tmp_path / "keys")
        saved = key_file.read_bytes()
        key_file.unlink()
        key_file.mkdir()  # reading it fails: IsADirectoryError (EIO, ESTALE on a shared key store)
        with pytest.raises(DeleteRefused) as refused:
            store.delete([key])  # answered 0 removed, no exception: "not stored"
        assert refused.value.removed == 0
        assert [r.key for r in refused.value.refused] == [key]
        assert isinstance(refused.value.refused[0].error, IsADirectoryError)
        assert sum(1 for _ in disk.keys()) == 1  # the sealed copy is still below: not done
        assert store.get([key], [out]).statuses == [Status.ERROR]  # the key file still unreadable
        key_file.rmdir()
        key_file.write_bytes(saved)  # the key file reads again
        # withheld: the removal is done at the next look at the key, never the block served again
        assert store.get([key], [out]).statuses == [Status.MISS]
        assert not out.any()
        assert list(disk.keys()) == []
    finally:
        store.close()


def test_a_put_of_a_withheld_block_stores_it_anew_once_its_removal_is_done(tmp_path):
    store, disk = _sealed_store(tmp_path)
    key = BlockKey(bytes(range(1, 33)))
    old, new = np.full(NBYTES, 1, np.uint8), np.full(NBYTES, 2, np.uint8)
    out = np.zeros(NBYTES, np.uint8)
    try:
        assert store.put([key], [old]) == [Status.OK]
        key_file = _key_file(tmp_path / "keys")
        saved = key_file.read_bytes()
        key_file.unlink()
        key_file.mkdir()
        with pytest.raises(DeleteRefused):
            store.delete([key])
        assert store.put([key], [new]) == [Status.ERROR]  # nothing is sealed without the keys
        key_file.rmdir()
        key_file.write_bytes(saved)
        # not "already stored" on the old copy's account: removed first, then stored anew
        assert store.put([key], [new]) == [Status.OK]
        assert store.get([key], [out]).statuses == [Status.OK]
        assert (out == new).all()
        assert sum(1 for _ in disk.keys()) == 1
        assert store.delete([key]) == 1  # an ordinary delete: nothing withheld is left to refuse it
    finally:
        store.close()
