"""Real vLLM engines sharing KV through a Mooncake Store fleet (real mooncake_master + two segment
holders): engine A computes prompts and stores their blocks in the fleet; engine B, another
process with no block of its own (as if on another node), loads them. Every load lands in pages
poisoned with NaN first (the suite's ``KVTIER_DEBUG_POISON``), so a load that writes nothing
fails the comparison."""

from __future__ import annotations

import pytest

from tests.integrations.vllm.harness import assert_loads_what_another_computed, skip_without_vllm
from tests.tiers.mooncake_harness import mooncake_available, shared_cluster

skip_without_vllm()

pytestmark = [pytest.mark.timeout(480),
              pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))]

BLOCK_TOKENS = 64


def fleet_extra(cluster, secret_file) -> dict:
    # host_bytes 0: no tier but the fleet; write-through, so a block is in the fleet once saved
    return {"block_tokens": BLOCK_TOKENS, "host_bytes": 0, "write_mode": "write-through",
            "mooncake_master": cluster.master_address, "mooncake_metadata": cluster.metadata_url,
            "mooncake_secret_file": str(secret_file)}


@pytest.fixture(scope="module")
def pair(engines, tiny_model, tmp_path_factory):
    cluster = shared_cluster()
    secret = tmp_path_factory.mktemp("mooncake-secret") / "fleet.secret"
    secret.write_bytes(b"k" * 32)
    secret.chmod(0o600)
    a = engines("mooncake-a", {"model": tiny_model, "extra": fleet_extra(cluster, secret)})
    b = engines("mooncake-b", {"model": tiny_model, "extra": fleet_extra(cluster, secret)})
    for e in (a, b):
        e.wait_ready()
    return a, b


def test_an_engine_loads_from_the_fleet_what_another_computed(pair):
    a, b = pair
    assert_loads_what_another_computed(a, b, BLOCK_TOKENS, seed=23)
