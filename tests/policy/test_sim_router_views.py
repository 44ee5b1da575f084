"""One implementation of each policy (kvtier/policy/routing.py) serves ``kvtier simulate`` and
``kvtier route``, so for the same cluster state the simulator's view and the router's LiveView
must show the policies the same numbers; and no temperature the router accepts may fail a
decision. Each case failed before its fix (audit s27/audit_sim2, D2, D3)."""

from __future__ import annotations

import math
import random

import pytest

from kvtier.planner.hardware import cost_models
from kvtier.planner.models import load_model
from kvtier.policy.routing import LeastLoaded, softmax_pick
from kvtier.router.index import BlockIndex
from kvtier.router.view import LinearPrefill, LiveView
from kvtier.router.workers import Worker
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.policies import make_policy
from kvtier.sim.service import ServiceModel
from kvtier.sim.simulator import ClusterSimulator
from kvtier.sim.trace import Trace, TraceRequest

MODEL = load_model("llama-3-70b")
BT = 4


def _req(t, blocks, out=8):
    blocks = tuple(blocks)
    return TraceRequest(t, len(blocks) * BT, out, blocks)


class _Recording:
    """Wraps a policy; keeps what the view showed it at each decision."""

    def __init__(self, inner):
        self.inner, self.name, self.seen = inner, inner.name, []

    def choose(self, request, view):
        worker = self.inner.choose(request, view)
        self.seen.append((request, worker, [view.outstanding_tokens(i) for i in range(view.num_workers)]))
        return worker


def _simulate(policy_name, trace):
    cluster = ClusterConfig(prefill_workers=2, decode_workers=1, block_tokens=BT)
    costs = cost_models(MODEL, cluster.accelerator, cluster.devices_per_worker)
    policy = _Recording(make_policy(policy_name))
    sim = ClusterSimulator(cluster, MODEL, costs.prefill, costs.decode, policy)
    return sim, policy, sim.run(trace)


# -- D2: outstanding_tokens are uncached tokens in both views ------------------------------------
def test_outstanding_tokens_mean_the_same_in_the_simulator_as_in_the_router():
    """Worker 0 has a 400-token prompt queued whose 100 blocks are all in its HBM (it computes one
    token); worker 1 has a 40-token prompt of new blocks. The router books ``prompt - predicted
    cached`` tokens (Worker.start), so its LiveView shows 1 vs 40 and least-loaded picks worker
    0. Before, the simulator's view showed whole prompts, 400 vs 40, and picked worker 1."""
    big = range(1, 101)
    trace = Trace((_req(0, big),                       # warms worker 0's HBM with the 100 blocks
                   _req(100, big),                     # all cached on worker 0 (both idle: worker 0)
                   _req(100, range(500, 510)),         # 40 new tokens -> worker 1
                   _req(100, range(600, 610))), BT)    # the decision under test
    sim, policy, result = _simulate("least_loaded", trace)
    second = [o for o in result.outcomes if o.arrival_s == 100 and o.plan.reused_blocks == 100]
    assert second and second[0].worker == 0            # the cached prompt computed 1 token on worker 0

    # The same state as the router books it: uncached (predicted prefill) tokens per worker.
    w0, w1 = Worker(0, "http://w0"), Worker(1, "http://w1")
    w0.start(400 - min(100 * BT, 400 - 1), 100)
    w1.start(40, 10)
    view = LiveView(ServiceModel(LinearPrefill(2000.0), BT, 4096 * BT, [8e9, 1e9], [0.0, 0.0]),
                    [w0, w1], BlockIndex(BT), [], 2000.0, 0.0005)
    router_pick = LeastLoaded().choose(_req(100, range(600, 610)), view)
    router_loads = [view.outstanding_tokens(i) for i in range(2)]

    _, sim_pick, sim_loads = policy.seen[-1]
    assert sim_loads == router_loads == [1, 40]
    assert sim_pick == router_pick == 0
    assert all(w.outstanding_tokens == 0 for w in sim.workers)   # what was added is taken off


def test_an_uncached_prompt_is_outstanding_in_full():
    """The control: prompts with nothing cached count every token, as before."""
    trace = Trace((_req(0, range(1, 101)), _req(0, range(200, 210)), _req(0, range(300, 305))), BT)
    _, policy, _ = _simulate("least_loaded", trace)
    assert [loads for _, _, loads in policy.seen] == [[0, 0], [400, 0], [400, 40]]


# -- D3: softmax temperature: a tiny positive value is the minimum, a huge one uniform -------------
@pytest.mark.parametrize("temperature", [5e-324, 1e-320, 1e-310])
def test_softmax_with_a_tiny_positive_temperature_takes_the_minimum_not_a_zero_division(temperature):
    """``scale = temperature * (high - low)`` underflowed to 0.0 for a subnormal temperature and
    a spread below 1 s: ZeroDivisionError on every decision."""
    assert softmax_pick([0.25, 0.2501], temperature, random.Random(0)) == 0
    assert softmax_pick([0.3, 0.2501, 0.9], temperature, random.Random(0)) == 1


def test_softmax_controls():
    costs = [0.3, 0.25, 0.9]
    assert softmax_pick(costs, 0.0, random.Random(0)) == 1                   # 0: the minimum
    assert {softmax_pick([0.5, 0.5], 1.0, random.Random(s)) for s in range(20)} == {0, 1}   # no spread: uniform
    assert softmax_pick([0.5, math.inf], 1.0, random.Random(0)) == 0         # an unreachable worker
    picks = [softmax_pick(costs, 1e308, random.Random(seed)) for seed in range(3000)]
    assert all(abs(picks.count(i) - 1000) < 120 for i in range(3))           # huge: uniform
    picks = [softmax_pick(costs, 1.0, random.Random(seed)) for seed in range(3000)]
    assert picks.count(1) > picks.count(0) > picks.count(2) > 0             # 1: weighted, every worker drawn


def test_router_with_a_tiny_temperature_decides_instead_of_failing_every_request():
    """``kvtier route --policy tier-aware --temperature 5e-324``: RouterConfig accepts it
    (temperature >= 0), and every decision raised (a 500 for every request)."""
    from kvtier.router.app import Router
    from kvtier.router.config import RouterConfig, WorkerSpec
    from tests.router.test_http import WordTokenizer

    config = RouterConfig(workers=[WorkerSpec("http://127.0.0.1:9"), WorkerSpec("http://127.0.0.1:10")],
                          block_tokens=4, kv_bytes_per_token=4096, policy="tier-aware", temperature=5e-324)
    router = Router(config, WordTokenizer())
    for w in router.workers:
        w.events_up = True                    # events connected: tier-aware decides (no approximate fallback)
    router.workers[1].pending_tokens = 50     # worker 1 has a short queue: the costs differ
    worker, _, _ = router.decide(list(range(64)), set())
    assert worker.id == 0
