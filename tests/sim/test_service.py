"""Load or recompute: the plan a worker follows for a prompt's cached prefix."""

from __future__ import annotations

import pytest

from kvtier.planner.costmodel import PrefillCostModel
from kvtier.planner.models import load_model
from kvtier.sim.service import HBM, ServiceModel

MODEL = load_model("llama-3-70b")
BLOCK = 512
BLOCK_BYTES = MODEL.block_bytes(BLOCK)


def _service(*tier_bw, latency=0.0):
    prefill = PrefillCostModel.from_roofline(MODEL, 989e12, 8, 0.4)
    return ServiceModel(prefill, BLOCK, BLOCK_BYTES, tier_bw, [latency] * len(tier_bw))


def test_nothing_cached_means_full_recompute():
    service = _service(25e9)
    plan = service.plan([], 8 * BLOCK)
    assert plan.reused_blocks == 0 and plan.load_s == 0
    assert plan.seconds == pytest.approx(service.full_recompute_s(8 * BLOCK))


def test_a_fast_tier_is_loaded_in_full_and_beats_recompute():
    service = _service(25e9)
    plan = service.plan([1] * 6, 8 * BLOCK)
    assert plan.reused_blocks == 6 and plan.blocks_by_tier == (0, 6)
    assert plan.load_s == pytest.approx(6 * BLOCK_BYTES / 25e9)
    assert plan.seconds < service.full_recompute_s(8 * BLOCK)


def test_a_tier_slower_than_recompute_is_ignored():
    service = _service(1e9)  # 168 MB a block at 1 GB/s: slower than computing 512 tokens
    plan = service.plan([1] * 6, 8 * BLOCK)
    assert plan.reused_blocks == 0
    assert plan.seconds == pytest.approx(service.full_recompute_s(8 * BLOCK))


def test_hbm_blocks_are_free_and_a_slow_tail_is_cut_off():
    service = _service(1e9)
    plan = service.plan([HBM, HBM, HBM, 1, 1], 8 * BLOCK)
    assert plan.reused_blocks == 3 and plan.blocks_by_tier == (3, 0) and plan.load_s == 0


def test_a_fully_cached_prompt_still_computes_its_last_token():
    service = _service(25e9)
    plan = service.plan([HBM] * 4, 4 * BLOCK)
    assert plan.reused_blocks == 4 and 0 < plan.compute_s < service.full_recompute_s(4 * BLOCK) / 100


def test_tier_latency_is_paid_once_per_tier_used():
    service = _service(25e9, 25e9, latency=0.01)
    plan = service.plan([1, 1, 2], 4 * BLOCK)
    assert plan.load_s == pytest.approx(2 * 0.01 + 3 * BLOCK_BYTES / 25e9)
