"""SLA worker planning: queueing arithmetic and the worker counts it yields."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.planner.hardware import cost_models
from kvtier.planner.models import load_model
from kvtier.planner.workers import (SLATargets, Workload, erlang_c, plan_workers, prefill_service_times,
                                    shared_tier_bytes_for_retention, ttft_quantile)

LOAD_BW = 22.5e9  # bytes/s: a 200 GbE link at 90 %


@pytest.fixture(scope="module")
def costs():
    return cost_models(load_model("llama-3-70b"), "h100", 8)


def test_erlang_c_known_values():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)       # M/M/1: P(wait) = utilization
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(3, 3.0) == 1.0                       # saturated


def test_plan_meets_the_targets_with_the_fewest_workers(costs):
    workload = Workload(arrival_rate_per_s=3.0, input_tokens=(12_000,), output_tokens=(350,), hit_rate=0.37)
    targets = SLATargets(ttft_s=2.0, itl_s=0.03)
    plan = plan_workers(workload, targets, costs.prefill, costs.decode, LOAD_BW, decode_kv_tokens=1_200_000)
    assert plan.predicted_ttft_s <= 2.0 and plan.predicted_itl_s <= 0.03
    service = prefill_service_times(workload, costs.prefill, LOAD_BW)
    one_fewer = ttft_quantile(plan.prefill_workers - 1, 3.0, service, 1.0, 0.9)
    assert one_fewer > 2.0
    assert plan.prefill_utilization < 1


def test_a_higher_hit_rate_needs_fewer_prefill_workers(costs):
    targets = SLATargets(ttft_s=1.0, itl_s=0.05)
    counts = []
    for hit in (0.0, 0.4, 0.8):
        workload = Workload(20.0, (12_000,), (350,), hit)
        counts.append(plan_workers(workload, targets, costs.prefill, costs.decode, LOAD_BW, 1_200_000).prefill_workers)
    assert counts[0] > counts[1] > counts[2]


def test_a_tighter_itl_needs_more_decode_workers(costs):
    workload = Workload(20.0, (12_000,), (350,), 0.4)
    loose = plan_workers(workload, SLATargets(5.0, 0.05), costs.prefill, costs.decode, LOAD_BW, 1_200_000)
    tight = plan_workers(workload, SLATargets(5.0, 0.012), costs.prefill, costs.decode, LOAD_BW, 1_200_000)
    assert tight.decode_workers > loose.decode_workers


def test_burstier_arrivals_need_at_least_as_many_workers(costs):
    targets = SLATargets(ttft_s=1.0, itl_s=0.05)
    smooth = Workload(10.0, (12_000,), (350,), 0.4, arrival_scv=1.0)
    bursty = Workload(10.0, (12_000,), (350,), 0.4, arrival_scv=8.0)
    args = (targets, costs.prefill, costs.decode, LOAD_BW, 1_200_000)
    assert plan_workers(bursty, *args).prefill_workers >= plan_workers(smooth, *args).prefill_workers


def test_unreachable_ttft_names_the_fix(costs):
    workload = Workload(1.0, (120_000,), (100,), 0.0)
    with pytest.raises(ConfigError, match="idle worker"):
        plan_workers(workload, SLATargets(0.5, 0.05), costs.prefill, costs.decode, LOAD_BW, 1_200_000)


def test_workload_from_arrivals_measures_rate_and_burstiness():
    regular = Workload.from_arrivals([0, 1, 2, 3, 4], [100] * 5, [10] * 5, 0.2)
    assert regular.arrival_rate_per_s == pytest.approx(1.0) and regular.arrival_scv == pytest.approx(0.0)
    bursty = Workload.from_arrivals([0, 0, 0, 0, 4], [100] * 5, [10] * 5, 0.2)
    assert bursty.arrival_scv > 1


def test_shared_tier_holds_the_retained_misses():
    size = shared_tier_bytes_for_retention(2.0, 3600, 10_000, 0.4, 327_680)
    assert size == pytest.approx(2 * 3600 * 10_000 * 0.6 * 327_680)


# -- audit s28 (observation): a trace with no reuse needs no shared tier ----------------------------
def _trace(tmp_path, ids_of):
    import json

    from kvtier.sim.trace import load_trace

    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 1024, "output_length": 8,
                                        "hash_ids": ids_of(i)}) + "\n" for i in range(200)))
    return load_trace(path)


def test_a_trace_with_no_reuse_is_given_no_shared_tier(tmp_path):
    """`plan workers` took the curve's first point that reached the assumed hit rate: with no
    reuse, 0 >= 0 at the first point, and it recommended 0.2 % of the trace's blocks."""
    from kvtier.planner.workers import shared_tier_bytes_for_hit_rate
    from kvtier.sim.cache import hit_rate_curve

    curve = hit_rate_curve(_trace(tmp_path, lambda i: [2 * i, 2 * i + 1]))
    assert curve[0].capacity_blocks >= 1 and curve[-1].token_hit_rate == 0
    assert shared_tier_bytes_for_hit_rate(curve, 0.0, 4096) == 0.0
    assert shared_tier_bytes_for_hit_rate(curve, 0.5, 4096) == 0.0   # more asked than the trace can hit
    # the control: a trace whose requests share a prefix is given the smallest tier that holds it
    curve = hit_rate_curve(_trace(tmp_path, lambda i: [0, 1000 + i]))
    size = shared_tier_bytes_for_hit_rate(curve, 1.0, 4096)
    first = next(p for p in curve if p.token_hit_rate >= curve[-1].token_hit_rate * 0.999)
    assert size == first.capacity_blocks * 4096 > 0
