"""The live :class:`~kvtier.policy.routing.ClusterView`: the index and the workers' load, as the
simulator shows them to the same policies.

Tiers as :class:`~kvtier.sim.service.ServiceModel` numbers them: 0 = the worker's GPU
(free), 1 = its host DRAM (vLLM's CPU medium), 2 = the shared tier every worker loads from.
A view is made per decision over the healthy workers only; policy index ``i`` is
``workers[i]``.
"""

from __future__ import annotations

from typing import Sequence

from kvtier.router.index import CPU, GPU, SHARED_BIT, BlockIndex, worker_bit
from kvtier.router.workers import Worker

HBM_TIER, HOST_TIER, SHARED_TIER = 0, 1, 2


class LinearPrefill:
    """Prefill seconds as ``overhead + uncached tokens ÷ speed``: what the router can measure."""

    def __init__(self, tokens_per_s: float, overhead_s: float = 0.0) -> None:
        if tokens_per_s <= 0 or overhead_s < 0:
            raise ValueError("prefill speed must be > 0 and overhead >= 0")
        self.tokens_per_s = tokens_per_s
        self.overhead_s = overhead_s

    def seconds(self, tokens: float, cached_tokens: float = 0.0) -> float:
        return self.overhead_s + max(0.0, tokens - cached_tokens) / self.tokens_per_s


class LiveView:
    """What the policies read, for one decision (the prompt's index masks looked up once)."""

    __slots__ = ("service", "workers", "num_workers", "_masks", "default_speed", "decode_block_s")

    def __init__(self, service, workers: Sequence[Worker], index: BlockIndex, keys: Sequence[int],
                 default_speed: float, decode_block_s: float) -> None:
        self.service = service
        self.workers = workers
        self.num_workers = len(workers)
        self._masks = index.masks(keys)
        self.default_speed = default_speed
        self.decode_block_s = decode_block_s

    def outstanding_tokens(self, worker: int) -> int:
        return self.workers[worker].pending_tokens

    def active_blocks(self, worker: int) -> int:
        return self.workers[worker].active_blocks

    def backlog_s(self, worker: int) -> float:
        """Queueing (predicted prefill tokens ÷ measured speed) + decode pressure."""
        w = self.workers[worker]
        speed = w.prefill_tokens_per_s or self.default_speed
        return w.pending_tokens / speed + w.active_blocks * self.decode_block_s

    def hbm_prefix_blocks(self, worker: int, blocks: Sequence[int]) -> int:
        bit = worker_bit(self.workers[worker].id, GPU)
        n = 0
        for m in self._masks:
            if not m & bit:
                break
            n += 1
        return n

    def prefix_tiers(self, worker: int, blocks: Sequence[int]) -> list[int]:
        wid = self.workers[worker].id
        gpu, cpu = worker_bit(wid, GPU), worker_bit(wid, CPU)
        out = []
        for m in self._masks:
            if m & gpu:
                out.append(HBM_TIER)
            elif m & cpu:
                out.append(HOST_TIER)
            elif m & SHARED_BIT:
                out.append(SHARED_TIER)
            else:
                break
        return out

    @property
    def worker_ids(self) -> list[int]:
        return [w.id for w in self.workers]
