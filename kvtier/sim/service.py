"""Load or recompute: the service time of one prefill given where its prefix blocks are.

Both the simulated worker (to decide what it does) and the tier-aware router (to
predict what a worker would do) call :meth:`ServiceModel.plan`, so the router's
estimate and the worker's behaviour never disagree on the cost model.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from kvtier.planner.costmodel import PrefillCostModel

#: The tier index of a block already in the worker's HBM; loads from it are free.
HBM = 0


class ServicePlan(NamedTuple):
    """Use the first ``reused_blocks`` prefix blocks (``blocks_by_tier[t]`` of them from
    tier ``t``, HBM first) and compute the rest."""

    reused_blocks: int
    blocks_by_tier: tuple[int, ...]
    load_s: float
    compute_s: float

    @property
    def seconds(self) -> float:
        return self.load_s + self.compute_s


class ServiceModel:
    """Prefill service time on one worker: sequential loads of reused blocks, then compute.

    Loads are charged before compute (no layer-wise overlap): a conservative model,
    the same for every routing policy. Each tier used costs its latency once, then
    ``block_bytes / read_bytes_per_s`` a block.
    """

    __slots__ = ("prefill", "block_tokens", "block_load_s", "tier_latency_s", "num_tiers")

    def __init__(self, prefill: PrefillCostModel, block_tokens: int, block_bytes: int,
                 tier_read_bytes_per_s: Sequence[float], tier_latency_s: Sequence[float]) -> None:
        # Index 0 is HBM: already in place.
        self.prefill = prefill
        self.block_tokens = block_tokens
        self.block_load_s = (0.0, *(block_bytes / bw for bw in tier_read_bytes_per_s))
        self.tier_latency_s = (0.0, *tier_latency_s)
        self.num_tiers = len(self.block_load_s)

    def full_recompute_s(self, input_tokens: int) -> float:
        return self.prefill.seconds(input_tokens, 0)

    def plan(self, prefix_tiers: Sequence[int], input_tokens: int) -> ServicePlan:
        """The cheapest plan for a prompt whose leading blocks sit in ``prefix_tiers``.

        ``prefix_tiers[i]`` is the fastest tier holding block ``i``; the list stops at
        the first block no tier holds. Reusing block ``i`` requires reusing 0..i-1, so
        the choice is a cut ``j``: load blocks ``< j``, compute the rest. Every cut is
        tried; loading wins whenever a tier reads a block faster than it is computed.
        """
        seconds = self.prefill.seconds
        block_tokens = self.block_tokens
        best_j, best_load = 0, 0.0
        best_total = seconds(input_tokens, 0)
        load = 0.0
        used = [False] * self.num_tiers
        for j, tier in enumerate(prefix_tiers, 1):
            if not used[tier]:
                used[tier] = True
                load += self.tier_latency_s[tier]
            load += self.block_load_s[tier]
            total = load + seconds(input_tokens, j * block_tokens)
            if total < best_total:
                best_j, best_load, best_total = j, load, total
        by_tier = [0] * self.num_tiers
        for tier in prefix_tiers[:best_j]:
            by_tier[tier] += 1
        return ServicePlan(best_j, tuple(by_tier), best_load, best_total - best_load)
