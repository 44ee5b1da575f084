"""Routing policies decide from a view of the cluster; checked against a hand-made view."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.planner.costmodel import PrefillCostModel
from kvtier.planner.models import load_model
from kvtier.sim.policies import LeastLoaded, PrefixOverlap, RoundRobin, TierAware, make_policy
from kvtier.sim.service import ServiceModel
from kvtier.sim.trace import TraceRequest

MODEL = load_model("llama-3-70b")
REQUEST = TraceRequest(0.0, 8 * 512, 10, tuple(range(8)))


class FakeView:
    """Per worker: outstanding tokens, active blocks, backlog seconds, HBM prefix, tiers of the prefix."""

    def __init__(self, workers):
        self.workers = workers
        self.num_workers = len(workers)
        prefill = PrefillCostModel.from_roofline(MODEL, 989e12, 8, 0.4)
        self.service = ServiceModel(prefill, 512, MODEL.block_bytes(512), [100e9, 22.5e9], [0.0, 0.0])

    def outstanding_tokens(self, w):
        return self.workers[w]["tokens"]

    def active_blocks(self, w):
        return self.workers[w]["active"]

    def backlog_s(self, w):
        return self.workers[w]["backlog"]

    def hbm_prefix_blocks(self, w, blocks):
        return sum(1 for t in self.workers[w]["tiers"] if t == 0)

    def prefix_tiers(self, w, blocks):
        return list(self.workers[w]["tiers"])


def worker(tokens=0, active=0, backlog=0.0, tiers=()):
    return {"tokens": tokens, "active": active, "backlog": backlog, "tiers": tiers}


def test_round_robin_cycles():
    view = FakeView([worker(), worker(), worker()])
    policy = RoundRobin()
    assert [policy.choose(REQUEST, view) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_least_loaded_ignores_caches():
    view = FakeView([worker(tokens=500, tiers=(0,) * 8), worker(tokens=100)])
    assert LeastLoaded().choose(REQUEST, view) == 1


def test_prefix_overlap_trades_hbm_overlap_against_active_blocks():
    cached_busy = FakeView([worker(active=3, tiers=(0,) * 6), worker(active=0)])
    assert PrefixOverlap().choose(REQUEST, cached_busy) == 0     # 2 + 3 < 8 + 0
    cached_overloaded = FakeView([worker(active=20, tiers=(0,) * 6), worker(active=0)])
    assert PrefixOverlap().choose(REQUEST, cached_overloaded) == 1
    # Dynamo's overlap score sees only HBM: a prefix in host DRAM earns nothing
    dram_only = FakeView([worker(active=1, tiers=(1,) * 8), worker(active=0)])
    assert PrefixOverlap().choose(REQUEST, dram_only) == 1


def test_tier_aware_credits_lower_tiers_by_their_load_time():
    dram = FakeView([worker(), worker(tiers=(1,) * 8)])
    assert TierAware().choose(REQUEST, dram) == 1
    hbm_vs_shared = FakeView([worker(tiers=(2,) * 8), worker(tiers=(0,) * 8)])
    assert TierAware().choose(REQUEST, hbm_vs_shared) == 1


def test_tier_aware_leaves_a_cached_worker_whose_queue_costs_more_than_recompute():
    recompute = FakeView([worker()]).service.full_recompute_s(REQUEST.input_tokens)
    view = FakeView([worker(backlog=2 * recompute, tiers=(0,) * 8), worker(backlog=0.0)])
    assert TierAware().choose(REQUEST, view) == 1
    view = FakeView([worker(backlog=0.1 * recompute, tiers=(0,) * 8), worker(backlog=0.0)])
    assert TierAware().choose(REQUEST, view) == 0


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ConfigError, match="tier_aware"):
        make_policy("random")
    assert make_policy("prefix_overlap").name == "prefix_overlap"
