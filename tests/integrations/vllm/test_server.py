"""Real vLLM engines sharing a kvtier server: a fresh engine reuses what another stored,
prefill/decode disaggregation, and a server that dies mid-run."""

from __future__ import annotations

import time

import pytest

from tests.integrations.vllm.harness import loaded_tokens, prompts, skip_without_vllm

skip_without_vllm()

pytestmark = pytest.mark.timeout(480)

TOKEN = "vllm-test-token"
BLOCK_TOKENS = 64


def remote_extra(url: str) -> dict:
    # host_bytes 0: every lookup, load and save goes to the server.
    return {"block_tokens": BLOCK_TOKENS, "host_bytes": 0, "remote_url": url, "remote_token": TOKEN}


def expected_hit(length: int) -> int:
    return min(length // BLOCK_TOKENS * BLOCK_TOKENS, (length - 2) // 32 * 32)


@pytest.fixture(scope="module")
def servers():
    from kvtier.server.launch import ServerProcess

    shared = ServerProcess.start({"acme": TOKEN})
    doomed = ServerProcess.start({"acme": TOKEN})
    yield shared, doomed
    shared.stop()
    doomed.stop()


@pytest.fixture(scope="module")
def cluster(engines, tiny_model, servers):
    """A prefill-only instance, a decode-only instance (both on one server), and an engine on a second server."""
    shared, doomed = servers
    producer = engines("producer", {"model": tiny_model, "extra": remote_extra(shared.url), "role": "kv_producer"})
    consumer = engines("consumer", {"model": tiny_model, "extra": remote_extra(shared.url), "role": "kv_consumer"})
    survivor = engines("survivor", {"model": tiny_model, "extra": remote_extra(doomed.url)})
    for engine in (producer, consumer, survivor):
        engine.wait_ready()
    return producer, consumer, survivor


def test_fresh_engine_process_loads_what_another_stored_through_the_server(cluster):
    producer, consumer, _ = cluster
    batch = prompts(2, 350, seed=11)
    first = producer.generate(batch, max_tokens=10)
    assert all(loaded_tokens(o) == 0 for o in first)
    producer.call(op="flush")
    second = consumer.generate(batch, max_tokens=10)
    for prompt, a, b in zip(batch, first, second):
        assert loaded_tokens(b) == expected_hit(len(prompt)) > 0
        assert b["token_ids"] == a["token_ids"] and b["logprobs"] == a["logprobs"]


def test_prefill_decode_disaggregation_matches_a_single_instance(cluster):
    producer, consumer, _ = cluster
    batch = prompts(2, 420, seed=12)
    # Prefill instance: computes the prompt and one token; announces the blocks it stores.
    prefilled = producer.generate(batch, max_tokens=1)
    handoff = [o["kv_transfer_params"] for o in prefilled]
    assert all(p["kvtier_blocks"] == len(q) // BLOCK_TOKENS for p, q in zip(handoff, batch))
    # Decode instance: no flush in between; it waits for the announced blocks, loads, continues.
    decoded = consumer.generate(batch, max_tokens=16, kv_transfer_params=handoff)
    # A single instance from scratch (the producer never loads; its own prefix cache is reset).
    producer.call(op="reset")
    single = producer.generate(batch, max_tokens=16)
    for prompt, d, s in zip(batch, decoded, single):
        assert loaded_tokens(d) == expected_hit(len(prompt)) > 0
        assert loaded_tokens(s) == 0
        assert d["token_ids"] == s["token_ids"] and d["logprobs"] == s["logprobs"]


def test_requests_complete_when_the_server_is_killed_mid_run(cluster, servers):
    _, _, survivor = cluster
    _, doomed = servers
    batch = prompts(3, 380, seed=13)
    reference = survivor.generate(batch, max_tokens=24)
    survivor.call(op="flush")
    survivor.call(op="reset")
    failed_before = survivor.call(op="stats")["worker"]["failed_pages"]
    # The server dies inside the first request: after its lookup hit, as its load starts.
    survivor.call(op="kill_on_next_load", pid=doomed.proc.pid)
    fresh = prompts(2, 300, seed=14)
    start = time.monotonic()
    during = survivor.generate(batch + fresh, max_tokens=24)
    assert time.monotonic() - start < 120, "a dead server must cost a bounded timeout, not hang"
    assert doomed.proc.wait(timeout=10) == -9
    assert len(during) == 5 and all(len(o["token_ids"]) == 24 for o in during)
    assert all(loaded_tokens(o) == 0 for o in during), "the first load failed, later lookups miss"
    stats = survivor.call(op="stats")
    assert stats["worker"]["failed_pages"] - failed_before == expected_hit(len(batch[0])) // 32
    assert stats["scheduler"]["lookup_errors"] == 0, "the remote tier reports a dead server as a miss"
    for ref, got in zip(reference, during):
        assert got["token_ids"] == ref["token_ids"] and got["logprobs"] == ref["logprobs"]
