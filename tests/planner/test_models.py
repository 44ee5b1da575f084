"""Model geometry: KV bytes per token (GQA and MLA) and parameter counts from configs."""

from __future__ import annotations

import json

import pytest

from kvtier.errors import ConfigError
from kvtier.planner.models import PRESETS, geometry_from_hf_config, load_model


@pytest.mark.parametrize("name, published_params", [
    ("llama-3-8b", 8.03e9), ("llama-3-70b", 70.6e9), ("llama-3-405b", 405.9e9),
    ("qwen2.5-7b", 7.61e9), ("qwen2.5-72b", 72.7e9), ("mistral-7b", 7.25e9),
    ("deepseek-v3", 37e9),  # activated parameters a token passes through (671B in all)
])
def test_preset_parameter_counts_match_published_sizes(name, published_params):
    model = load_model(name)
    assert model.total_params == pytest.approx(published_params, rel=0.02)


def test_llama_3_70b_keeps_320_kib_of_kv_per_token():
    model = load_model("llama-3-70b")
    assert model.bytes_per_token == 2 * 80 * 8 * 128 * 2 == 320 * 1024


def test_deepseek_mla_stores_one_latent_per_layer_not_k_and_v_per_head():
    model = load_model("deepseek-v3")
    # 61 layers x (kv_lora_rank 512 + rope key 64) x 2 bytes, shared by all 128 heads
    assert model.is_mla
    assert model.bytes_per_token == 61 * (512 + 64) * 2 == 70_272
    assert "MLA" in model.kv_formula()
    mha_equivalent = 2 * 61 * 128 * (128 + 64) * 2  # what the heads would keep without the latent
    assert model.bytes_per_token * 40 < mha_equivalent


def test_aliases_resolve_to_the_same_geometry():
    assert load_model("llama-3.1-70b") == load_model("llama-3-70b")


def test_hf_config_json_file_or_folder_with_explicit_head_dim_and_dtype(tmp_path):
    config = dict(PRESETS["llama-3-8b"], head_dim=64, torch_dtype="float16", num_key_value_heads=4)
    (tmp_path / "config.json").write_text(json.dumps(config))
    by_file = load_model(str(tmp_path / "config.json"))
    by_dir = load_model(str(tmp_path))
    assert by_file.bytes_per_token == by_dir.bytes_per_token == 2 * 32 * 4 * 64 * 2
    assert load_model(str(tmp_path), kv_dtype="float8_e4m3fn").bytes_per_token == 2 * 32 * 4 * 64


def test_multimodal_config_reads_the_text_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": PRESETS["llama-3-70b"]}))
    assert load_model(str(tmp_path)).bytes_per_token == 327_680


def test_missing_field_and_unknown_model_name_the_fix(tmp_path):
    broken = dict(PRESETS["llama-3-8b"])
    del broken["num_hidden_layers"]
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        geometry_from_hf_config(broken)
    with pytest.raises(ConfigError, match="llama-3-70b"):
        load_model("no-such-model")


def test_attention_work_is_quadratic_and_a_cached_prefix_removes_its_share():
    model = load_model("llama-3-70b")
    assert model.attention_flops(2000) == pytest.approx(4 * model.attention_flops(1000))
    assert model.attention_flops(2000, 1000) == pytest.approx(model.attention_flops(2000) - model.attention_flops(1000))
    assert model.linear_flops(1000) == pytest.approx(2 * model.matmul_params * 1000)


#: mixture-of-experts configs as their published config.json files name them (the fields read)
MIXTRAL_8X7B = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                    intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)
QWEN3_30B_A3B = dict(num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936)
QWEN2_57B_A14B = dict(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                      intermediate_size=18944, moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
                      num_experts=64, num_experts_per_tok=8, vocab_size=151936)


@pytest.mark.parametrize("config, published_active", [
    (MIXTRAL_8X7B, 12.9e9), (QWEN3_30B_A3B, 3.3e9), (QWEN2_57B_A14B, 14e9),
])
def test_mixture_of_experts_configs_count_the_experts_a_token_passes(config, published_active):
    """Mixtral's ``num_local_experts`` and Qwen's ``num_experts`` are MoE as much as DeepSeek's
    ``n_routed_experts``: a token passes ``num_experts_per_tok`` experts (and Qwen2-MoE's shared
    one). Read as dense, these configs gave 1.8x (Mixtral) and 2.0x (Qwen2-57B) too little
    prefill work, and the planner sized its workers for that."""
    model = geometry_from_hf_config(config)
    assert model.total_params == pytest.approx(published_active, rel=0.03)
    dense = geometry_from_hf_config({k: v for k, v in config.items()
                                     if k not in ("num_local_experts", "num_experts")})
    assert model.matmul_params > dense.matmul_params   # control: the experts (and the gate) count


def test_qwen_moe_dense_layers_and_a_missing_expert_count():
    every_other = geometry_from_hf_config({**QWEN3_30B_A3B, "decoder_sparse_step": 2})
    first_dense = geometry_from_hf_config({**QWEN3_30B_A3B, "mlp_only_layers": [0]})
    sparse = geometry_from_hf_config(QWEN3_30B_A3B)
    hidden, layers = 2048, 48
    expert_mlp = 3 * hidden * 8 * 768 + hidden * 128
    dense_mlp = 3 * hidden * 6144
    assert first_dense.matmul_params - sparse.matmul_params == dense_mlp - expert_mlp
    assert every_other.matmul_params - sparse.matmul_params == layers // 2 * (dense_mlp - expert_mlp)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        geometry_from_hf_config({**MIXTRAL_8X7B, "num_experts_per_tok": None})
