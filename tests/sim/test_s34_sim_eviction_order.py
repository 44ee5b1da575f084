"""The simulator's caches evict a prompt's tail first, as vLLM frees a request's blocks (audit s34
a9 D3). Evicted root first, one eviction made a whole cached chain unusable (no block is a hit
without its ancestors) while the rest of it still took room: under cache pressure every policy's
hit rate was under-stated and its TTFT over-stated."""

from __future__ import annotations

import pytest

from kvtier.planner.hardware import cost_models
from kvtier.planner.models import load_model
from kvtier.sim.cache import LRUBlockCache, hit_rate_curve, replay_prefix_hits
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.policies import make_policy
from kvtier.sim.simulator import ClusterSimulator
from kvtier.sim.trace import Trace, TraceRequest

PROMPT_A = tuple(range(1, 9))          # an 8-block prompt
PROMPT_B = tuple(range(101, 105))      # 4 other blocks
BT = 16


def _trace(*prompts) -> Trace:
    return Trace(tuple(TraceRequest(float(i), len(p) * BT, 1, p) for i, p in enumerate(prompts)), BT)


def test_two_evictions_cost_a_prompt_its_two_tail_blocks_not_its_whole_prefix():
    cache = LRUBlockCache(10)
    cache.insert(PROMPT_A)
    cache.insert(PROMPT_B)             # 12 blocks into 10: two go, A's last two
    assert cache.prefix_length(PROMPT_A) == 6
    assert 7 not in cache and 8 not in cache and cache.evictions == 2
    cache.check_integrity()


def test_the_replay_counts_the_prefix_that_tail_first_eviction_keeps():
    result = replay_prefix_hits(_trace(PROMPT_A, PROMPT_B, PROMPT_A), capacity_blocks=10)
    assert (result.hit_blocks, result.total_blocks) == (6, 20)


def test_a_cache_smaller_than_a_prompt_keeps_its_leading_blocks():
    cache = LRUBlockCache(3)
    cache.insert(PROMPT_A)
    assert cache.prefix_length(PROMPT_A) == 3 and len(cache) == 3


def test_the_hit_rate_curve_under_pressure_credits_the_kept_prefix():
    """A and B in turn, five times each, in 10 blocks (of 12 distinct): each repeat finds its
    prompt less the 2 tail blocks the other pushed out (A 6 of 8, B 2 of 4); root first, the
    other's 2 evictions took each prompt's root, and no repeat hit at all."""
    trace = _trace(*(PROMPT_A, PROMPT_B) * 5)
    point = hit_rate_curve(trace, fractions=(10 / 12,))[0]
    assert point.capacity_blocks == 10
    assert point.hit_blocks == 4 * 6 + 4 * 2


def test_the_simulated_worker_reuses_the_prefix_its_hbm_kept():
    """One worker whose HBM holds 10 blocks: A, then B, then A. The second A loads A's 6 leading
    blocks from HBM (vLLM keeps them); root first, it recomputed all 8."""
    model = load_model("llama-3-70b")
    cluster = ClusterConfig(prefill_workers=1, decode_workers=1, block_tokens=BT,
                            hbm_cache_bytes=10 * model.block_bytes(BT))
    costs = cost_models(model, cluster.accelerator, cluster.devices_per_worker)
    sim = ClusterSimulator(cluster, model, costs.prefill, costs.decode, make_policy("tier_aware"))
    result = sim.run(Trace(tuple(TraceRequest(10.0 * i, len(p) * BT, 1, p)
                                 for i, p in enumerate((PROMPT_A, PROMPT_B, PROMPT_A))), BT))
    outcomes = sorted(result.outcomes, key=lambda o: o.arrival_s)
    assert [o.plan.reused_blocks for o in outcomes] == [0, 0, 6]
    assert outcomes[2].plan.blocks_by_tier[0] == 6


@pytest.mark.parametrize("hbm_blocks", [3, 5])
def test_a_queued_repeats_estimate_credits_the_leading_blocks_a_small_hbm_will_keep(hbm_blocks):
    """Two copies of A at t=0 on one worker whose HBM is smaller than A: the second's estimate at
    routing credits A's leading ``hbm_blocks`` (what the first's write-through leaves), as its run
    then finds them: the backlog the third is shown is the wait it then has."""
    model = load_model("llama-3-70b")
    cluster = ClusterConfig(prefill_workers=1, decode_workers=1, block_tokens=BT,
                            hbm_cache_bytes=hbm_blocks * model.block_bytes(BT))
    costs = cost_models(model, cluster.accelerator, cluster.devices_per_worker)
    sim = ClusterSimulator(cluster, model, costs.prefill, costs.decode, make_policy("tier_aware"))
    seen = []
    inner = sim.policy

    class Recording:
        name = inner.name

        def choose(self, request, view):
            worker = inner.choose(request, view)
            seen.append(view.backlog_s(worker))
            return worker

    sim.policy = Recording()
    result = sim.run(Trace(tuple(TraceRequest(0.0, len(PROMPT_A) * BT, 1, PROMPT_A) for _ in range(3)), BT))
    outcomes = sorted(result.outcomes, key=lambda o: o.start_s)
    assert [o.plan.reused_blocks for o in outcomes] == [0, hbm_blocks, hbm_blocks]
    for backlog, outcome in zip(seen, outcomes, strict=True):
        assert backlog == pytest.approx(outcome.start_s - outcome.arrival_s, rel=1e-6, abs=1e-12)
