"""A DELETE of spilled blocks while the tenant's key file cannot be read is not answered "deleted":
the sealed files stay on disk, and a restart finds them (with 0254380 every block was answered
deleted, and served again after the restart: audit s33 a2 D1)."""

from __future__ import annotations

import os
import time

import numpy as np

from kvtier.tiers.base import Status
from tests.server.conftest import keys_for
from tests.server.inprocess import InProcessServer

BLOCK = 256 << 10


def test_a_delete_the_key_store_cannot_carry_out_is_not_answered_deleted(tmp_path):
    (tmp_path / "master.key").write_bytes(os.urandom(32).hex().encode())
    os.chmod(tmp_path / "master.key", 0o600)
    config = dict(disk_dir=str(tmp_path / "disk"), disk_capacity="32MiB", encrypt_at_rest=True,
                  master_key_file=str(tmp_path / "master.key"))
    keys = keys_for("s33-sealed-delete", 40)  # 10 MiB through a 4 MiB pool: most spill to the sealed disk
    srv = InProcessServer(tmp_path, **config)
    tier = srv.remote("acme", namespace="s33d1")
    try:
        assert tier.put_many(keys, [np.full(BLOCK, i, np.uint8) for i in range(40)]) == [Status.OK] * 40
        key_files = [f for f in (tmp_path / "disk" / "keys").glob("*.json") if f.name != "keystore-check.json"]
        saved = {f: f.read_bytes() for f in key_files}
        for f in key_files:
            f.unlink()
            f.mkdir()  # the key files cannot be read (IsADirectoryError)
        time.sleep(1.2)  # past the keyring's refresh_s: it looks at them again
        deleted = tier.delete_many(keys)
        assert not all(deleted)  # the spilled ones could not be removed
        for f, content in saved.items():
            f.rmdir()
            f.write_bytes(content)
    finally:
        tier.close()
        srv.stop()
    srv = InProcessServer(tmp_path, **config)  # a restart on the same disk and key store
    tier = srv.remote("acme", namespace="s33d1")
    out = np.zeros(BLOCK, np.uint8)
    try:
        served = [i for i, k in enumerate(keys) if tier.get(k, out) is Status.OK]
    finally:
        tier.close()
        srv.stop()
    assert served, "the blocks not deleted are still there"
    assert not [i for i in served if deleted[i]], "a block answered deleted came back"
