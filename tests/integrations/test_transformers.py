"""Load instead of recompute, checked numerically on tiny random-weight models built locally.

A hit must give the logits a recompute gives (fp32: max abs difference ≤ 1e-4)
and the same greedy tokens; misses, partial hits, holes and foreign
namespaces must degrade to recompute, never to a wrong answer.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.core.keys import block_keys  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.transformers import KVTierLM, namespace_for_model, weights_identity  # noqa: E402
from kvtier.integrations.transformers.session import cache_keyword  # noqa: E402
from kvtier.integrations.transformers.models import TINY_SPEC, build_model, load_model  # noqa: E402
from kvtier.store.tiered import TieredStore  # noqa: E402
from kvtier.tiers.host import HostTier  # noqa: E402

FP32_TOL = 1e-4
BLOCK = 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    build_model(TINY_SPEC, path, tokenizer=False)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    model, _ = load_model(tiny_dir, tokenizer=False)
    return model


def host_store(namespace, blocks: int = 256) -> TieredStore:
    return TieredStore([HostTier(blocks * namespace.layout.block_nbytes, namespace.layout.block_nbytes)])


@pytest.fixture
def engines(tiny):
    ns = namespace_for_model(tiny, block_tokens=BLOCK)
    store = host_store(ns)
    cached = KVTierLM(tiny, store, ns, capacity_tokens=512)
    plain = KVTierLM(tiny, None, block_tokens=BLOCK, capacity_tokens=512)
    yield cached, plain
    cached.close()
    plain.close()
    store.check_integrity()
    store.close()


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, TINY_SPEC.vocab_size, n)


def assert_same(warm, cold) -> None:
    diff = float((warm.first_logits - cold.first_logits).abs().max())
    assert diff <= FP32_TOL, f"logits differ by {diff}"
    assert warm.tokens == cold.tokens


def test_hit_gives_the_logits_and_tokens_of_a_recompute(engines):
    cached, plain = engines
    prompt = tokens(200)
    first = cached.generate(prompt, 8)
    assert first.cached_tokens == 0
    cached.wait_saves()
    longer = np.concatenate([prompt, first.tokens, tokens(37, seed=1)])
    warm = cached.generate(longer, 8)
    cold = plain.generate(longer, 8)
    # 200 prompt + 7 fed generated tokens = 12 full blocks of 16
    assert warm.cached_tokens == 192
    assert warm.loaded_bytes == {"host": 12 * cached.layout.block_nbytes}
    assert_same(warm, cold)


def test_fully_cached_prompt_still_computes_its_last_token(engines):
    cached, plain = engines
    prompt = tokens(4 * BLOCK, seed=2)
    cached.generate(prompt, 2)
    cached.wait_saves()
    warm = cached.generate(prompt, 6)
    assert warm.cached_tokens == prompt.size - 1
    assert_same(warm, plain.generate(prompt, 6))


def test_a_conversation_hits_more_each_turn_and_matches_recompute(engines):
    cached, plain = engines
    context = tokens(70, seed=3)
    hits = []
    for turn in range(4):
        warm = cached.generate(context, 5)
        cold = plain.generate(context, 5)
        assert_same(warm, cold)
        hits.append(warm.cached_tokens)
        cached.wait_saves()
        context = np.concatenate([context, cold.tokens, tokens(23, seed=10 + turn)])
    assert hits[0] == 0 and all(b > a for a, b in zip(hits, hits[1:]))


def test_a_missing_middle_block_limits_the_hit_to_the_blocks_before_it(engines):
    cached, plain = engines
    prompt = tokens(6 * BLOCK + 5, seed=4)
    cached.generate(prompt, 2)
    cached.wait_saves()
    cached.store.delete([block_keys(cached.namespace, prompt)[3]])
    warm = cached.generate(prompt, 4, save=False)
    assert warm.cached_tokens == 3 * BLOCK
    assert_same(warm, plain.generate(prompt, 4))


def test_another_tenant_never_sees_the_blocks(tiny, engines):
    cached, _ = engines
    prompt = tokens(100, seed=5)
    cached.generate(prompt, 2)
    cached.wait_saves()
    other = KVTierLM(tiny, cached.store, cached.namespace.with_tenant("someone-else"), capacity_tokens=256)
    assert other.generate(prompt, 2, save=False).cached_tokens == 0
    other.close()


def test_storage_grows_past_its_capacity_and_stays_correct(tiny):
    ns = namespace_for_model(tiny, block_tokens=BLOCK)
    store = host_store(ns)
    small = KVTierLM(tiny, store, ns, capacity_tokens=32)  # far too small: grows while loading and decoding
    plain = KVTierLM(tiny, None, block_tokens=BLOCK, capacity_tokens=1024)
    prompt = tokens(300, seed=6)
    small.generate(prompt, 3)
    small.wait_saves()
    assert_same(small.generate(prompt, 40), plain.generate(prompt, 40))
    small.close()
    plain.close()
    store.close()


def test_hf_generate_accepts_the_prepared_cache(engines):
    cached, plain = engines
    prompt = tokens(150, seed=7)
    cached.generate(prompt, 2)
    cached.wait_saves()
    prepared = cached.prepare(prompt, extra_tokens=8)
    assert prepared.cached_tokens == 144
    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    with torch.inference_mode():
        out = cached.model.generate(ids, **{cache_keyword(cached.model): prepared.cache}, max_new_tokens=8, do_sample=False)
    assert out[0, prompt.size:].tolist() == plain.generate(prompt, 8).tokens


def test_namespace_follows_weights_config_and_block_size(tiny, tiny_dir, tmp_path):
    ns = namespace_for_model(tiny, block_tokens=BLOCK)
    assert ns.layout.dtype == "float32" and ns.layout.num_layers == TINY_SPEC.num_hidden_layers
    assert ns.layout.num_kv_heads == TINY_SPEC.num_key_value_heads
    # the files' identity, joined by the digest of the weights in memory; stable across calls
    assert ns.weights_revision.startswith(weights_identity(tiny_dir) + "+mem:")
    assert namespace_for_model(tiny, block_tokens=BLOCK) == ns
    assert namespace_for_model(tiny, block_tokens=2 * BLOCK).root != ns.root
    # Other weights (another seed), same geometry: another namespace.
    other = tmp_path / "other"
    build_model(replace(TINY_SPEC, seed=1), other, tokenizer=False)
    assert weights_identity(other) != weights_identity(tiny_dir)


def test_a_model_without_weight_files_needs_an_explicit_revision(tiny_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    in_memory = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_dir))
    with pytest.raises(ConfigError, match="weights_revision"):
        namespace_for_model(in_memory)
    assert namespace_for_model(in_memory, weights_revision="v1").weights_revision == "v1"


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_the_same_code_serves_qwen2_and_mistral(arch, tmp_path):
    from transformers import MistralConfig, Qwen2Config

    config_class = {"qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    build_model(TINY_SPEC, tmp_path, tokenizer=False, config_class=config_class, sliding_window=None)
    model, _ = load_model(tmp_path, tokenizer=False)
    assert model.config.model_type == arch
    ns = namespace_for_model(model, block_tokens=BLOCK)
    store = host_store(ns)
    cached = KVTierLM(model, store, ns, capacity_tokens=256)
    plain = KVTierLM(model, None, block_tokens=BLOCK, capacity_tokens=256)
    prompt = tokens(120, seed=8)
    cached.generate(prompt, 2)
    cached.wait_saves()
    warm = cached.generate(prompt, 6)
    assert warm.cached_tokens == 112
    assert_same(warm, plain.generate(prompt, 6))
    cached.close()
    plain.close()
    store.close()


def test_sliding_window_attention_is_refused_not_served_wrong(tmp_path):
    from transformers import MistralConfig

    build_model(TINY_SPEC, tmp_path, tokenizer=False, config_class=MistralConfig, sliding_window=64)
    model, _ = load_model(tmp_path, tokenizer=False)
    with pytest.raises(ConfigError, match="sliding"):   # at construction: a service fails at start
        KVTierLM(model, None, block_tokens=BLOCK)


def test_bf16_hit_matches_recompute_within_a_few_bf16_ulps(tmp_path):
    # bf16 keeps 8 significant bits: one rounding of a value near 1 moves it by up
    # to 2**-8 ≈ 0.004. A suffix prefill and a full prefill may sum in another
    # order, which can flip roundings in every layer, so the tolerance is a few
    # bf16 ulps of the logits' scale (0.02 at |logits| ~ 1), not fp32's 1e-4.
    # (Measured on this CPU: 0 — its kernels compute each row independently.)
    build_model(replace(TINY_SPEC, dtype="bfloat16"), tmp_path, tokenizer=False)
    model, _ = load_model(tmp_path, tokenizer=False)
    ns = namespace_for_model(model, block_tokens=BLOCK)
    assert ns.layout.dtype == "bfloat16"
    store = host_store(ns)
    cached = KVTierLM(model, store, ns, capacity_tokens=256)
    plain = KVTierLM(model, None, block_tokens=BLOCK, capacity_tokens=256)
    prompt = tokens(150, seed=9)
    cached.generate(prompt[:100], 2)
    cached.wait_saves()
    warm, cold = cached.generate(prompt, 8), plain.generate(prompt, 8)
    assert warm.cached_tokens == 96
    scale = max(1.0, float(cold.first_logits.abs().max()))
    assert float((warm.first_logits - cold.first_logits).abs().max()) <= 0.02 * scale
    assert warm.tokens == cold.tokens
    cached.close()
    plain.close()
    store.close()


def test_a_latent_attention_spec_builds_a_deepseek_whose_kv_the_planner_sizes_alike(tmp_path):
    """``latent_rank`` builds a DeepSeek-V2 (the benches' and tests' MLA model). Its KV bytes a
    token, as the benches report them, equal the planner's from the saved config.json (one
    576-wide latent row a layer), and the Llamas built before the field keep their names (and
    so their cached directories)."""
    from kvtier.integrations.transformers.models import VLLM_TEST_SPEC, ModelSpec
    from kvtier.planner.models import load_model as planner_model

    spec = ModelSpec(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=256, vocab_size=512, max_position_embeddings=1024, latent_rank=512)
    build_model(spec, tmp_path, tokenizer=False)
    assert spec.name.startswith("deepseek-h128-l3-")
    assert spec.kv_bytes_per_token == 3 * 576 * 4 == planner_model(str(tmp_path)).bytes_per_token
    llama = replace(spec, latent_rank=0, num_key_value_heads=2)
    assert llama.kv_bytes_per_token == 3 * 2 * 2 * 32 * 4   # control: K and V of 2 heads of 32
    assert VLLM_TEST_SPEC.name == "llama-h128-l2-float32-fe3f0c5b6262"


def test_a_model_whose_cache_has_two_head_sizes_is_refused_by_name(tmp_path):
    """transformers caches a DeepSeek-V2's latent attention as the compressed latent (512) and
    the RoPE key (64); its ``head_dim`` is the RoPE part only. Before, the integration took that
    ``head_dim`` for K and V, and the first forward failed deep in the model with "The size of
    tensor a (64) must match the size of tensor b (512)". Now both entry points say what the
    model is and how to serve it; a K/V head size mismatch outside MLA is refused the same way."""
    from transformers import LlamaConfig

    from kvtier.integrations.transformers.models import ModelSpec
    from kvtier.integrations.transformers.namespace import kv_layout

    spec = ModelSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=256, vocab_size=512, max_position_embeddings=1024, latent_rank=512)
    build_model(spec, tmp_path, tokenizer=False)
    deepseek, _ = load_model(tmp_path, tokenizer=False)
    with pytest.raises(ConfigError, match="latent attention: transformers caches a latent of 512 and a RoPE key of 64"):
        namespace_for_model(deepseek, block_tokens=BLOCK)
    with pytest.raises(ConfigError, match="vLLM and the kvtier connector"):
        KVTierLM(deepseek, None, block_tokens=BLOCK, capacity_tokens=512)

    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    assert kv_layout(config, "float32", BLOCK).head_dim == 32   # control: one head size
    config.qk_head_dim, config.v_head_dim = 48, 32
    with pytest.raises(ConfigError, match="K of 48 and V of 32"):
        kv_layout(config, "float32", BLOCK)
