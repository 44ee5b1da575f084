"""Routing policies: small objects that pick a prefill worker for a request.

A policy only decides. It reads the cluster through a :class:`ClusterView` (what a
real router learns from KV events and its own bookkeeping) and returns a worker
index; it never mutates the view. The simulator is the mechanism that acts on it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from kvtier.errors import ConfigError
from kvtier.sim.service import ServiceModel
from kvtier.sim.trace import TraceRequest


class ClusterView(Protocol):
    """Read-only state of the prefill workers at the moment of routing."""

    service: ServiceModel
    num_workers: int

    def outstanding_tokens(self, worker: int) -> int:
        """Prompt tokens routed to ``worker`` and not yet prefilled."""

    def active_blocks(self, worker: int) -> int:
        """Prompt blocks of the requests queued or running on ``worker``."""

    def backlog_s(self, worker: int) -> float:
        """Estimated seconds until ``worker`` could start a new request."""

    def hbm_prefix_blocks(self, worker: int, blocks: Sequence[int]) -> int:
        """Leading ``blocks`` that ``worker`` has reported stored in HBM."""

    def prefix_tiers(self, worker: int, blocks: Sequence[int]) -> list[int]:
        """For each leading block, the fastest tier that will hold it when ``worker`` starts
        the request (HBM includes blocks of requests ahead of it in the queue)."""


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: TraceRequest, view: ClusterView) -> int: ...


class RoundRobin:
    """Workers in turn, blind to caches and load."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: TraceRequest, view: ClusterView) -> int:
        worker = self._next % view.num_workers
        self._next += 1
        return worker


class LeastLoaded:
    """The worker with the fewest prompt tokens waiting, blind to caches."""

    name = "least_loaded"

    def choose(self, request: TraceRequest, view: ClusterView) -> int:
        return min(range(view.num_workers), key=view.outstanding_tokens)


class PrefixOverlap:
    """Dynamo's KV-router cost: ``overlap_weight x new prefill blocks + active blocks``.

    New prefill blocks are the prompt blocks the worker lacks in HBM (Dynamo's index
    is fed by device KV events); active blocks are the load already on the worker.
    In a disaggregated prefill pool the requests queued or running there play the
    role of Dynamo's decode blocks. Lowest cost wins; ties go to the lighter worker.
    """

    name = "prefix_overlap"

    def __init__(self, overlap_weight: float = 1.0) -> None:
        if overlap_weight < 0:
            raise ConfigError(f"overlap weight must be >= 0, got {overlap_weight}")
        self.overlap_weight = overlap_weight

    def choose(self, request: TraceRequest, view: ClusterView) -> int:
        count = len(request.blocks)

        def cost(worker: int) -> tuple[float, int]:
            new_blocks = count - view.hbm_prefix_blocks(worker, request.blocks)
            active = view.active_blocks(worker)
            return (self.overlap_weight * new_blocks + active, active)

        return min(range(view.num_workers), key=cost)


class TierAware:
    """kvtier's cost: the predicted time to first token on each worker, in seconds.

    ``backlog + load + compute``, where the plan credits every block the worker can
    reach (HBM, its host DRAM and NVMe, the shared pod tier), each weighted by the
    time to load it against the time to recompute it (:meth:`ServiceModel.plan`).
    """

    name = "tier_aware"

    def choose(self, request: TraceRequest, view: ClusterView) -> int:
        plan = view.service.plan
        best_worker, best_cost = 0, float("inf")
        for worker in range(view.num_workers):
            backlog = view.backlog_s(worker)
            if backlog >= best_cost:
                continue  # cannot win: service time is positive
            cost = backlog + plan(view.prefix_tiers(worker, request.blocks), request.input_tokens).seconds
            if cost < best_cost:
                best_worker, best_cost = worker, cost
        return best_worker


POLICIES = {cls.name: cls for cls in (RoundRobin, LeastLoaded, PrefixOverlap, TierAware)}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown routing policy {name!r}; use one of {sorted(POLICIES)}") from None
