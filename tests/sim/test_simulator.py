"""The cluster simulator on hand-made traces (exact behaviour) and on the published trace."""

from __future__ import annotations

import pytest

from kvtier.planner.hardware import cost_models
from kvtier.planner.models import load_model
from kvtier.sim import run_simulation
from kvtier.sim.cluster import ClusterConfig, TierSpec
from kvtier.sim.metrics import summarize
from kvtier.sim.policies import make_policy
from kvtier.sim.simulator import ClusterSimulator

MODEL = load_model("llama-3-70b")
BLOCK_BYTES = MODEL.block_bytes(4)


def _cluster(workers=1, hbm_blocks=100, tiers=()):
    return ClusterConfig(prefill_workers=workers, decode_workers=1, block_tokens=4,
                         hbm_cache_bytes=hbm_blocks * BLOCK_BYTES, tiers=tuple(tiers))


def _run(cluster, trace, policy="tier_aware"):
    costs = cost_models(MODEL, cluster.accelerator, cluster.devices_per_worker)
    sim = ClusterSimulator(cluster, MODEL, costs.prefill, costs.decode, make_policy(policy))
    result = sim.run(trace)
    for w in sim.workers:
        w.hbm.check_integrity()
        for cache in w.local:
            cache.check_integrity()
        assert not w.pending and not w.queue and w.outstanding_tokens == 0 and w.active_blocks == 0
    return sim, result


def test_a_repeated_prompt_hits_hbm_and_starts_sooner(make_trace):
    trace = make_trace([(0, [1, 2, 3, 4]), (10, [1, 2, 3, 4])])
    _, result = _run(_cluster(), trace)
    first, second = result.outcomes
    assert second.plan.blocks_by_tier == (4,)
    assert second.ttft_s < first.ttft_s / 10  # 1 of 16 tokens computed
    report = summarize(result)
    assert report.hit_rate == 0.5 and report.hit_rate_by_tier == {"hbm": 0.5}


def test_without_hbm_room_the_prefix_comes_back_from_host_dram(make_trace):
    dram = TierSpec("host_dram", "worker", None, 100e9)
    trace = make_trace([(0, [1, 2, 3, 4]), (10, [1, 2, 3, 4])])
    _, result = _run(_cluster(hbm_blocks=0, tiers=[dram]), trace)
    assert result.outcomes[1].plan.blocks_by_tier == (0, 4)
    assert result.outcomes[1].plan.load_s == pytest.approx(4 * BLOCK_BYTES / 100e9)


def test_requests_queue_fifo_on_a_busy_worker(make_trace):
    trace = make_trace([(0, list(range(100))), (0, list(range(200, 300)))])
    _, result = _run(_cluster(), trace)
    first, second = sorted(result.outcomes, key=lambda o: o.start_s)
    assert second.start_s == pytest.approx(first.finish_s)
    assert second.ttft_s == pytest.approx(first.ttft_s + second.plan.seconds)


def test_the_pod_tier_shares_a_prefix_across_workers(make_trace):
    shared = TierSpec("shared", "pod", None, 22.5e9, latency_s=1e-5)
    trace = make_trace([(0, [1, 2, 3]), (10, [1, 2, 3, 4])])
    _, result = _run(_cluster(workers=2, tiers=[shared]), trace, policy="round_robin")
    second = result.outcomes[1]
    assert second.worker == 1 and second.plan.blocks_by_tier == (0, 3)
    assert second.plan.load_s == pytest.approx(1e-5 + 3 * BLOCK_BYTES / 22.5e9)


def test_tier_aware_credits_blocks_a_queued_request_will_leave_in_hbm(make_trace):
    # B arrives while A, which computes B's prefix, is still running on worker 0.
    trace = make_trace([(0, list(range(1000))), (0.001, [*range(1000), 5000])])
    _, result = _run(_cluster(workers=2, hbm_blocks=5000), trace)
    a, b = result.outcomes
    assert b.worker == a.worker
    assert b.plan.blocks_by_tier[0] == 1000 and b.start_s == pytest.approx(a.finish_s)


def test_work_is_conserved_and_every_output_token_is_decoded(make_trace):
    rows = [(i * 0.01, [i % 7, 100 + i % 3, 200 + i], 5 + i % 4) for i in range(60)]
    trace = make_trace(rows)
    sim, result = _run(_cluster(workers=3, hbm_blocks=10), trace)
    assert len(result.outcomes) == 60
    assert sum(result.busy_s_per_worker) == pytest.approx(sum(o.plan.seconds for o in result.outcomes))
    for w in range(3):
        mine = sorted((o for o in result.outcomes if o.worker == w), key=lambda o: o.start_s)
        assert all(a.finish_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:]))
        assert all(o.start_s >= o.arrival_s for o in mine)
    assert sum(result.decode_tokens_per_worker) == sum(r.output_tokens for r in trace.requests)
    assert len(result.decode_itl_s) == 60 and min(result.decode_itl_s) > 0


def test_tier_aware_is_not_slower_at_the_median_on_the_trace_head(conversation_trace):
    # 2,000 requests of the published trace, or the whole 500 of the shipped slice
    cluster = ClusterConfig.from_json({**_default_cluster_json(), "prefill_workers": 3})
    run = run_simulation(conversation_trace.trace.head(2000), cluster)
    p50 = {name: report.ttft_p50_s for name, report in run.reports.items()}
    assert p50["tier_aware"] <= min(p50.values())
    # All policies reuse the same blocks in the end (the pod tier holds them all); routing
    # changes where they come from: the HBM-aware policies find more of them in HBM.
    hbm = {name: report.hit_rate_by_tier["hbm"] for name, report in run.reports.items()}
    assert hbm["prefix_overlap"] > hbm["round_robin"] and hbm["tier_aware"] > hbm["round_robin"]


def test_with_one_prefill_worker_every_policy_gives_the_same_outcome_per_request(shipped_trace, make_trace):
    """Routing is the only thing a policy decides: with one worker there is nothing to decide, so
    every request must start, load, compute and finish exactly alike (a policy that changed what
    the caches hold or how the service is planned, e.g. a lookup that touched the LRU, shows here)."""
    hand_made = make_trace([(i * 0.01, [i % 5, 100 + i % 3, 200 + i]) for i in range(40)])
    cases = [(shipped_trace.trace, ClusterConfig.from_json({**_default_cluster_json(), "prefill_workers": 1})),
             (hand_made, _cluster(workers=1, hbm_blocks=6, tiers=[TierSpec("host_dram", "worker", 20 * BLOCK_BYTES,
                                                                            100e9)]))]
    for trace, cluster in cases:
        run = run_simulation(trace, cluster)
        results = list(run.results.values())
        assert len(results) == 4  # every policy
        reference = results[0]
        assert len(reference.outcomes) == len(trace.requests)
        assert any(o.plan.reused_blocks for o in reference.outcomes)  # the caches are exercised
        for result in results[1:]:
            assert [o.worker for o in result.outcomes] == [0] * len(trace.requests)
            for mine, ref in zip(result.outcomes, reference.outcomes, strict=True):
                assert mine == ref, f"{result.policy} differs from {reference.policy} at arrival {ref.arrival_s}"
            assert result._replace(policy="", outcomes=[]) == reference._replace(policy="", outcomes=[])


def _default_cluster_json():
    from kvtier.planner.hardware import read_data_json

    return read_data_json("cluster_default.json")
