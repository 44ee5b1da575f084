"""The router's fast decision path equals the simulator's exact one on random views.

``LiveView`` prices every worker from a (workers x runs) tier matrix in numpy
(``BlockIndex.tier_runs`` + ``ServiceModel.seconds_of_runs``); the simulator walks each
worker's blocks and tries every cut (``ServiceModel.plan``). Here both run over the same
random indexes (workers holding random prefixes in GPU or CPU, holes, a shared tier,
more than 31 workers so masks outgrow 64 bits) and random prices (tiers sometimes slower
than recomputing, latencies that make a short load not worth it), and must agree: the
same reachable tiers, the same prices up to float rounding, the same pick.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtier.planner.costmodel import PrefillCostModel
from kvtier.planner.models import load_model
from kvtier.policy.routing import PrefixOverlap, TierAware
from kvtier.router.index import CPU, GPU, SHARED_BIT, BlockIndex, block_keys, worker_bit
from kvtier.router.view import HBM_TIER, HOST_TIER, SHARED_TIER, LinearPrefill, LiveView
from kvtier.router.workers import Worker
from kvtier.sim.service import ServiceModel

BS = 4


class _Request:
    def __init__(self, input_tokens, blocks):
        self.input_tokens, self.blocks = input_tokens, blocks


def reference_tiers(index: BlockIndex, worker_id: int, keys) -> list[int]:
    """The per-block walk the router used before (and the simulator's definition)."""
    gpu, cpu = worker_bit(worker_id, GPU), worker_bit(worker_id, CPU)
    out = []
    for m in index.masks(keys):
        if m & gpu:
            out.append(HBM_TIER)
        elif m & cpu:
            out.append(HOST_TIER)
        elif m & SHARED_BIT:
            out.append(SHARED_TIER)
        else:
            break
    return out


class ReferenceView:
    """The same view without the fast path: policies fall back to their per-worker loops."""

    def __init__(self, fast: LiveView, index: BlockIndex, keys) -> None:
        self.fast, self.service, self.num_workers = fast, fast.service, fast.num_workers
        self.tiers = [reference_tiers(index, w.id, keys) for w in fast.workers]

    def backlog_s(self, worker):
        return self.fast.backlog_s(worker)

    def outstanding_tokens(self, worker):
        return self.fast.outstanding_tokens(worker)

    def active_blocks(self, worker):
        return self.fast.active_blocks(worker)

    def prefix_tiers(self, worker, blocks):
        return self.tiers[worker]

    def hbm_prefix_blocks(self, worker, blocks):
        tiers = self.tiers[worker]
        return next((i for i, t in enumerate(tiers) if t != HBM_TIER), len(tiers))


def random_cluster(rng: random.Random, prompt_blocks: int):
    n = rng.choice([1, 2, 5, 16, 40])                 # 40 workers: masks wider than 64 bits
    ids = rng.sample(range(max(n, 48)), n)            # stable ids need not be 0..n-1
    index = BlockIndex(BS)
    prompt = [rng.randrange(50_000) for _ in range(prompt_blocks * BS + rng.randrange(BS))]
    keys = block_keys(prompt, BS)
    for wid in ids:
        for _ in range(rng.randrange(3)):
            held = rng.randrange(prompt_blocks + 1)
            if held:
                index.stored(wid, [(wid, i) for i in range(held)], None, prompt[:held * BS], BS,
                             rng.choice(["GPU", "CPU"]))
        if rng.random() < 0.3:                        # a hole: some blocks removed again
            index.removed(wid, [(wid, rng.randrange(prompt_blocks))], rng.choice(["GPU", "CPU"]))
    if rng.random() < 0.6:
        start = rng.randrange(prompt_blocks)
        index.add_shared(keys[start:start + rng.randrange(prompt_blocks)] if rng.random() < 0.5 else keys[:start])
    workers = [Worker(wid, f"http://w{wid}") for wid in ids]
    for w in workers:
        w.pending_tokens = rng.randrange(0, 3 * len(prompt))
        w.active_blocks = rng.randrange(0, 50)
    return index, prompt, keys, workers


def random_service(rng: random.Random) -> ServiceModel:
    block_bytes = BS * rng.choice([1024, 65536, 1 << 20])
    bandwidths = [10 ** rng.uniform(5, 10), 10 ** rng.uniform(5, 10)]
    latencies = [rng.choice([0.0, 10 ** rng.uniform(-5, -1)]) for _ in range(2)]
    prefill = LinearPrefill(10 ** rng.uniform(2, 5), rng.choice([0.0, 0.005]))
    return ServiceModel(prefill, BS, block_bytes, bandwidths, latencies)


@pytest.mark.parametrize("seed", range(40))
def test_live_view_equals_the_per_block_walk_and_plan(seed):
    rng = random.Random(seed)
    index, prompt, keys, workers = random_cluster(rng, prompt_blocks=rng.choice([1, 7, 40, 300]))
    service = random_service(rng)
    view = LiveView(service, workers, index, keys, default_speed=2000.0, decode_block_s=0.001)
    ref = ReferenceView(view, index, keys)
    request = _Request(len(prompt), keys)
    fast = view.service_seconds(request)
    for i, w in enumerate(workers):
        tiers = ref.tiers[i]
        assert view.prefix_tiers(i, keys) == tiers
        assert view.cached_blocks(i) == len(tiers)
        assert view.hbm_prefix_blocks(i, keys) == ref.hbm_prefix_blocks(i, keys)
        assert fast[i] == pytest.approx(service.plan(tiers, len(prompt)).seconds, rel=1e-9, abs=1e-12)
    # The same pick (up to an exact tie, which float rounding may break either way)
    costs = TierAware().costs(request, ref)
    assert TierAware().costs(request, view) == pytest.approx(costs, rel=1e-9, abs=1e-12)
    picked = TierAware().choose(request, view)
    assert costs[picked] == pytest.approx(min(costs), rel=1e-9, abs=1e-12)
    assert PrefixOverlap().choose(request, view) == PrefixOverlap().choose(request, ref)


@pytest.mark.parametrize("seed", range(20))
def test_runs_of_one_block_price_like_plan_for_the_simulators_prefill_model(seed):
    """With the quadratic attention cost (the simulator's model), one run per block tries
    every cut exactly as ``plan`` does: the general form of the fast path."""
    rng = random.Random(100 + seed)
    prefill = PrefillCostModel(load_model("llama-3-8b"), 10 ** rng.uniform(12, 15), 10 ** rng.uniform(12, 15),
                               overhead_s=0.01)
    service = ServiceModel(prefill, 256, 256 * 131072, [10 ** rng.uniform(8, 11), 10 ** rng.uniform(7, 10)],
                           [1e-4, rng.choice([0.0, 0.05])])
    workers, blocks = 6, rng.choice([1, 10, 64])
    input_tokens = blocks * 256 + rng.randrange(256)
    tiers = np.array([[rng.choice([0, 1, 2, 2, 3]) for _ in range(blocks)] for _ in range(workers)], dtype=np.int8)
    fast = service.seconds_of_runs(tiers, np.ones(blocks, dtype=np.int64), input_tokens)
    for w in range(workers):
        row = tiers[w].tolist()
        lead = row[:row.index(3)] if 3 in row else row
        assert fast[w] == pytest.approx(service.plan(lead, input_tokens).seconds, rel=1e-9)
