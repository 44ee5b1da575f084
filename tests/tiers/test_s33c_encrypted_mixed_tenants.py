"""An encrypted tier with one tenant per key (``tenant_of``: the server's sealed disk and fleet) fails
only the blocks of the tenant whose keyring fails. A batch mixing tenants failed whole: with one
tenant's key file unreadable, another tenant's blocks of the batch were not stored (a spill of host
evictions) and its reads missed (audit s33 r4 D4)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.core.keys import BlockKey
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.encrypted import EncryptedTier

NBYTES = 4096
A1, A2, B1, B2, B3 = (BlockKey(bytes([i]) * 32) for i in range(1, 6))
OWNERS = {A1: "alice", A2: "alice", B1: "bob", B2: "bob", B3: "bob"}


def fill(value: int) -> np.ndarray:
    return np.full(NBYTES, value, np.uint8)


@pytest.fixture
def sealed(tmp_path):
    keyring = Keyring(StaticMasterKey(bytes(range(32))), tmp_path / "keys", refresh_s=0.0)
    tier = EncryptedTier(DiskTier(tmp_path / "disk", 16 << 20, direct_io=False), keyring, tenant_of=OWNERS.get,
                         threads=1)
    yield tier, keyring, tmp_path / "keys"
    tier.close()


def _unreadable(keys_dir, keyring: Keyring, tenant: str) -> None:
    key_file = keys_dir / keyring._file(tenant).name
    key_file.unlink()
    key_file.mkdir()  # reading it fails: IsADirectoryError


def test_one_tenants_key_file_fails_only_its_blocks_of_a_batch(sealed):
    tier, keyring, keys_dir = sealed
    assert tier.put_many([A1, B1], [fill(1), fill(2)]) == [Status.OK] * 2
    _unreadable(keys_dir, keyring, "alice")
    assert tier.put_many([B2, A2, B3], [fill(3), fill(4), fill(5)]) == [Status.OK, Status.ERROR, Status.OK]
    outs = [np.zeros(NBYTES, np.uint8) for _ in range(4)]
    assert tier.get_many([B1, A1, B2, B3], outs) == [Status.OK, Status.ERROR, Status.OK, Status.OK]
    assert [int(o[0]) for o in outs] == [2, 0, 3, 5]


def test_a_tenants_withheld_block_fails_only_its_blocks_of_a_batch(sealed):
    tier, keyring, keys_dir = sealed
    assert tier.put_many([A1, B1], [fill(1), fill(2)]) == [Status.OK] * 2
    _unreadable(keys_dir, keyring, "alice")
    assert tier.delete(A1) is False  # refused: withheld until the keyring can name it
    assert tier.put_many([B2, A1], [fill(3), fill(4)]) == [Status.OK, Status.ERROR]
    outs = [np.zeros(NBYTES, np.uint8) for _ in range(2)]
    assert tier.get_many([B1, A1], outs) == [Status.OK, Status.ERROR]
    assert [int(o[0]) for o in outs] == [2, 0]
