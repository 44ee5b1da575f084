"""The planner's model figures against published sizes and hand computations (audit s34 a5):

* D5: a Llama 4 config was counted as a Mixtral: the shared expert of every MoE layer and
  Maverick's dense layers (every other one, at ``intermediate_size_mlp``) were left out, and
  prefill FLOPs came out 1.67x too low;
* D6: a mixture of experts' decode step read only the *active* weights, where a batch of 64
  is routed to every expert of a Mixtral and 87 % of a DeepSeek-V3's: ITL 3.6x and 15x short;
* D7: ``kvtier plan workers --rate 1e10`` ran erlang_c over 3.7e9 servers instead of saying
  that no prefill worker count under 100,000 meets the target.
"""

from __future__ import annotations

import json

import pytest

from kvtier.cli.main import main
from kvtier.planner.costmodel import DecodeCostModel
from kvtier.planner.models import geometry_from_hf_config, load_model

#: the published Llama 4 text_config fields the arithmetic reads (Scout: 16 experts, every layer
#: MoE; Maverick: 128 experts, every other layer MoE)
LLAMA4_TEXT = dict(model_type="llama4_text", num_hidden_layers=48, hidden_size=5120, num_attention_heads=40,
                   num_key_value_heads=8, head_dim=128, intermediate_size=8192, intermediate_size_mlp=16384,
                   num_experts_per_tok=1, vocab_size=202048, torch_dtype="bfloat16", tie_word_embeddings=False)
SCOUT = dict(LLAMA4_TEXT, num_local_experts=16, interleave_moe_layer_step=1)
MAVERICK = dict(LLAMA4_TEXT, num_local_experts=128, interleave_moe_layer_step=2)
MIXTRAL_8X7B = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                    intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)


def _llama4_by_hand(experts: int, moe_every: int) -> int:
    """A Llama 4 token's layer weights: attention, then an FFN 16,384 wide in every layer (a MoE
    layer's routed expert of 8,192 and its shared expert of 8,192; a dense layer's 16,384), and
    the router's gate in each MoE layer."""
    attention = 2 * 5120 * 40 * 128 + 2 * 5120 * 8 * 128
    return 48 * attention + 48 * 3 * 5120 * 16384 + (48 // moe_every) * 5120 * experts


@pytest.mark.parametrize("config, experts, moe_every, published_total", [
    (SCOUT, 16, 1, 109e9), (MAVERICK, 128, 2, 400e9),
])
def test_llama4_counts_its_shared_expert_and_dense_layers(tmp_path, config, experts, moe_every, published_total):
    """Both are "17B active"; read through load_model as the multimodal wrapper ships them."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama4", "text_config": config}))
    model = load_model(str(tmp_path))
    assert model.matmul_params == _llama4_by_hand(experts, moe_every)
    assert model.total_params == pytest.approx(17e9, rel=0.03)
    # every expert of every MoE layer: the published totals (the vision encoder aside)
    assert model.weights_read(1 << 20) == pytest.approx(published_total, rel=0.02)


def test_llama4_moe_layers_listed_and_by_its_dense_width_alone():
    """``moe_layers`` names the sparse layers when given; ``intermediate_size_mlp`` marks a Llama 4
    text config that carries no model_type."""
    listed = geometry_from_hf_config({**MAVERICK, "moe_layers": list(range(1, 48, 2))})
    untyped = geometry_from_hf_config({k: v for k, v in MAVERICK.items() if k != "model_type"})
    maverick = geometry_from_hf_config(MAVERICK)
    assert listed.matmul_params == untyped.matmul_params == maverick.matmul_params == _llama4_by_hand(128, 2)
    first_only = geometry_from_hf_config({**MAVERICK, "moe_layers": [0]})
    assert first_only.moe_layers == 1
    assert first_only.matmul_params == maverick.matmul_params - 23 * 5120 * 128   # 23 gates fewer


#: (model, MoE layers, routed experts, experts per token, hidden, expert width, published total)
MOE_MODELS = [
    (geometry_from_hf_config(MIXTRAL_8X7B, "mixtral-8x7b"), 32, 8, 2, 4096, 14336, 46.7e9),
    (load_model("deepseek-v3"), 61 - 3, 256, 8, 7168, 2048, 671e9),
]


@pytest.mark.parametrize("model, moe_layers, experts, per_token, hidden, width, published_total", MOE_MODELS)
def test_a_moe_decode_step_reads_every_expert_its_batch_is_routed_to(model, moe_layers, experts, per_token,
                                                                     hidden, width, published_total):
    """By hand: one token reads the active weights (``total_params``); a batch of 64 reads, in
    each MoE layer, E x (1 - (1 - k/E)^64) experts of 3 x hidden x width weights instead of k."""
    bandwidth = 3.35e12 * 8 * 0.7          # 8 x H100 at the shipped decode_bw_efficiency
    decode = DecodeCostModel(model, bandwidth, flops_per_s=989e12 * 8 * 0.4)
    expert = 3 * hidden * width
    touched = experts * (1 - (1 - per_token / experts) ** 64)
    by_hand = (model.total_params + moe_layers * (touched - per_token) * expert) * 2 / bandwidth
    assert decode.step_seconds(64, 0.0) == pytest.approx(by_hand, rel=1e-9)
    assert decode.step_seconds(1, 0.0) == pytest.approx(model.total_params * 2 / bandwidth, rel=1e-9)
    # a batch that touches every expert reads the whole model, as published
    assert model.weights_read(1 << 20) == pytest.approx(published_total, rel=0.02)


def test_a_dense_models_step_still_reads_its_weights_once_whatever_the_batch():
    model = load_model("llama-3-70b")
    decode = DecodeCostModel(model, hbm_bytes_per_s=18e12, flops_per_s=3e15)
    assert model.weights_read(1) == model.weights_read(64) == model.total_params
    assert decode.step_seconds(64, 0.0) == pytest.approx(model.total_params * 2 / 18e12, rel=1e-9)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rate", ["1e6", "1e10"])
def test_plan_workers_says_at_once_that_no_prefill_count_meets_an_absurd_rate(capsys, rate):
    """1e10 req/s starts the search at 3.7e9 busy workers: refused before any queue figure."""
    code = main(["plan", "workers", "--ttft", "2", "--itl", "0.05", "--input-tokens", "8000",
                 "--output-tokens", "100", "--hit-rate", "0", "--rate", rate])
    assert code == 2
    assert "no prefill worker count under 100,000" in capsys.readouterr().err
