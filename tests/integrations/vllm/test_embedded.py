"""Real vLLM with the kvtier connector and an embedded store (host DRAM + disk), in one engine."""

from __future__ import annotations

import pytest

from tests.integrations.vllm.harness import loaded_tokens, prompts, skip_without_vllm

skip_without_vllm()

pytestmark = pytest.mark.timeout(400)

BLOCK_TOKENS = 64  # two vLLM pages of 32


@pytest.fixture(scope="module")
def engine(engines, tiny_model, tmp_path_factory):
    extra = {
        "block_tokens": BLOCK_TOKENS,
        "host_bytes": "32MiB",
        "disk_path": str(tmp_path_factory.mktemp("kvtier-disk")),
        "disk_bytes": "256MiB",
    }
    engine = engines("embedded", {"model": tiny_model, "extra": extra})
    engine.wait_ready()
    return engine


def expected_hit(length: int) -> int:
    """Whole kvtier blocks, cut to whole 32-token pages that leave two tokens to compute."""
    return min(length // BLOCK_TOKENS * BLOCK_TOKENS, (length - 2) // 32 * 32)


def test_reset_prefix_cache_then_load_from_kvtier_gives_identical_tokens_and_logprobs(engine):
    # 300, 337, 374 tokens; 384 (whole blocks) and 385 (one past a page) leave 32 and 33 tokens to compute
    batch = prompts(3, 300, seed=1) + prompts(1, 384, seed=2) + prompts(1, 385, seed=3)
    first = engine.generate(batch, max_tokens=12)
    assert all(loaded_tokens(o) == 0 for o in first), "a fresh store holds nothing"
    engine.call(op="flush")
    assert engine.call(op="reset")["ok"], "vLLM's prefix cache must be empty for the second run"
    second = engine.generate(batch, max_tokens=12)
    for prompt, a, b in zip(batch, first, second):
        assert loaded_tokens(b) == expected_hit(len(prompt)) > 0
        assert b["num_cached_tokens"] == loaded_tokens(b)
        assert b["token_ids"] == a["token_ids"]
        assert b["logprobs"] == a["logprobs"], "top-5 logprobs must be identical, not merely close"
    stats = engine.call(op="stats")
    assert stats["worker"]["failed_pages"] == 0
    blocks_read = sum(-(-expected_hit(len(p)) // BLOCK_TOKENS) for p in batch)  # a partial block is read whole
    assert stats["worker"]["loaded_blocks"] == blocks_read


def test_another_cache_salt_never_hits(engine):
    prompt = prompts(1, 320, seed=4)
    alice = engine.generate(prompt, max_tokens=4, cache_salt="alice")
    engine.call(op="flush")
    engine.call(op="reset")
    bob = engine.generate(prompt, max_tokens=4, cache_salt="bob")
    unsalted = engine.generate(prompt, max_tokens=4)
    assert loaded_tokens(bob[0]) == 0 and bob[0]["num_cached_tokens"] == 0
    assert loaded_tokens(unsalted[0]) == 0
    engine.call(op="flush")
    engine.call(op="reset")
    again = engine.generate(prompt, max_tokens=4, cache_salt="alice")
    assert loaded_tokens(again[0]) == expected_hit(320), "the salted blocks are there, for their own salt"
    assert again[0]["token_ids"] == alice[0]["token_ids"]


def test_failed_loads_are_recomputed(engine):
    batch = prompts(2, 400, seed=7)
    first = engine.generate(batch, max_tokens=6)
    engine.call(op="flush")
    engine.call(op="reset")
    before = engine.call(op="stats")["worker"]["failed_pages"]
    engine.call(op="break_loads")
    try:
        second = engine.generate(batch, max_tokens=6)
    finally:
        engine.call(op="fix_loads")
    after = engine.call(op="stats")["worker"]["failed_pages"]
    assert after - before == sum(expected_hit(len(p)) // 32 for p in batch), "every page planned was reported"
    for a, b in zip(first, second):
        assert b["token_ids"] == a["token_ids"] and b["logprobs"] == a["logprobs"]
