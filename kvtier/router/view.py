"""The live :class:`~kvtier.policy.routing.ClusterView`: the index and the workers' load, as the
simulator shows them to the same policies.

Tiers as :class:`~kvtier.sim.service.ServiceModel` numbers them: 0 = the worker's GPU
(free), 1 = its host DRAM (vLLM's CPU medium), 2 = the shared tier every worker loads from.
A view is made per decision over the healthy workers only; policy index ``i`` is
``workers[i]``.

A decision must take well under a millisecond for a 32 k-token prompt and 16 workers,
so the view never walks blocks per worker in Python: the prompt's index masks are
looked up once (one dict lookup per block), the blocks are grouped in runs held alike
(a prompt has a few), the (workers x runs) tier matrix is derived in a few numpy
operations, and the tier-aware price of every worker comes from
:meth:`ServiceModel.seconds_of_runs` over that matrix.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvtier.router.index import BlockIndex
from kvtier.router.workers import Worker

HBM_TIER, HOST_TIER, SHARED_TIER = 0, 1, 2
UNREACHABLE = 3


class LinearPrefill:
    """Prefill seconds as ``overhead + uncached tokens ÷ speed``: what the router can measure."""

    def __init__(self, tokens_per_s: float, overhead_s: float = 0.0) -> None:
        if tokens_per_s <= 0 or overhead_s < 0:
            raise ValueError("prefill speed must be > 0 and overhead >= 0")
        self.tokens_per_s = tokens_per_s
        self.overhead_s = overhead_s

    def seconds(self, tokens: float, cached_tokens: float = 0.0) -> float:
        return self.overhead_s + max(0.0, tokens - cached_tokens) / self.tokens_per_s

    def seconds_array(self, tokens: float, cached_tokens: np.ndarray) -> np.ndarray:
        """:meth:`seconds` for many cached-token counts in one array operation."""
        return self.overhead_s + np.maximum(0.0, tokens - cached_tokens) / self.tokens_per_s


def _leading_run(ok: np.ndarray) -> np.ndarray:
    """Per row, how many leading cells are True."""
    if ok.shape[1] == 0:
        return np.zeros(ok.shape[0], dtype=np.int64)
    stop = ~ok
    return np.where(stop.any(axis=1), stop.argmax(axis=1), ok.shape[1])


class LiveView:
    """What the policies read, for one decision (the prompt's index masks looked up once)."""

    __slots__ = ("service", "workers", "num_workers", "default_speed", "decode_block_s", "step_tokens",
                 "run_tiers", "run_blocks", "reach", "_run_ends", "_hbm_run")

    def __init__(self, service, workers: Sequence[Worker], index: BlockIndex, keys: Sequence[int],
                 default_speed: float, decode_block_s: float, step_tokens: int = 0) -> None:
        self.service = service
        self.workers = workers
        self.num_workers = len(workers)
        self.default_speed = default_speed
        self.decode_block_s = decode_block_s
        self.step_tokens = step_tokens   #: the workers' prefill step budget (vLLM max_num_batched_tokens); 0: none
        #: run_tiers[i, r]: the fastest tier from which workers[i] can have the blocks of
        #: run r (run_blocks[r] consecutive prompt blocks held alike); UNREACHABLE: none
        self.run_tiers, self.run_blocks = index.tier_runs([w.id for w in workers], keys,
                                                          (HBM_TIER, HOST_TIER, SHARED_TIER, UNREACHABLE))
        self._run_ends = np.concatenate(([0], np.cumsum(self.run_blocks)))
        #: reach[i]: leading blocks workers[i] can have from some tier
        self.reach = self._run_ends[_leading_run(self.run_tiers != UNREACHABLE)]
        self._hbm_run: np.ndarray | None = None

    def outstanding_tokens(self, worker: int) -> int:
        return self.workers[worker].pending_tokens

    def active_blocks(self, worker: int) -> int:
        return self.workers[worker].active_blocks

    def backlog_s(self, worker: int) -> float:
        """Queueing + decode pressure.

        The queue is the queued requests' uncached tokens ÷ the measured speed plus their
        predicted tier-load seconds (the connector loads them before they prefill; before,
        loads were left out). The speed is the *slope* of the prefill line the router fits to
        idle first bytes (:class:`~kvtier.router.workers.PrefillFit`), not a ratio of averages
        that folds each request's fixed part into it (~0.1-0.2 s here: HTTP, scheduling, the
        connector's lookup), which made queued tokens look 1.5-2x dearer than tier loads and
        decode steps. The fixed part is not charged per queued request: vLLM prefills the
        queue in shared steps, and on the trace bench a (burst, worker) group's TTFT did not
        grow with its number of requests (regression: -0.03 to +0.02 s per request), only
        with its tokens; the new request's own fixed part is in its service time.

        One speed for every worker (``default_speed``: the router pools every worker's idle
        samples): per-worker estimates of two identical workers on the shared 2-core machine
        differed by up to 1.7x from noise, and a burst split in that ratio (5907 / 3473
        uncached tokens) made the slower half of it wait.

        Decode pressure is what the requests already running cost a new one's first token:
        its prefill joins the worker's next step, after the running one, and shares it with
        their decodes; that is about one decode step, which the router measures per worker
        from its streams (:meth:`Worker.decode_gap`). Before any measurement, the configured
        ``decode_block_s`` per active block (Dynamo's active decode blocks). An idle worker
        has none. This term is one step, not one per request: the cost that grows with a
        worker's load is its queue, which ``pending_tokens`` already counts.
        """
        w = self.workers[worker]
        speed = self.default_speed
        if not w.inflight:
            pressure = 0.0
        elif w.decode_step_s is not None:
            pressure = w.decode_step_s
        else:
            pressure = w.active_blocks * self.decode_block_s
        return w.pending_tokens / speed + w.pending_load_s + pressure

    def service_seconds(self, request) -> np.ndarray:
        """Every worker's predicted prefill seconds for ``request`` (the tier-aware fast path):
        priced per run, exact for the router's linear prefill time (see ``seconds_of_runs``);
        UNREACHABLE is ``service.num_tiers``, so each row stops at its first one."""
        return self.service.seconds_of_runs(self.run_tiers, self.run_blocks, request.input_tokens)

    def step_sharing_delay_s(self, worker: int, request) -> float:
        """What sending ``request`` to ``worker`` adds to the first tokens of the requests
        already waiting there, summed (:meth:`Worker.step_sharing_delay_s`), for the tokens it
        would compute there (its prompt less the prefix ``worker`` can load)."""
        if not self.step_tokens:
            return 0.0
        block_tokens = self.service.block_tokens
        tokens = max(1, request.input_tokens - int(self.reach[worker]) * block_tokens)
        return self.workers[worker].step_sharing_delay_s(tokens, self.step_tokens, self.default_speed)

    def hbm_prefix_blocks(self, worker: int, blocks: Sequence[int]) -> int:
        if self._hbm_run is None:
            self._hbm_run = self._run_ends[_leading_run(self.run_tiers == HBM_TIER)]
        return int(self._hbm_run[worker])

    def prefix_tiers(self, worker: int, blocks: Sequence[int]) -> list[int]:
        runs = int(np.searchsorted(self._run_ends, self.reach[worker])) if self.reach[worker] else 0
        return np.repeat(self.run_tiers[worker, :runs], self.run_blocks[:runs]).tolist()

    def load_seconds(self, worker: int) -> float:
        """Predicted seconds for ``worker`` to load every prompt block it can reach (the
        connector loads the whole matched prefix, whatever the router priced): per run,
        blocks x the tier's per-block time, plus each tier's latency once."""
        reach = int(self.reach[worker])
        if not reach:
            return 0.0
        runs = int(np.searchsorted(self._run_ends, reach))
        tiers = self.run_tiers[worker, :runs]
        per_block = np.take(np.asarray(self.service.block_load_s), tiers)
        latency = sum(self.service.tier_latency_s[t] for t in set(tiers.tolist()))
        return float(per_block @ self.run_blocks[:runs]) + latency

    def cached_blocks(self, worker: int) -> int:
        """Leading prompt blocks ``worker`` can have without recomputing them."""
        return int(self.reach[worker])

    @property
    def worker_ids(self) -> list[int]:
        return [w.id for w in self.workers]
