"""Load or recompute: the service time of one prefill given where its prefix blocks are.

Both the simulated worker (to decide what it does) and the tier-aware router (to
predict what a worker would do) call :meth:`ServiceModel.plan`, so the router's
estimate and the worker's behaviour never disagree on the cost model.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

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

    __slots__ = ("prefill", "block_tokens", "block_load_s", "tier_latency_s", "num_tiers", "_cheapest")

    def __init__(self, prefill: PrefillCostModel, block_tokens: int, block_bytes: int,
                 tier_read_bytes_per_s: Sequence[float], tier_latency_s: Sequence[float]) -> None:
        # Index 0 is HBM: already in place.
        self.prefill = prefill
        self.block_tokens = block_tokens
        self.block_load_s = (0.0, *(block_bytes / bw for bw in tier_read_bytes_per_s))
        self.tier_latency_s = (0.0, *tier_latency_s)
        self.num_tiers = len(self.block_load_s)
        self._cheapest: dict[int, int] = {}   # tier mask -> its tier that reads a block soonest

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

    def soonest_tier(self, mask: int) -> int:
        """The tier of bit mask ``mask`` that reads a block soonest: HBM, else the highest
        bandwidth (the lowest index of equals). ``mask`` must name at least one tier."""
        tier = self._cheapest.get(mask)
        if tier is None:
            tier = self._cheapest[mask] = min((t for t in range(self.num_tiers) if mask >> t & 1),
                                              key=self.block_load_s.__getitem__)
        return tier

    def plan_any(self, holders: Sequence[int], input_tokens: int) -> ServicePlan:
        """The cheapest plan where a block may sit in several tiers.

        ``holders[i]`` is a bit mask of the tiers holding block ``i`` (bit ``t``: tier
        ``t``, bit 0: HBM); the list stops at the first block no tier holds. The block a
        tier reads soonest is not always the one to read it from: a tier's latency is paid
        once per request, so a prefix that a nearby tier and a faster but distant one both
        hold may load sooner from the nearby one. So every set of tiers below HBM that hold
        some of the prefix is tried (HBM, free, always in it): each block from the set's
        tier that reads it soonest, each cut priced as :meth:`plan` does, the latency of
        each tier used counted once. ``2**k`` passes for ``k`` tiers holding blocks (a
        cluster has a handful: :data:`~kvtier.sim.cluster.MAX_TIERS`); a pass ends as soon
        as its loads alone cost more than the best plan. Where every block has one tier to
        come from this is :meth:`plan` of those tiers; the full set is tried first, so a
        tie keeps the soonest-reading tiers.
        """
        seconds = self.prefill.seconds
        block_tokens = self.block_tokens
        block_load_s, latency_s = self.block_load_s, self.tier_latency_s
        cheapest = self._cheapest
        union = 0
        for mask in holders:
            union |= mask
        compute = [seconds(input_tokens, j * block_tokens) for j in range(len(holders) + 1)]
        best_total, best_load, best_j, best_set = compute[0], 0.0, 0, 0
        lower = union & ~1
        subset = lower
        while True:
            allowed = subset | 1
            load, used = 0.0, 0
            for j, mask in enumerate(holders, 1):
                mask &= allowed
                if not mask:
                    break
                tier = cheapest.get(mask)
                if tier is None:
                    tier = self.soonest_tier(mask)
                if not used >> tier & 1:
                    used |= 1 << tier
                    load += latency_s[tier]
                load += block_load_s[tier]
                if load >= best_total:
                    break   # compute is never negative: no later cut of this set can win
                total = load + compute[j]
                if total < best_total:
                    best_total, best_load, best_j, best_set = total, load, j, allowed
            if not subset:
                break
            subset = (subset - 1) & lower
        by_tier = [0] * self.num_tiers
        for mask in holders[:best_j]:
            by_tier[cheapest[mask & best_set]] += 1
        return ServicePlan(best_j, tuple(by_tier), best_load, best_total - best_load)

    # --- many workers at once (the router's decision path) ------------------------------
    def seconds_of_runs(self, run_tiers: np.ndarray, run_blocks: np.ndarray, input_tokens: int) -> np.ndarray:
        """Predicted prefill seconds of every worker (row) at once, from tier *runs*.

        ``run_tiers[w, r]`` is the tier from which worker ``w`` has every block of run
        ``r`` (``run_blocks[r]`` consecutive prompt blocks, leading run first); a code
        ``>= num_tiers`` means unreachable, which ends that worker's usable prefix.
        The result is ``plan(tiers, input_tokens).seconds`` of each row with the runs
        expanded, for a prefill time concave in the cached tokens (linear, as the
        router's :class:`~kvtier.router.view.LinearPrefill`, or with the attention
        term): within a run the total (linear loads + concave compute) is concave in
        the cut, so its minimum is at one of the run's ends, and only run ends (and no
        load at all) are priced. For any other prefill time pass runs of one block:
        every cut is then priced, as :meth:`plan` does. A tier's latency is folded into
        the first run it serves; runs past the first unreachable one cost infinity.
        Equal to :meth:`plan` up to float rounding (sums associate differently), which
        ``tests/router/test_fast_pricing.py`` checks on random views.
        """
        run_tiers = np.asarray(run_tiers)
        workers, runs = run_tiers.shape
        ends = np.cumsum(run_blocks)
        curve = self._compute_at(input_tokens, np.concatenate(([0], ends)))
        if runs == 0:
            return np.full(workers, curve[0])
        codes = np.minimum(run_tiers, self.num_tiers)       # num_tiers: "unreachable"
        per_run = np.take(np.array([*self.block_load_s, np.inf]), codes) * run_blocks
        rows = np.arange(workers)
        for tier in range(1, self.num_tiers):
            latency = self.tier_latency_s[tier]
            if latency:
                here = codes == tier
                first = here.argmax(axis=1)
                used = here[rows, first]
                per_run[rows[used], first[used]] += latency
        total = np.cumsum(per_run, axis=1)
        total += curve[1:]
        return np.minimum(curve[0], total.min(axis=1))

    def _compute_at(self, input_tokens: int, cached_blocks: np.ndarray) -> np.ndarray:
        """Compute seconds with ``cached_blocks[i]`` leading blocks in place, for each ``i``."""
        cached = np.asarray(cached_blocks, dtype=np.float64) * self.block_tokens
        vectorised = getattr(self.prefill, "seconds_array", None)
        if vectorised is not None:
            return vectorised(input_tokens, cached)
        seconds = self.prefill.seconds
        return np.array([seconds(input_tokens, c) for c in cached.tolist()])
