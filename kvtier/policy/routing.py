"""Routing policies: small objects that pick a prefill worker for a request.

One implementation for both consumers: ``kvtier simulate`` (the simulator is the
view) and ``kvtier route`` (a live view built from KV events and the router's own
bookkeeping), so that what the simulator predicts is what the router does.

A policy only decides. It reads the cluster through a :class:`ClusterView` and
returns a worker index in ``range(view.num_workers)``; it never mutates the view and
does no I/O. Policies that learn from their own decisions (round-robin's turn, the
approximate tree) keep that state themselves.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from itertools import repeat
from typing import Any, Protocol, Sequence

from kvtier.errors import ConfigError


class RouteRequest(Protocol):
    """What a policy needs of a request: its prompt's block identities, leading block first."""

    input_tokens: int
    blocks: Sequence[Any]


class ServicePlanner(Protocol):
    """Load-or-recompute pricing (:class:`kvtier.sim.service.ServiceModel` implements it)."""

    def plan(self, prefix_tiers: Sequence[int], input_tokens: int) -> Any:
        """The cheapest plan; its ``.seconds`` is the predicted prefill time."""


class ClusterView(Protocol):
    """Read-only state of the prefill workers at the moment of routing."""

    service: ServicePlanner
    num_workers: int

    def outstanding_tokens(self, worker: int) -> int:
        """Uncached prompt tokens ``worker`` still has to prefill: for each request routed
        there and not yet prefilled (queued or running), its prompt less the prefix predicted
        reused (from HBM or loaded from a tier) when it was routed; at least one token each.
        Not whole prompts: a fully cached prompt adds one token. The router books
        ``prompt - predicted cached`` (``Worker.pending_tokens``); the simulator the tokens
        its routing-time plan computes."""

    def active_blocks(self, worker: int) -> int:
        """Blocks of the requests queued or running on ``worker`` (Dynamo's decode blocks)."""

    def backlog_s(self, worker: int) -> float:
        """Estimated seconds until ``worker`` could start a new request (queue + decode pressure)."""

    def hbm_prefix_blocks(self, worker: int, blocks: Sequence[Any]) -> int:
        """Leading ``blocks`` that ``worker`` has reported stored in HBM."""

    def prefix_tiers(self, worker: int, blocks: Sequence[Any]) -> list[int]:
        """For each leading block, the fastest tier from which ``worker`` can have it (0 = HBM);
        the list stops at the first block no tier reachable from ``worker`` holds. A block in
        a shared tier is reachable from every worker."""

    # Optional (the router's live view has it; the simulator's workers share no steps):
    #   step_sharing_delay_s(worker, request) -> float: the seconds ``request`` sent to
    #   ``worker`` would add, summed, to the first tokens of the requests already waiting
    #   there (engines that prefill a queue in shared token-budgeted steps, as vLLM does).
    # Optional fast path (both views have it; TierAware uses it where present):
    #   service_seconds(request) -> sequence of floats: for every worker, the predicted
    #   prefill seconds of ``request`` there, the cheapest load-or-recompute plan. The router's
    #   is ``service.plan(prefix_tiers(worker, request.blocks), request.input_tokens).seconds``
    #   computed at once (numpy over a workers x blocks tier matrix). The simulator's weighs
    #   every tier holding each block (``ServiceModel.plan_any``: a slower tier with less
    #   latency may be the cheaper one to load from), so it may be below that.


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest, view: ClusterView) -> int: ...


