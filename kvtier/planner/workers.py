"""SLA worker planning: prefill and decode worker counts that meet TTFT and ITL targets.

Prefill is a queue with ``c`` servers (workers). With arrival rate ``λ``, mean service
``E[S]`` and squared coefficients of variation ``ca²`` (arrivals) and ``cs²``
(service), the Allen–Cunneen approximation of the M/G/c wait is::

    E[Wq] ≈ ErlangC(c, λE[S]) / (c/E[S] - λ) × (ca² + cs²) / 2

and, the wait being exponential given that one waits, its ``p`` quantile is
``E[Wq]/C × ln(C / (1 - p))``. The TTFT quantile is bounded by that wait quantile
plus the service quantile. Service times come from the prefill cost model with an
explicit hit rate: that share of every prompt is loaded (at ``load_bytes_per_s``)
instead of recomputed.

Decode: ``d`` workers share ``λ × E[output]`` tokens a second; each runs the batch
``n`` that satisfies ``n = (λ/d) × E[output] × step(n)`` (Little's law), which must
fit its KV memory and keep ``step(n)`` within the ITL target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from kvtier.errors import ConfigError
from kvtier.planner.costmodel import DecodeCostModel, PrefillCostModel

MAX_WORKERS = 100_000
_NO_PREFILL_COUNT = f"no prefill worker count under {MAX_WORKERS:,} meets the TTFT target"


@dataclass(frozen=True, slots=True)
class SLATargets:
    ttft_s: float
    itl_s: float
    ttft_percentile: float = 0.9

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ConfigError("TTFT and ITL targets must be positive seconds (e.g. --ttft 2 --itl 0.05)")
        if not 0 < self.ttft_percentile < 1:
            raise ConfigError(f"TTFT percentile is a fraction in (0, 1) (0.9 for p90), got {self.ttft_percentile}")


@dataclass(frozen=True, slots=True)
class Workload:
    """Arrival rate, prompt and output lengths (samples or one mean each), and the hit
    rate assumed: the share of prompt tokens whose KV is loaded rather than recomputed."""

    arrival_rate_per_s: float
    input_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    hit_rate: float
    arrival_scv: float = 1.0   # 1.0 = Poisson; bursty traces are higher

    def __post_init__(self) -> None:
        if self.arrival_rate_per_s <= 0:
            raise ConfigError(f"arrival rate must be > 0 requests/s, got {self.arrival_rate_per_s}")
        if not self.input_tokens or not self.output_tokens or min(self.input_tokens) <= 0 \
                or min(self.output_tokens) < 0:
            raise ConfigError("workload needs positive prompt lengths and at least one output length (>= 0)")
        if not 0 <= self.hit_rate < 1:
            raise ConfigError(f"hit rate is a fraction in [0, 1), got {self.hit_rate}")
        if self.arrival_scv < 0:
            raise ConfigError(f"arrival SCV must be >= 0, got {self.arrival_scv}")

    @classmethod
    def from_arrivals(cls, arrivals_s: Sequence[float], input_tokens: Sequence[int],
                      output_tokens: Sequence[int], hit_rate: float) -> "Workload":
        gaps = np.diff(np.asarray(arrivals_s, dtype=float))
        if len(gaps) < 2 or gaps.sum() <= 0:
            raise ConfigError("a workload from arrivals needs at least 3 requests spread over time")
        scv = float(gaps.var() / gaps.mean() ** 2)
        return cls(1.0 / float(gaps.mean()), tuple(input_tokens), tuple(output_tokens), hit_rate, scv)


class WorkerPlan(NamedTuple):
    prefill_workers: int
    decode_workers: int
    prefill_utilization: float
    predicted_ttft_s: float          # at the target percentile
    mean_prefill_s: float
    decode_batch: int
    predicted_itl_s: float
    hit_rate: float
    arrival_scv: float


def erlang_c(servers: int, offered_load: float) -> float:
    """Probability that an arrival waits in an M/M/c queue (offered load ``a = λ E[S]``)."""
    if offered_load >= servers:
        return 1.0
    blocking = 1.0
    for k in range(1, servers + 1):  # Erlang B by its stable recursion
        blocking = offered_load * blocking / (k + offered_load * blocking)
    rho = offered_load / servers
    return blocking / (1.0 - rho * (1.0 - blocking))


def prefill_service_times(workload: Workload, prefill: PrefillCostModel, load_bytes_per_s: float) -> np.ndarray:
    """Service seconds per prompt when ``hit_rate`` of it is loaded at ``load_bytes_per_s``."""
    if load_bytes_per_s <= 0:
        raise ConfigError("load bandwidth must be positive")
    bytes_per_token = prefill.model.bytes_per_token
    out = []
    for n in workload.input_tokens:
        cached = workload.hit_rate * n
        out.append(cached * bytes_per_token / load_bytes_per_s + prefill.seconds(n, cached))
    return np.array(out)


def ttft_quantile(servers: int, rate: float, service: np.ndarray, arrival_scv: float, percentile: float) -> float:
    mean = float(service.mean())
    offered = rate * mean
    if offered >= servers:
        return math.inf
    service_scv = float(service.var() / mean**2)
    wait_prob = erlang_c(servers, offered)
    mean_wait = wait_prob / (servers / mean - rate) * (arrival_scv + service_scv) / 2.0
    wait_q = 0.0
    if wait_prob > 1.0 - percentile:
        wait_q = mean_wait / wait_prob * math.log(wait_prob / (1.0 - percentile))
    return wait_q + float(np.quantile(service, percentile))


def decode_batch(workers: int, rate: float, mean_output: float, kv_per_request: float,
                 decode: DecodeCostModel) -> tuple[float, float]:
    """The steady batch per decode worker and its step time (fixed point of Little's law)."""
    batch = 1.0
    for _ in range(200):
        step = decode.step_seconds(max(1, round(batch)), batch * kv_per_request)
        new = max(1.0, rate / workers * mean_output * step)
        if new > 1e12:  # no fixed point: too few workers for the rate (the batch grows without bound)
            return math.inf, math.inf
        if abs(new - batch) < 1e-3:
            break
        batch = new
    return batch, decode.step_seconds(max(1, round(batch)), batch * kv_per_request)


def prefill_workers_for(rate: float, service: np.ndarray, arrival_scv: float, targets: SLATargets) -> int:
    """The fewest prefill workers whose TTFT percentile meets the target; raise if none can."""
    if float(np.quantile(service, targets.ttft_percentile)) > targets.ttft_s:
        raise ConfigError(
            f"even an idle worker misses the TTFT target: p{targets.ttft_percentile * 100:g} prefill alone takes "
            f"{np.quantile(service, targets.ttft_percentile):.2f} s > {targets.ttft_s} s; raise the hit rate, "
            "the devices per worker, or the target"
        )
    workers = max(1, math.ceil(rate * service.mean()))
    if workers > MAX_WORKERS:
        # before any queue figure: erlang_c loops over every server, and from ceil(rate x E[S])
        # workers of 3.7e9 (`plan workers --rate 1e10`) it never came back (audit s34 a5 D7)
        raise ConfigError(_NO_PREFILL_COUNT)
    while ttft_quantile(workers, rate, service, arrival_scv, targets.ttft_percentile) > targets.ttft_s:
        workers += 1
        if workers > MAX_WORKERS:
            raise ConfigError(_NO_PREFILL_COUNT)
    return workers


def decode_workers_for(rate: float, mean_in: float, mean_out: float, decode: DecodeCostModel, itl_s: float,
                       decode_kv_tokens: float) -> tuple[int, float, float]:
    """(workers, batch, step seconds): the fewest decode workers whose steady batch steps
    within ``itl_s`` and fits ``decode_kv_tokens``; raise if none can. ``itl_s`` of infinity
    asks for the fewest that keep up at all (a finite batch)."""
    kv_per_request = mean_in + mean_out / 2  # KV read per step, averaged over a request's life
    if decode.step_seconds(1, kv_per_request) > itl_s:
        raise ConfigError(f"a single sequence already steps slower than the ITL target {itl_s} s;"
                          " use more devices per decode worker or a looser target")

    def meets(workers: int) -> bool:
        batch, step = decode_batch(workers, rate, mean_out, kv_per_request, decode)
        return math.isfinite(step) and step <= itl_s and batch * (mean_in + mean_out) <= decode_kv_tokens

    # More workers never make a worker's batch larger: the answer is the edge of a monotone
    # predicate, found by doubling then bisecting (a linear search took seconds to reach 100,000)
    low, high = 0, 1   # low fails (0 workers trivially), high is the candidate
    while not meets(high):
        if high >= MAX_WORKERS:
            raise ConfigError("no decode worker count under 100,000 meets the ITL target")
        low, high = high, min(2 * high, MAX_WORKERS)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if meets(mid) else (mid, high)
    batch, step = decode_batch(high, rate, mean_out, kv_per_request, decode)
    return high, batch, step


def plan_workers(workload: Workload, targets: SLATargets, prefill: PrefillCostModel, decode: DecodeCostModel,
                 load_bytes_per_s: float, decode_kv_tokens: int) -> WorkerPlan:
    """The fewest prefill and decode workers that meet ``targets``; raise if none can."""
    service = prefill_service_times(workload, prefill, load_bytes_per_s)
    rate = workload.arrival_rate_per_s
    prefill_workers = prefill_workers_for(rate, service, workload.arrival_scv, targets)
    decode_workers, batch, step = decode_workers_for(rate, float(np.mean(workload.input_tokens)),
                                                     float(np.mean(workload.output_tokens)), decode, targets.itl_s,
                                                     decode_kv_tokens)
    return WorkerPlan(
        prefill_workers=prefill_workers,
        decode_workers=decode_workers,
        prefill_utilization=rate * float(service.mean()) / prefill_workers,
        predicted_ttft_s=ttft_quantile(prefill_workers, rate, service, workload.arrival_scv, targets.ttft_percentile),
        mean_prefill_s=float(service.mean()),
        decode_batch=max(1, round(batch)),
        predicted_itl_s=step,
        hit_rate=workload.hit_rate,
        arrival_scv=workload.arrival_scv,
    )


def shared_tier_bytes_for_retention(rate: float, retention_s: float, mean_input_tokens: float, hit_rate: float,
                                    bytes_per_token: int) -> float:
    """Bytes the shared tier needs to keep ``retention_s`` of new context: only the tokens
    not already stored (the misses) add to what it holds."""
    if retention_s <= 0:
        raise ConfigError("retention must be positive seconds (e.g. --retention-s 3600)")
    return rate * retention_s * mean_input_tokens * (1.0 - hit_rate) * bytes_per_token


def shared_tier_bytes_for_hit_rate(curve: Sequence, hit_rate: float, block_bytes: int) -> float:
    """Bytes of the smallest shared tier on an LRU ``curve`` (``hit_rate_curve``'s points, in
    ascending capacity, the last one unbounded) whose token hit rate reaches ``hit_rate`` (or
    the unbounded one, if that is lower). 0 when that rate is 0: a tier that is to hit nothing
    needs no bytes (the curve's first point reached 0 >= 0, and a trace with no reuse was
    given a shared tier of 0.2 % of its blocks)."""
    target = min(hit_rate, max((p.token_hit_rate for p in curve), default=0.0))
    if target <= 0:
        return 0.0
    # 0.999: the assumed rate is the unbounded replay's own figure; the last point equals it
    # up to float rounding of the same sums
    point = next(p for p in curve if p.token_hit_rate >= target * 0.999)
    return float(point.capacity_blocks * block_bytes)
