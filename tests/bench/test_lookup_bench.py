"""``kvtier bench lookup`` keys and finds the whole prompt both ways (token ids, vLLM's block hashes)."""

import pytest

from kvtier.bench import lookup


@pytest.mark.parametrize("block_tokens", [16, 256])
def test_lookup_bench_reports_both_keyings_on_a_full_hit(block_tokens):
    result = lookup.run(tokens=4096, block_tokens=block_tokens, runs=2)
    assert result["blocks"] == result["hit_blocks"] == 4096 // block_tokens
    for name in ("lookup_ms", "keys_ms", "prefix_lookup_ms", "vllm_lookup_ms", "vllm_keys_ms"):
        assert result[name] > 0
    assert result["vllm_page_tokens"] == 16
