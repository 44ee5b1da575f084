"""What a simulation run measured, reduced to the figures operators ask for."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvtier.sim.simulator import SimResult


class PolicyReport(NamedTuple):
    policy: str
    requests: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    hit_rate: float                        # prompt blocks reused / prompt blocks
    hit_rate_by_tier: dict[str, float]     # share of all prompt blocks reused from each tier
    prefill_seconds_saved: float           # worker-seconds: recompute avoided minus load time
    prefill_seconds_total: float           # worker-seconds spent on prefill (loads + compute)
    prefill_tokens_per_s_per_worker: list[float]
    decode_tokens_per_s_per_worker: list[float]
    itl_p50_s: float
    itl_p99_s: float
    imbalance: float                       # max / mean prefill busy time across workers (1.0 = even)

    def to_json(self) -> dict:
        out = self._asdict()
        out.pop("policy")
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items()}


def summarize(result: SimResult) -> PolicyReport:
    outcomes = result.outcomes
    ttft = np.array([o.ttft_s for o in outcomes]) if outcomes else np.zeros(1)
    p50, p90, p99 = np.percentile(ttft, [50, 90, 99])
    by_tier = np.zeros(len(result.tier_names))
    saved = 0.0
    for o in outcomes:
        by_tier += o.plan.blocks_by_tier
        saved += o.recompute_s - o.plan.seconds
    total = max(result.total_blocks, 1)
    span = max(result.end_s - result.start_s, 1e-9)   # the simulated span, not the clock reading
    itl = np.array(result.decode_itl_s) if result.decode_itl_s else np.zeros(1)
    busy = np.array(result.busy_s_per_worker)
    return PolicyReport(
        policy=result.policy,
        requests=len(outcomes),
        ttft_p50_s=float(p50), ttft_p90_s=float(p90), ttft_p99_s=float(p99), ttft_mean_s=float(ttft.mean()),
        hit_rate=float(by_tier.sum() / total),
        hit_rate_by_tier={name: round(float(n / total), 6) for name, n in zip(result.tier_names, by_tier)},
        prefill_seconds_saved=saved,
        prefill_seconds_total=float(busy.sum()),
        prefill_tokens_per_s_per_worker=[round(t / span, 1) for t in result.computed_tokens_per_worker],
        decode_tokens_per_s_per_worker=[round(t / span, 1) for t in result.decode_tokens_per_worker],
        itl_p50_s=float(np.percentile(itl, 50)), itl_p99_s=float(np.percentile(itl, 99)),
        imbalance=float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
    )
