"""The discrete-event simulation of a disaggregated serving cluster on a request trace.

Mechanism only: a routing policy (``kvtier.sim.policies``) picks the prefill worker;
this module queues, loads, computes, stores and measures.

- A prefill worker serves its FIFO queue one request at a time. At the start of a
  request it looks up the prompt's prefix in HBM, its own host DRAM and NVMe, then
  the pod tiers, and follows the cheapest load-or-recompute plan.
- When the prefill ends the first token is out (TTFT), and every block of the prompt
  is stored in HBM and written through to every tier below (asynchronously: writes
  are not charged to the request, nor do they contend with reads).
- The KV then moves to a decode worker (``kvtier.sim.decode``).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import NamedTuple, Sequence

from kvtier.planner.costmodel import DecodeCostModel, PrefillCostModel
from kvtier.planner.models import ModelGeometry
from kvtier.sim.cache import LRUBlockCache
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.decode import DecodeJob, simulate_decode
from kvtier.sim.policies import RoutingPolicy
from kvtier.sim.service import HBM, ServiceModel, ServicePlan
from kvtier.sim.trace import Trace, TraceRequest


class RequestOutcome(NamedTuple):
    worker: int
    arrival_s: float
    start_s: float
    finish_s: float
    plan: ServicePlan
    recompute_s: float      # what a full prefill would have cost

    @property
    def ttft_s(self) -> float:
        return self.finish_s - self.arrival_s


class SimResult(NamedTuple):
    policy: str
    tier_names: tuple[str, ...]
    outcomes: list[RequestOutcome]
    total_blocks: int
    busy_s_per_worker: list[float]
    computed_tokens_per_worker: list[int]
    decode_itl_s: list[float]
    decode_tokens_per_worker: list[int]
    end_s: float
    start_s: float = 0.0    # the first arrival: rates are over end_s - start_s, not from clock 0


def _capacity_blocks(capacity_bytes: float | None, block_bytes: int) -> int | None:
    return None if capacity_bytes is None else int(capacity_bytes // block_bytes)


class _PrefillWorker:
    __slots__ = ("hbm", "local", "lookup", "queue", "running", "busy_until", "queued_est_s",
                 "outstanding_tokens", "active_blocks", "pending", "busy_s", "computed_tokens")

    def __init__(self, hbm_blocks: int | None, local_blocks: Sequence[int | None]) -> None:
        self.hbm = LRUBlockCache(hbm_blocks)
        self.local = [LRUBlockCache(c) for c in local_blocks]
        self.lookup: list = []            # (tier index, cache), fastest first
        self.queue: deque = deque()       # (request, estimated service seconds)
        self.running = False
        self.busy_until = 0.0
        self.queued_est_s = 0.0
        self.outstanding_tokens = 0
        self.active_blocks = 0
        self.pending: dict[int, int] = {}  # block -> count among queued and running requests
        self.busy_s = 0.0
        self.computed_tokens = 0


class ClusterSimulator:
    """One run of one policy over one trace. Not reusable: make one per run."""

    def __init__(self, cluster: ClusterConfig, model: ModelGeometry, prefill: PrefillCostModel,
                 decode: DecodeCostModel, policy: RoutingPolicy) -> None:
        self.cluster = cluster
        self.model = model
        self.decode_model = decode
        self.policy = policy
        self.block_bytes = model.block_bytes(cluster.block_tokens)
        worker_tiers = [t for t in cluster.tiers if t.scope == "worker"]
        pod_tiers = [t for t in cluster.tiers if t.scope == "pod"]
        # Tier index = position in cluster.tier_names. A block is read from the fastest
        # tier that holds it, so lookups go in order of read bandwidth.
        fastest_first = sorted(range(len(cluster.tiers)), key=lambda i: -cluster.tiers[i].read_bytes_per_s)
        self.workers = [
            _PrefillWorker(_capacity_blocks(cluster.hbm_cache_bytes, self.block_bytes),
                           [_capacity_blocks(t.capacity_bytes, self.block_bytes) for t in worker_tiers])
            for _ in range(cluster.prefill_workers)
        ]
        self.pod = [LRUBlockCache(_capacity_blocks(t.capacity_bytes, self.block_bytes)) for t in pod_tiers]
        for w in self.workers:
            # Each worker sees, per tier index, its own cache of a worker tier or the shared pod one.
            own, shared = iter(w.local), iter(self.pod)
            by_index = [next(own) if t.scope == "worker" else next(shared) for t in cluster.tiers]
            w.lookup = [(1 + i, by_index[i]) for i in fastest_first]
        self.service = ServiceModel(prefill, cluster.block_tokens, self.block_bytes,
                                    [t.read_bytes_per_s for t in cluster.tiers], [t.latency_s for t in cluster.tiers])
        self.num_workers = cluster.prefill_workers
        self.now = 0.0

    # --- the ClusterView the policies read -------------------------------------------
    def outstanding_tokens(self, worker: int) -> int:
        return self.workers[worker].outstanding_tokens

    def active_blocks(self, worker: int) -> int:
        return self.workers[worker].active_blocks

    def backlog_s(self, worker: int) -> float:
        w = self.workers[worker]
        return max(0.0, w.busy_until - self.now) + w.queued_est_s

    def hbm_prefix_blocks(self, worker: int, blocks: Sequence[int]) -> int:
        return self.workers[worker].hbm.prefix_length(blocks)

    def prefix_tiers(self, worker: int, blocks: Sequence[int], include_pending: bool = True) -> list[int]:
        w = self.workers[worker]
        hbm, pending, lookup = w.hbm, w.pending, w.lookup
        tiers = []
        for block in blocks:
            if block in hbm or (include_pending and block in pending):
                tiers.append(HBM)
                continue
            for index, cache in lookup:
                if block in cache:
                    tiers.append(index)
                    break
            else:
                break
        return tiers

    # --- the mechanism ------------------------------------------------------------------
    def _start(self, worker: int, events: list) -> None:
        w = self.workers[worker]
        request, estimate = w.queue.popleft()
        w.queued_est_s -= estimate
        # Requests ahead of this one have stored their blocks: no pending credit here.
        plan = self.service.plan(self.prefix_tiers(worker, request.blocks, include_pending=False),
                                 request.input_tokens)
        start = max(self.now, w.busy_until)
        w.running = True
        w.busy_until = start + plan.seconds
        w.busy_s += plan.seconds
        heapq.heappush(events, (w.busy_until, worker, request, start, plan))

    def _finish(self, worker: int, request: TraceRequest, start: float, plan: ServicePlan,
                outcomes: list, jobs: list, events: list) -> None:
        w = self.workers[worker]
        finish = w.busy_until
        w.hbm.insert(request.blocks)
        for cache in (*w.local, *self.pod):
            cache.insert(request.blocks)
        pending = w.pending
        for block in request.blocks:
            count = pending[block] - 1
            if count:
                pending[block] = count
            else:
                del pending[block]  # membership means "still pending"
        w.outstanding_tokens -= request.input_tokens
        w.active_blocks -= len(request.blocks)
        reused_tokens = min(plan.reused_blocks * self.cluster.block_tokens, request.input_tokens - 1)
        w.computed_tokens += request.input_tokens - reused_tokens
        outcomes.append(RequestOutcome(worker, request.arrival_s, start, finish, plan,
                                       self.service.full_recompute_s(request.input_tokens)))
        transfer = request.input_tokens * self.model.bytes_per_token / self.cluster.transfer_bytes_per_s
        jobs.append(DecodeJob(finish + transfer, request.input_tokens, request.output_tokens))
        w.running = False
        if w.queue:
            self._start(worker, events)

    def _drain_until(self, until: float, outcomes: list, jobs: list, events: list) -> None:
        while events and events[0][0] <= until:
            finish, worker, request, start, plan = heapq.heappop(events)
            self.now = finish
            self._finish(worker, request, start, plan, outcomes, jobs, events)

    def run(self, trace: Trace) -> SimResult:
        if trace.block_tokens != self.cluster.block_tokens:
            raise ValueError(f"trace blocks are {trace.block_tokens} tokens, cluster's {self.cluster.block_tokens}")
        events: list = []   # (finish time, worker, request, start, plan): one running request per worker
        outcomes: list[RequestOutcome] = []
        jobs: list[DecodeJob] = []
        # The workers are idle from the first arrival, wherever the trace's clock starts: from
        # 0 a request at -5 s would wait 5 s for an idle worker (traces built in code are not
        # rebased as load_trace's are).
        origin = trace.requests[0].arrival_s if trace.requests else 0.0
        self.now = origin
        for w in self.workers:
            w.busy_until = origin
        for request in trace.requests:
            self._drain_until(request.arrival_s, outcomes, jobs, events)
            self.now = request.arrival_s
            worker = self.policy.choose(request, self)
            if not 0 <= worker < self.num_workers:
                raise ValueError(f"policy {self.policy.name} chose worker {worker} of {self.num_workers}")
            w = self.workers[worker]
            # The router's estimate of this request's service time feeds the backlog others see.
            estimate = self.service.plan(self.prefix_tiers(worker, request.blocks), request.input_tokens).seconds
            w.queue.append((request, estimate))
            w.queued_est_s += estimate
            w.outstanding_tokens += request.input_tokens
            w.active_blocks += len(request.blocks)
            pending = w.pending
            for block in request.blocks:
                pending[block] = pending.get(block, 0) + 1
            if not w.running:
                self._start(worker, events)
        self._drain_until(float("inf"), outcomes, jobs, events)
        decode = simulate_decode(jobs, self.cluster.decode_workers, self.decode_model,
                                 int(self.cluster.decode_kv_bytes // self.model.bytes_per_token), origin)
        end = max((o.finish_s for o in outcomes), default=origin)
        return SimResult(self.policy.name, self.cluster.tier_names, outcomes,
                         sum(len(r.blocks) for r in trace.requests),
                         [w.busy_s for w in self.workers], [w.computed_tokens for w in self.workers],
                         decode.itl_s, decode.tokens_per_worker, max(end, decode.busy_until_s), origin)
