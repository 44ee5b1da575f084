"""``kvtier serve`` backed by a Mooncake Store fleet: a pod's server spills what its DRAM pool
evicts to the fleet and loads it back from there. Real processes: mooncake_master, two segment
holders, the kvtier server, a client over TCP."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.server.config import load_config
from kvtier.server.launch import ServerProcess
from kvtier.tiers.base import Status
from tests.server.conftest import block, keys_for, remote
from tests.server.harness import SHARED, tenants
from tests.tiers.mooncake_harness import mooncake_available, shared_cluster

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

SLOT = 128 * 1024


def _serve(tmp_path, **server):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return ServerProcess.start(tenants(), shared=SHARED, workdir=str(tmp_path),
                               server={"capacity": 4 * SLOT, "max_block": SLOT, **server})


def _round_trip(srv, tag: str) -> list[Status]:
    tier = remote(srv, "acme", namespace=tag)
    try:
        keys = keys_for(tag, 12)
        assert tier.put_many(keys, [block(k, SLOT) for k in keys]) == [Status.OK] * 12
        outs = [np.full(SLOT, 0xA5, np.uint8) for _ in keys]
        statuses = tier.get_many(keys, outs)
        for s, o, k in zip(statuses, outs, keys):
            assert s is not Status.OK or np.array_equal(o, block(k, SLOT)), "a wrong block came back"
        return statuses
    finally:
        tier.close()


def test_a_server_spills_to_the_fleet_and_loads_back_from_it(tmp_path):
    cluster = shared_cluster()
    secret = tmp_path / "mooncake.secret"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    with _serve(tmp_path / "fleet", mooncake_master=cluster.master_address, mooncake_metadata=cluster.metadata_url,
                mooncake_secret_file=str(secret)) as srv:
        # 12 blocks, 4 fit in DRAM: 8 were evicted to the fleet and come back from it, whole
        assert _round_trip(srv, "fleet") == [Status.OK] * 12
    # control: the same server without the fleet loses what DRAM evicted
    with _serve(tmp_path / "alone") as srv:
        assert _round_trip(srv, "alone").count(Status.OK) <= 4


def test_a_fleet_without_a_secret_is_a_config_error_that_names_the_fix():
    with pytest.raises(ConfigError, match="mooncake_secret_file"):
        load_config(None, env={}, overrides={"mooncake_master": "127.0.0.1:1"})
