"""Prefill and decode cost models: the reference scenario, the fit, the shipped tables."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.planner.costmodel import CalibrationTable, DecodeCostModel, PrefillCostModel, fit_rates
from kvtier.planner.hardware import cost_models, find_calibration, load_accelerator, read_data_json
from kvtier.planner.models import PRESETS, load_model


def test_reference_scenario_recompute_65_s_against_load_3_s():
    """DESIGN.md: on 8xH100 with a 200 GbE link to storage, a Llama-3-class context is
    recomputed in ~65 s or read from the store in ~3 s (~20x).

    Assumptions that produce both figures: Llama-3.1-405B, a full 128k-token context
    (131,072 tokens), bf16 KV (504 KiB/token, 67.6 GB in all); prefill at 35 % of the
    8 GPUs' dense bf16 peak (989 TFLOP/s each); the link delivering 90 % of 200 Gb/s.
    """
    model = load_model("llama-3-405b")
    tokens = 131_072
    recompute = PrefillCostModel.from_roofline(model, 989e12, devices=8, efficiency=0.35)
    recompute_s = recompute.seconds(tokens)
    kv_bytes = tokens * model.bytes_per_token
    load_s = kv_bytes / (200e9 / 8 * 0.90)
    assert kv_bytes == pytest.approx(67.6e9, rel=0.01)
    assert recompute_s == pytest.approx(65, rel=0.05)
    assert load_s == pytest.approx(3.0, rel=0.05)
    assert 18 <= recompute_s / load_s <= 23
    # The quadratic term is no detail at this length: attention is 40 % of the work.
    attention_share = model.attention_flops(tokens) / (model.attention_flops(tokens) + model.linear_flops(tokens))
    assert 0.35 < attention_share < 0.45


def test_h100_roofline_matches_the_published_hopper_measurement():
    spec = read_data_json("accelerators.json")["h100"]
    for point in spec["published_points"]:
        costs = cost_models(load_model(point["model"]), "h100", point["devices"])
        assert costs.prefill.seconds(point["tokens"]) == pytest.approx(point["seconds"], rel=0.05)
        assert "roofline" in costs.provenance  # and says it is not a measurement


def _table_from(model_config, truth: PrefillCostModel, tokens, noise=()):
    points = []
    for i, n in enumerate(tokens):
        points.append((n, truth.seconds(n) * (1 + (noise[i] if noise else 0))))
    return CalibrationTable("test", 1, model_config, tuple(points))


def test_fit_recovers_known_rates_from_a_table():
    config = PRESETS["llama-3-8b"]
    truth = PrefillCostModel(load_model("llama-3-8b"), 3e14, 5e14, overhead_s=0.02)
    fit = fit_rates(_table_from(config, truth, [256, 1024, 4096, 16384, 65536]))
    assert fit.linear_flops_per_s == pytest.approx(3e14, rel=1e-6)
    assert fit.attention_flops_per_s == pytest.approx(5e14, rel=1e-6)
    assert fit.overhead_s == pytest.approx(0.02, rel=1e-6)
    assert fit.max_relative_error < 1e-9


def test_fit_stays_non_negative_on_noisy_points():
    config = PRESETS["llama-3-8b"]
    truth = PrefillCostModel(load_model("llama-3-8b"), 3e14, 5e14)
    fit = fit_rates(_table_from(config, truth, [128, 256, 512, 1024], noise=(0.3, -0.2, 0.1, -0.1)))
    assert fit.overhead_s >= 0 and fit.linear_flops_per_s > 0 and fit.attention_flops_per_s > 0


def test_rates_transfer_to_another_model_by_flops():
    """Rates belong to the device: fitted on an 8B, they predict a 70B by its FLOPs."""
    small, big = load_model("llama-3-8b"), load_model("llama-3-70b")
    truth_small = PrefillCostModel(small, 3e14, 5e14)
    table = _table_from(PRESETS["llama-3-8b"], truth_small, [512, 2048, 8192])
    predicted = PrefillCostModel.from_calibration(big, table, devices=2)
    assert predicted.seconds(8192) == pytest.approx(PrefillCostModel(big, 6e14, 1e15).seconds(8192), rel=1e-6)


def test_a_cached_prefix_shortens_prefill_but_one_token_is_always_computed():
    cost = PrefillCostModel.from_roofline(load_model("llama-3-70b"), 989e12, 8, 0.4)
    assert cost.seconds(10_000, 5_000) < cost.seconds(10_000)
    assert 0 < cost.seconds(10_000, 10_000) < cost.seconds(10_000) / 1000


def test_calibration_needs_three_points():
    with pytest.raises(ConfigError, match="kvtier bench prefill"):
        CalibrationTable("x", 1, PRESETS["llama-3-8b"], ((1, 1.0), (2, 2.0)))


def test_shipped_cpu_profile_is_measured_and_usable():
    table = find_calibration("cpu")
    if table is None:
        pytest.skip("no kvtier/data/prefill_cpu.json (write one with `kvtier bench prefill`)")
    assert table.extra["memory_bytes_per_s"] > 0
    costs = cost_models(load_model("llama-3-8b"), "cpu", 1)
    assert "measured" in costs.provenance
    assert costs.prefill.seconds(4096) > costs.prefill.seconds(1024) > 0
    assert load_accelerator("cpu").hbm_bytes > 0


def test_decode_steps_slow_down_with_kv_and_a_looser_itl_allows_a_bigger_batch():
    decode = DecodeCostModel(load_model("llama-3-70b"), hbm_bytes_per_s=18e12, flops_per_s=3e15)
    assert decode.step_seconds(8, 8 * 10_000) < decode.step_seconds(8, 8 * 50_000)
    weights_only = decode.step_seconds(1, 0)
    assert weights_only == pytest.approx(70.55e9 * 2 / 18e12, rel=0.01)
    tight, loose = decode.max_batch_for_itl(0.02, 12_000), decode.max_batch_for_itl(0.05, 12_000)
    assert 0 < tight < loose
    assert decode.step_seconds(loose, loose * 12_000) <= 0.05 < decode.step_seconds(loose + 1, (loose + 1) * 12_000)
