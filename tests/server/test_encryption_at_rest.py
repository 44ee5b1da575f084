"""Server-side encryption at rest: spilled blocks are sealed per owner; erasing a tenant shreds its keys."""

from __future__ import annotations

import numpy as np

from kvtier.cli.admin import admin_call
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import SHARED, TOKENS, tenants

SLOT = 128 * 1024


def test_spilled_blocks_are_ciphertext_and_erasure_shreds_the_tenant(tmp_path):
    disk = tmp_path / "disk"
    env = {"KVTIER_MASTER_KEY": "5a" * 32}
    with ServerProcess.start(tenants(), shared=SHARED, admin_token=TOKENS["admin"], workdir=str(tmp_path), env=env,
                             server={"capacity": 4 * SLOT, "max_block": SLOT, "disk_dir": str(disk),
                                     "disk_capacity": "16MiB", "encrypt_at_rest": True}) as srv:
        acme = remote(srv, "acme", namespace="rest")
        globex = remote(srv, "globex", namespace="rest")
        mine, theirs = keys_for("acme-rest", 8), keys_for("globex-rest", 8)
        assert acme.put_many(mine, [block(k, SLOT) for k in mine]) == [Status.OK] * 8
        assert globex.put_many(theirs, [block(k, SLOT) for k in theirs]) == [Status.OK] * 8
        files = list(disk.rglob("*.kvb"))
        assert len(files) >= 8, "blocks should have spilled to disk"
        on_disk = b"".join(f.read_bytes() for f in files)
        for k in mine + theirs:
            assert block(k, SLOT).tobytes()[:512] not in on_disk, "plaintext KV on disk"
        # every block reads back whole, from DRAM or from the sealed spill
        outs = [np.zeros(SLOT, np.uint8) for _ in mine]
        assert acme.get_many(mine, outs) == [Status.OK] * 8
        assert all(np.array_equal(o, block(k, SLOT)) for o, k in zip(outs, mine))
        result = admin_call(srv.tcp_url, TOKENS["admin"], "erase", {"tenant": "acme"})
        assert result["ok"] and result["keys_shredded"] is True
        assert acme.lookup_prefix(mine) == 0
        # the other tenant is untouched (control)
        outs = [np.zeros(SLOT, np.uint8) for _ in theirs]
        assert globex.get_many(theirs, outs) == [Status.OK] * 8
        assert all(np.array_equal(o, block(k, SLOT)) for o, k in zip(outs, theirs))


def test_encryption_at_rest_needs_a_spill_tier_and_a_key(monkeypatch):
    import pytest

    from kvtier.errors import ConfigError
    from kvtier.server.config import ServerConfig

    monkeypatch.delenv("KVTIER_MASTER_KEY", raising=False)
    with pytest.raises(ConfigError, match="set disk_dir too"):
        ServerConfig(encrypt_at_rest=True)
    with pytest.raises(ConfigError, match="KVTIER_MASTER_KEY"):
        ServerConfig(encrypt_at_rest=True, disk_dir="/tmp/x", disk_capacity_bytes=1 << 30)
