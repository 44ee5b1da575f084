"""The simulator's routing-time estimates against what its workers then do, and the load plan
over every tier holding a block. Each case failed before its fix (audit s27/audit_sim2, D1, D4).

The estimate of a queued request (its plan at routing) is the backlog later requests are shown,
and its blocks are credited to them where that request's write-through will leave them: in a
cache with room for the prompt, never in one of 0 blocks."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.planner.hardware import cost_models
from kvtier.planner.models import load_model
from kvtier.sim.cluster import MAX_TIERS, ClusterConfig, TierSpec
from kvtier.sim.policies import make_policy
from kvtier.sim.simulator import ClusterSimulator
from kvtier.sim.trace import Trace, TraceRequest

MODEL = load_model("llama-3-70b")


def _sim(cluster, policy="tier_aware"):
    costs = cost_models(MODEL, cluster.accelerator, cluster.devices_per_worker)
    return ClusterSimulator(cluster, MODEL, costs.prefill, costs.decode, make_policy(policy))


class _Recording:
    """Wraps a policy; keeps the backlog the view showed for the worker it chose."""

    def __init__(self, inner):
        self.inner, self.name, self.seen = inner, inner.name, []

    def choose(self, request, view):
        worker = self.inner.choose(request, view)
        self.seen.append((request, worker, view.backlog_s(worker)))
        return worker


def _check_drained(sim):
    for w in sim.workers:
        assert not w.pending and not w.queue and w.outstanding_tokens == 0 and w.active_blocks == 0


# -- D1: pending blocks credited only where a cache will hold them --------------------------------
def test_without_an_hbm_cache_tier_aware_does_not_queue_a_repeat_behind_a_busy_worker():
    """No prefix cache at all (``hbm_cache_bytes: 0``, no tiers), four idle workers, the same
    2-block prompt at 0 and 10 ms: nothing can be reused, so the second request goes to an idle
    worker. Before, its blocks pending on worker 0 were priced as free HBM hits there."""
    cluster = ClusterConfig(prefill_workers=4, decode_workers=1, block_tokens=512, hbm_cache_bytes=0)
    sim = _sim(cluster)
    req = lambda t: TraceRequest(t, 600, 5, (1, 2))
    result = sim.run(Trace((req(0.0), req(0.01)), 512))
    first, second = sorted(result.outcomes, key=lambda o: o.arrival_s)
    assert second.plan.reused_blocks == 0 and second.worker != first.worker
    assert second.start_s == pytest.approx(second.arrival_s)
    _check_drained(sim)


def test_with_an_hbm_cache_a_repeat_still_queues_behind_the_worker_computing_its_prefix():
    """The control: where HBM keeps the blocks, the pending credit stands (the queued repeat
    reuses them and waits less than it would compute elsewhere)."""
    cluster = ClusterConfig(prefill_workers=4, decode_workers=1, block_tokens=4)
    sim = _sim(cluster)
    blocks = tuple(range(1, 2001))
    result = sim.run(Trace((TraceRequest(0.0, 8000, 5, blocks), TraceRequest(0.01, 8000, 5, blocks)), 4))
    first, second = sorted(result.outcomes, key=lambda o: o.arrival_s)
    assert second.worker == first.worker and second.plan.blocks_by_tier[0] == 2000
    assert second.start_s == pytest.approx(first.finish_s)


@pytest.mark.parametrize("hbm_blocks", [0, 1000, None], ids=["no_hbm", "hbm_smaller_than_prompt", "hbm_unbounded"])
def test_the_backlog_a_policy_sees_is_the_wait_the_worker_then_has(hbm_blocks):
    """One worker, the same 2000-block prompt three times at t=0. With no HBM cache each
    computes in full, and the third waits for two prefills: before, it was shown one (the
    second's estimate priced its pending blocks as HBM hits). With HBM room, it is shown the
    first prefill plus the second's near-free reuse, which it then waits. With HBM smaller
    than the prompt (1000 blocks), the first 1000 blocks stay (the tail is evicted first, as
    vLLM does) and each repeat reuses them: its estimate credits them, as its run finds them."""
    block_bytes = MODEL.block_bytes(4)
    hbm = 1e18 if hbm_blocks is None else hbm_blocks * block_bytes
    cluster = ClusterConfig(prefill_workers=1, decode_workers=1, block_tokens=4, hbm_cache_bytes=hbm)
    sim = _sim(cluster)
    sim.policy = policy = _Recording(sim.policy)
    blocks = tuple(range(1, 2001))
    result = sim.run(Trace(tuple(TraceRequest(0.0, 8000, 8, blocks) for _ in range(3)), 4))
    outcomes = sorted(result.outcomes, key=lambda o: o.start_s)
    for (_, _, backlog), outcome in zip(policy.seen, outcomes, strict=True):
        assert backlog == pytest.approx(outcome.start_s - outcome.arrival_s, rel=1e-6, abs=1e-12)
    reused = [o.plan.reused_blocks for o in outcomes]
    assert reused == {None: [0, 2000, 2000], 1000: [0, 1000, 1000], 0: [0, 0, 0]}[hbm_blocks]
    _check_drained(sim)


def test_pending_blocks_are_credited_in_the_lower_tier_their_write_through_reaches():
    """No HBM cache but host DRAM: the queued repeat's estimate loads the prefix from DRAM,
    as its run then does (the backlog shown equals the wait)."""
    dram = TierSpec("host_dram", "worker", None, 100e9)
    cluster = ClusterConfig(prefill_workers=1, decode_workers=1, block_tokens=4, hbm_cache_bytes=0, tiers=(dram,))
    sim = _sim(cluster)
    sim.policy = policy = _Recording(sim.policy)
    blocks = tuple(range(1, 501))
    result = sim.run(Trace(tuple(TraceRequest(0.0, 2000, 8, blocks) for _ in range(3)), 4))
    outcomes = sorted(result.outcomes, key=lambda o: o.start_s)
    assert [o.plan.blocks_by_tier for o in outcomes] == [(0, 0), (0, 500), (0, 500)]
    for (_, _, backlog), outcome in zip(policy.seen, outcomes, strict=True):
        assert backlog == pytest.approx(outcome.start_s - outcome.arrival_s, rel=1e-6, abs=1e-12)


# -- D4: the tier a block is read from is the cheapest plan's, latency included --------------------
def test_a_prefix_in_the_workers_own_dram_is_loaded_not_recomputed():
    """Host DRAM 50 GB/s with 0.1 ms latency; a pod tier 100 GB/s but 50 ms away; both hold the
    2-block prefix. Loading it from DRAM costs 6.9 ms; before, every block was read from the
    highest-bandwidth tier, priced at 50 ms, and recomputed (44.7 ms)."""
    dram = TierSpec("host_dram", "worker", None, 50e9, 1e-4)
    far = TierSpec("shared", "pod", None, 100e9, 0.05)
    cluster = ClusterConfig(prefill_workers=1, decode_workers=1, block_tokens=512, hbm_cache_bytes=0,
                            tiers=(dram, far))
    sim = _sim(cluster, "round_robin")
    req = lambda t: TraceRequest(t, 1024, 8, (1, 2))
    second = sim.run(Trace((req(0.0), req(10.0)), 512)).outcomes[1]
    from_dram = sim.service.plan([1, 1], 1024)
    assert from_dram.seconds < second.recompute_s / 5          # the cheap plan exists
    assert second.plan.seconds == pytest.approx(from_dram.seconds)
    assert second.plan.blocks_by_tier == (0, 2, 0)


def test_tier_aware_prices_the_cheapest_tier_too():
    """Two workers: worker 0 holds the prefix in its DRAM (and the pod tier has it), worker 1
    only through the distant pod tier. Tier-aware's price for worker 0 is the DRAM load."""
    dram = TierSpec("host_dram", "worker", None, 50e9, 1e-4)
    far = TierSpec("shared", "pod", None, 100e9, 0.05)
    cluster = ClusterConfig(prefill_workers=2, decode_workers=1, block_tokens=512, hbm_cache_bytes=0,
                            tiers=(dram, far))
    sim = _sim(cluster)
    req = lambda t: TraceRequest(t, 1024, 8, (1, 2))
    first, second = sim.run(Trace((req(0.0), req(10.0)), 512)).outcomes
    assert second.worker == first.worker and second.plan.blocks_by_tier == (0, 2, 0)


def test_where_the_fastest_tier_is_also_the_nearest_the_plan_is_unchanged():
    """The control: the shipped ordering (fast and near first) reads from the fastest tier."""
    dram = TierSpec("host_dram", "worker", None, 100e9, 1e-4)
    far = TierSpec("shared", "pod", None, 22.5e9, 1e-3)
    cluster = ClusterConfig(prefill_workers=1, decode_workers=1, block_tokens=512, hbm_cache_bytes=0,
                            tiers=(far, dram))
    sim = _sim(cluster, "round_robin")
    req = lambda t: TraceRequest(t, 4096, 8, tuple(range(8)))
    second = sim.run(Trace((req(0.0), req(10.0)), 512)).outcomes[1]
    assert second.plan.blocks_by_tier == (0, 0, 8)
    assert second.plan == sim.service.plan(sim.prefix_tiers(0, tuple(range(8))), 4096)


def test_a_cluster_with_more_tiers_than_the_plan_searches_is_refused():
    tiers = tuple(TierSpec(f"t{i}", "worker", None, 1e9 * (i + 1)) for i in range(MAX_TIERS + 1))
    with pytest.raises(ConfigError, match="tiers below HBM"):
        ClusterConfig(tiers=tiers)
    ClusterConfig(tiers=tiers[:MAX_TIERS])
