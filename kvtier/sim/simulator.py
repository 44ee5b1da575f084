"""The discrete-event simulation of a disaggregated serving cluster on a request trace.

Mechanism only: a routing policy (``kvtier.sim.policies``) picks the prefill worker;
this module queues, loads, computes, stores and measures.

- A prefill worker serves its FIFO queue one request at a time. At the start of a
  request it looks up the prompt's prefix in HBM, its own host DRAM and NVMe and the
  pod tiers, and follows the cheapest load-or-recompute plan over every tier holding
  each block (``ServiceModel.plan_any``: a tier's latency is paid once per request, so
  the tier that reads a block soonest is not always the one to read it from).
- At routing, the estimate of a request's service time (what later requests see as
  this worker's backlog) and its outstanding tokens come from the same plan, with the
  blocks of the requests queued or running there credited where their write-through
  will leave them (nowhere, for a cache too small for the prompt).
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
from kvtier.sim.service import ServiceModel, ServicePlan
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


def _landing(caches: Sequence[tuple[int, int | None]], position: int) -> int:
    """The tiers (bits, of ``(bit, capacity_blocks)`` pairs) whose cache still holds a prompt's
    block at ``position`` once the prompt is written: a cache evicts a prompt's tail first
    (:class:`LRUBlockCache`), so one smaller than the prompt keeps its leading blocks. HBM
    alone where HBM keeps it (nothing else matters then)."""
    bits = sum(bit for bit, capacity in caches if capacity is None or position < capacity)
    return 1 if bits & 1 else bits


class _PrefillWorker:
    __slots__ = ("hbm", "local", "lookup", "queue", "running", "running_tokens", "busy_until", "queued_est_s",
                 "outstanding_tokens", "active_blocks", "pending", "busy_s", "computed_tokens")

    def __init__(self, hbm_blocks: int | None, local_blocks: Sequence[int | None]) -> None:
        self.hbm = LRUBlockCache(hbm_blocks)
        self.local = [LRUBlockCache(c) for c in local_blocks]
        self.lookup: list = []            # (1 << tier index, cache), every tier below HBM
        self.queue: deque = deque()       # (request, estimated service seconds, tokens to compute)
        self.running = False
        self.running_tokens = 0           # its outstanding tokens, taken off when it finishes
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
        # Tier index = position in cluster.tier_names; a prefix's holders are bit masks over it.
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
            w.lookup = [(1 << (1 + i), cache) for i, cache in enumerate(by_index)]
        self.service = ServiceModel(prefill, cluster.block_tokens, self.block_bytes,
                                    [t.read_bytes_per_s for t in cluster.tiers], [t.latency_s for t in cluster.tiers])
        self.num_workers = cluster.prefill_workers
        self.now = 0.0
        self._priced: tuple | None = None   # (request, every worker's plan): service_seconds' last answer

    # --- the ClusterView the policies read -------------------------------------------
    def outstanding_tokens(self, worker: int) -> int:
        """The tokens its queued and running requests compute: each prompt less the prefix
        its plan at routing reuses (the router's meaning, ``ClusterView.outstanding_tokens``)."""
        return self.workers[worker].outstanding_tokens

    def active_blocks(self, worker: int) -> int:
        return self.workers[worker].active_blocks

    def backlog_s(self, worker: int) -> float:
        w = self.workers[worker]
        return max(0.0, w.busy_until - self.now) + w.queued_est_s

    def hbm_prefix_blocks(self, worker: int, blocks: Sequence[int]) -> int:
        return self.workers[worker].hbm.prefix_length(blocks)

    def prefix_holders(self, worker: int, blocks: Sequence[int], include_pending: bool = True) -> list[int]:
        """For each leading block, a bit mask of the tiers from which ``worker`` can have it
        (bit ``t``: tier ``t``, bit 0 alone: HBM, which beats every other); the list stops at
        the first block none holds.

        ``include_pending``: as at routing, a block of a request queued or running on
        ``worker`` counts in every cache of it that the request's write-through will leave
        it in: one with room for the block's position in the prompt (a cache of 0 blocks
        keeps nothing; one smaller than the prompt keeps its leading blocks, the tail being
        evicted first). At a request's start nothing is pending ahead of it: the caches are
        as they are.
        """
        w = self.workers[worker]
        hbm, pending, lookup = w.hbm, w.pending, w.lookup
        caches = [(bit, cache.capacity_blocks) for bit, cache in ((1, hbm), *lookup)]
        caches = caches if include_pending and pending else []
        holders = []
        for position, block in enumerate(blocks):
            if block in hbm:
                holders.append(1)
                continue
            mask = 0
            for bit, cache in lookup:
                if block in cache:
                    mask |= bit
            if caches and block in pending:
                landing = _landing(caches, position)
                mask = 1 if landing == 1 else mask | landing
            if not mask:
                break
            holders.append(mask)
        return holders

    def prefix_tiers(self, worker: int, blocks: Sequence[int], include_pending: bool = True) -> list[int]:
        """For each leading block, the tier that reads it soonest (HBM, else the highest read
        bandwidth) among those :meth:`prefix_holders` finds. The plans use every holder
        (:meth:`service_seconds`); this is the protocol's one-tier-per-block answer."""
        soonest = self.service.soonest_tier
        return [soonest(mask) for mask in self.prefix_holders(worker, blocks, include_pending)]

    def _plan(self, worker: int, request: TraceRequest, include_pending: bool) -> ServicePlan:
        return self.service.plan_any(self.prefix_holders(worker, request.blocks, include_pending),
                                     request.input_tokens)

    def service_seconds(self, request: TraceRequest) -> list[float]:
        """Every worker's predicted prefill seconds for ``request`` (the tier-aware path): its
        plan over every tier holding each block, pending blocks where they will land. The
        plans are kept for the routing estimate of the worker chosen."""
        plans = [self._plan(worker, request, True) for worker in range(self.num_workers)]
        self._priced = (request, plans)
        return [plan.seconds for plan in plans]

    # --- the mechanism ------------------------------------------------------------------
    def _start(self, worker: int, events: list) -> None:
        w = self.workers[worker]
        request, estimate, w.running_tokens = w.queue.popleft()
        w.queued_est_s -= estimate
        # Requests ahead of this one have stored their blocks: no pending credit here.
        plan = self._plan(worker, request, include_pending=False)
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
        w.outstanding_tokens -= w.running_tokens
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
            # The router's estimate of this request's service time feeds the backlog others see,
            # and the tokens it leaves to compute the outstanding tokens (as the router books them).
            priced, self._priced = self._priced, None
            plan = priced[1][worker] if priced is not None and priced[0] is request \
                else self._plan(worker, request, True)
            tokens = request.input_tokens - min(plan.reused_blocks * self.cluster.block_tokens,
                                                request.input_tokens - 1)
            w.queue.append((request, plan.seconds, tokens))
            w.queued_est_s += plan.seconds
            w.outstanding_tokens += tokens
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
