"""Real vLLM engines sharing KV through a Mooncake Store fleet (real mooncake_master + two segment
holders): engine A, a prefill instance (``kv_producer``), computes prompts and stores their
blocks in the fleet; engine B, a decode instance (``kv_consumer``) in another process with no
block of its own (as if on another node), loads them — alone, and as prefill/decode
disaggregation through the fleet, the handoff carrying only the block count. Every load lands
in pages poisoned with NaN first (the suite's ``KVTIER_DEBUG_POISON``), so a load that writes
nothing fails the comparison."""

from __future__ import annotations

import pytest

from tests.integrations.vllm.harness import (assert_loads_what_another_computed, expected_hit, loaded_tokens,
                                             prompts, skip_without_vllm)
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
    a = engines("mooncake-a", {"model": tiny_model, "extra": fleet_extra(cluster, secret), "role": "kv_producer"})
    b = engines("mooncake-b", {"model": tiny_model, "extra": fleet_extra(cluster, secret), "role": "kv_consumer"})
    for e in (a, b):
        e.wait_ready()
    return a, b


def test_an_engine_loads_from_the_fleet_what_another_computed(pair):
    a, b = pair
    assert_loads_what_another_computed(a, b, BLOCK_TOKENS, seed=23)


def test_prefill_decode_disaggregation_through_the_fleet_matches_a_single_instance(pair):
    prefill, decode = pair
    batch = prompts(2, 420, seed=29)
    # The prefill instance computes each prompt and one token and announces the blocks it stores.
    handoff = [o["kv_transfer_params"] for o in prefill.generate(batch, max_tokens=1)]
    assert all(p["kvtier_blocks"] == len(q) // BLOCK_TOKENS for p, q in zip(handoff, batch))
    # No flush in between: the decode instance waits until the fleet shows the announced
    # blocks (the prefill's puts are asynchronous), loads them and goes on decoding.
    decoded = decode.generate(batch, max_tokens=16, kv_transfer_params=handoff)
    # Positive control, computed without kvtier loading anything: the prefill instance never
    # loads (kv_producer), and its own prefix cache is reset first.
    prefill.call(op="reset")
    single = prefill.generate(batch, max_tokens=16)
    for prompt, d, s in zip(batch, decoded, single):
        assert loaded_tokens(d) == expected_hit(len(prompt), BLOCK_TOKENS) > 0
        assert loaded_tokens(s) == 0
        assert d["token_ids"] == s["token_ids"] and d["logprobs"] == s["logprobs"]