class RoundRobin:
    """Workers in turn, blind to caches and load."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, view: ClusterView) -> int:
        worker = self._next % view.num_workers
        self._next += 1
        return worker


class LeastLoaded:
    """The worker with the fewest prompt tokens waiting, blind to caches."""

    name = "least_loaded"

    def choose(self, request: RouteRequest, view: ClusterView) -> int:
        return min(range(view.num_workers), key=view.outstanding_tokens)


class PrefixOverlap:
    """Dynamo's KV-router cost: ``overlap_weight x new prefill blocks + active blocks``.

    New prefill blocks are the prompt blocks the worker lacks in HBM (Dynamo's index
    is fed by device KV events); active blocks are the load already on the worker.
    Lowest cost wins; ties go to the lighter worker.
    """

    name = "prefix_overlap"

    def __init__(self, overlap_weight: float = 1.0) -> None:
        if overlap_weight < 0:
            raise ConfigError(f"overlap weight must be >= 0, got {overlap_weight}")
        self.overlap_weight = overlap_weight

    def choose(self, request: RouteRequest, view: ClusterView) -> int:
        count = len(request.blocks)

        def cost(worker: int) -> tuple[float, int]:
            new_blocks = count - view.hbm_prefix_blocks(worker, request.blocks)
            active = view.active_blocks(worker)
            return (self.overlap_weight * new_blocks + active, active)

        return min(range(view.num_workers), key=cost)


def softmax_pick(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """A worker drawn with probability ∝ exp(-cost / (temperature x spread)).

    Costs are divided by their spread (max - min) so that the temperature means the
    same whatever the unit and scale of the costs: 0 → always the minimum, 1 → the
    worst worker is e times less likely than the best. An exact tie (a spread of 0) is
    drawn uniformly, as Dynamo's ``softmax_sample`` draws equal values: taking the first
    minimum there sent every request to worker 0 among identical idle workers, whatever
    the temperature, while costs 1e-12 apart were spread.
    """
    low, high = min(costs), max(costs)
    if temperature > 0 and high == low:
        return rng.randrange(len(costs))
    scale = temperature * (high - low) if temperature > 0 else 0.0
    # A temperature so small that the scale underflows to 0 (a subnormal one, or a tiny
    # spread) is as good as 0: the minimum, not a division by zero.
    if not scale > 0 or not math.isfinite(high - low):
        return costs.index(low)
    if scale == math.inf:     # a huge temperature over a finite spread: uniform
        return rng.choices(range(len(costs)))[0]
    weights = [math.exp(-(c - low) / scale) for c in costs]
    return rng.choices(range(len(costs)), weights)[0]


class TierAware:
    """kvtier's cost: what sending the request to a worker adds to the time to first token,
    in seconds: its own predicted TTFT there, plus what it delays the requests already
    queued there.

    Its own TTFT is ``backlog + load + compute``, where the plan credits every block the
    worker can reach (HBM, its host DRAM and NVMe, the shared pod tier), each weighted by
    the time to load it against the time to recompute it (``view.service.plan``). The
    delay to others is ``view.step_sharing_delay_s`` where the view has it: an engine that
    prefills its queue in shared steps (vLLM) answers every request of a step when the
    step ends, so a newcomer's tokens delay each request it shares its step with. Taking
    only its own TTFT, a burst sent together was split to even out the workers' tokens,
    and a large request landed in a step with many small ones, which all waited for it
    (round-robin's p50 beat it in a quiet run of the trace bench). With the delay
    added, the pick is the smallest increase of the summed TTFT. A FIFO engine that runs
    one request at a time (the simulator's worker) delays nobody ahead: the same cost as
    before. With a ``temperature`` > 0 the pick is a softmax draw over those costs
    (spreads ties and near-ties); 0, the default, takes the minimum.

    No pile-up: a prefix that every worker can load (a shared tier holds it, or every
    HBM does) adds nearly the same load time to every worker, so backlog decides.
    """

    name = "tier_aware"

    def __init__(self, temperature: float = 0.0, seed: int = 0) -> None:
        if temperature < 0:
            raise ConfigError(f"softmax temperature must be >= 0, got {temperature}")
        self.temperature = temperature
        self._rng = random.Random(seed)

    @staticmethod
    def _delays(request: RouteRequest, view: ClusterView) -> list[float]:
        delay = getattr(view, "step_sharing_delay_s", None)
        if delay is None:
            return [0.0] * view.num_workers
        return [delay(w, request) for w in range(view.num_workers)]

    def costs(self, request: RouteRequest, view: ClusterView) -> list[float]:
        delays = self._delays(request, view)
        fast = getattr(view, "service_seconds", None)
        if fast is not None:
            service = fast(request)
            return [view.backlog_s(w) + float(service[w]) + delays[w] for w in range(view.num_workers)]
        plan = view.service.plan
        return [view.backlog_s(w) + plan(view.prefix_tiers(w, request.blocks), request.input_tokens).seconds
                + delays[w] for w in range(view.num_workers)]

    def choose(self, request: RouteRequest, view: ClusterView) -> int:
        if self.temperature > 0:
            return softmax_pick(self.costs(request, view), self.temperature, self._rng)
        if hasattr(view, "service_seconds"):
            # Every worker priced at once; the first of equal minima wins, as below.
            costs = self.costs(request, view)
            return costs.index(min(costs))
        plan = view.service.plan
        delays = self._delays(request, view)
        best_worker, best_cost = 0, float("inf")
        for worker in range(view.num_workers):
            backlog = view.backlog_s(worker) + delays[worker]
            if backlog >= best_cost:
                continue  # cannot win: service time is positive
            cost = backlog + plan(view.prefix_tiers(worker, request.blocks), request.input_tokens).seconds
            if cost < best_cost:
                best_worker, best_cost = worker, cost
        return best_worker


class Approximate:
    """SGLang-like cache-aware routing from the router's own decisions, no events needed.

    The policy remembers which worker each block was last sent to (an LRU map of at most
    ``capacity`` blocks: a block may have been evicted there since, hence approximate).
    If the loads are balanced, the request goes to the worker that was sent the longest
    run of its leading blocks, provided it covers at least ``match_threshold`` of the
    prompt; otherwise (imbalanced, or no good match) to the least-loaded worker.
    Balanced means ``max - min`` outstanding tokens ≤ ``balance_tokens`` or ≤
    ``balance_ratio`` x min.
    """

    name = "approximate"

    def __init__(self, capacity: int = 1 << 20, match_threshold: float = 0.5,
                 balance_tokens: int = 4096, balance_ratio: float = 1.5) -> None:
        if capacity <= 0:
            raise ConfigError(f"approximate tree capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.match_threshold = match_threshold
        self.balance_tokens = balance_tokens
        self.balance_ratio = balance_ratio
        self._owner: OrderedDict[Any, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def record(self, blocks: Sequence[Any], worker_id: Any) -> None:
        """Remember that ``blocks`` went to ``worker_id`` (also called for other policies'
        decisions, so that the tree is warm when the router falls back to it)."""
        owner = self._owner
        # Remove then re-insert: the blocks become the newest, at C speed (a 1000-block
        # prompt is recorded on every routing decision, so no Python loop per block).
        deque(map(owner.pop, blocks, repeat(None)), maxlen=0)
        owner.update(zip(blocks, repeat(worker_id)))
        while len(owner) > self.capacity:
            owner.popitem(last=False)

    def forget_worker(self, worker_id: Any) -> None:
        """Drop every block attributed to ``worker_id`` (it left)."""
        for block in [b for b, w in self._owner.items() if w == worker_id]:
            del self._owner[block]

    def choose(self, request: RouteRequest, view: ClusterView) -> int:
        # A view whose workers come and go (the router's healthy subset) names them by
        # stable ids; the simulator's workers are their indices.
        n = view.num_workers
        ids = list(getattr(view, "worker_ids", range(n)))
        position = {wid: i for i, wid in enumerate(ids)}
        loads = [view.outstanding_tokens(w) for w in range(n)]
        lightest = min(range(n), key=loads.__getitem__)
        worker = lightest
        balanced = max(loads) - loads[lightest] <= max(self.balance_tokens, self.balance_ratio * loads[lightest])
        if balanced and request.blocks:
            owner = self._owner
            first = owner.get(request.blocks[0])
            matched = 0
            if first in position:
                for block in request.blocks:
                    if owner.get(block) != first:
                        break
                    matched += 1
                if matched >= self.match_threshold * len(request.blocks):
                    worker = position[first]
        self.record(request.blocks, ids[worker])
        return worker


#: The policies ``kvtier simulate`` compares (names as in its output).
POLICIES = {cls.name: cls for cls in (RoundRobin, LeastLoaded, PrefixOverlap, TierAware)}
#: Every policy, by its simulator name, and the ``kvtier route --policy`` spellings.
ALL_POLICIES = {**POLICIES, Approximate.name: Approximate}
ROUTE_NAMES = {"round-robin": "round_robin", "least-loaded": "least_loaded", "prefix": "prefix_overlap",
               "approximate": "approximate", "tier-aware": "tier_aware"}


def make_policy(name: str, **options: Any) -> RoutingPolicy:
    """A policy by its simulator name (``tier_aware``) or its router name (``tier-aware``)."""
    cls = ALL_POLICIES.get(ROUTE_NAMES.get(name, name))
    if cls is None:
        raise ConfigError(f"unknown routing policy {name!r}; use one of {sorted(ALL_POLICIES)} "
                          f"(or, as kvtier route spells them, {sorted(ROUTE_NAMES)})")
    return cls(**options)
