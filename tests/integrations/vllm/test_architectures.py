"""Real vLLM with the kvtier connector on geometries the rest of the suite does not use.

The suite's tiny Llama has 2 KV heads of 32 dims in fp32. Here: a Qwen2 (attention biases) with
one KV head of 64 dims (multi-query attention) and three layers, whose pages have another
shape. A store that got the page layout wrong for it (heads, head size, layers) would load
the wrong bytes, and the poisoned pages (the suite's ``KVTIER_DEBUG_POISON``) catch a load
that writes nothing.

What "equal" means on such a model: vLLM's own prefix-cache hit changes the shape of the
computed tail, which moves a logprob by an ulp or two against the full recompute on some
geometries (measured: up to 1e-6 here), so the exact reference for a kvtier hit is vLLM's
own hit over the same prefix, in an engine without any connector. The positive control:
that own hit really is a hit.
"""

from __future__ import annotations

import pytest

from kvtier.integrations.vllm.engine_proc import PAGE_TOKENS
from tests.integrations.vllm.harness import expected_hit, loaded_tokens, prompts, skip_without_vllm

skip_without_vllm()

pytestmark = pytest.mark.timeout(400)

#: lengths whose cacheable prefix is the same for vLLM (leaves >= 1 token) and kvtier (>= 2)
LENGTHS = (300, 337, 374)


@pytest.fixture(scope="module")
def qwen2_mqa(tmp_path_factory) -> str:
    from transformers import Qwen2Config

    from kvtier.integrations.transformers.models import ModelSpec, build_model

    spec = ModelSpec(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                     intermediate_size=512, vocab_size=2048, max_position_embeddings=2048, seed=3)
    out = tmp_path_factory.mktemp("qwen2-mqa")
    build_model(spec, out, config_class=Qwen2Config)
    return str(out)


def _batch() -> list[list[int]]:
    batch = [p for length in LENGTHS for p in prompts(1, length, seed=length)]
    assert [len(p) for p in batch] == list(LENGTHS)
    return batch


def test_a_kvtier_hit_on_a_multi_query_qwen2_equals_vllms_own_hit(engines, qwen2_mqa):
    batch = _batch()
    plain = engines("qwen2-plain", {"model": qwen2_mqa, "extra": None})
    kv = engines("qwen2-kvtier", {"model": qwen2_mqa, "extra": {"block_tokens": PAGE_TOKENS,
                                                                 "host_bytes": "64MiB"}})
    plain.wait_ready()
    kv.wait_ready()

    recompute = plain.generate(batch, max_tokens=8)
    own_hit = plain.generate(batch, max_tokens=8)   # the same engine again: vLLM's prefix cache
    cold = kv.generate(batch, max_tokens=8)
    kv.call(op="flush")
    assert kv.call(op="reset")["ok"], "vLLM's prefix cache must be empty for the kvtier run"
    assert kv.call(op="stats")["worker"]["poison"], "the suite runs every engine with poisoned loads"
    warm = kv.generate(batch, max_tokens=8)

    for prompt, full, own, first, hit in zip(batch, recompute, own_hit, cold, warm):
        cacheable = expected_hit(len(prompt), PAGE_TOKENS, PAGE_TOKENS)
        assert own["num_cached_tokens"] == cacheable > 0, "control: vLLM's own hit covers the same prefix"
        assert loaded_tokens(first) == 0
        assert loaded_tokens(hit) == cacheable, "every whole page but the last tokens came from kvtier"
        assert first["token_ids"] == full["token_ids"] and first["logprobs"] == full["logprobs"], \
            "the connector changes nothing on a miss"
        assert hit["token_ids"] == own["token_ids"] == full["token_ids"]
        assert hit["logprobs"] == own["logprobs"], "bit-equal to vLLM's own hit over the same prefix"
        assert [[t for t, _ in step] for step in hit["logprobs"]] == [[t for t, _ in step] for step in full["logprobs"]]
        worst = max(abs(a - b) for x, y in zip(hit["logprobs"], full["logprobs"]) for (_, a), (_, b) in zip(x, y))
        assert worst < 1e-4, f"a hit moved a logprob by {worst} against the full recompute"
    assert kv.call(op="stats")["worker"]["failed_pages"] == 0
