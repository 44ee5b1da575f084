"""Observations for the live planner from a running deployment's Prometheus counters.

The router counts what the planner needs: requests routed, prompt tokens and the tokens
the workers reported cached (``kvtier_router_*_total``, summed over workers). Between
two scrapes ``Δt`` apart: rate = Δrequests / Δt, mean prompt = Δprompt tokens / Δrequests,
hit rate = Δcached tokens / Δprompt tokens. Counters that went backwards (a restarted
router) restart the baseline instead of giving negative rates.
"""

from __future__ import annotations

from typing import NamedTuple

from kvtier.planner.live import Observation


class RouterCounters(NamedTuple):
    at_s: float
    requests: float
    prompt_tokens: float
    cached_tokens: float

    @classmethod
    def from_samples(cls, at_s: float, samples) -> "RouterCounters":
        return cls(at_s, samples.get("kvtier_router_requests_total"), samples.get("kvtier_router_prompt_tokens_total"),
                   samples.get("kvtier_router_actual_cached_tokens_total"))


def observation_between(before: RouterCounters, after: RouterCounters, output_tokens: int) -> Observation | None:
    """The interval's observation, or None when there is no interval (first scrape, a reset)."""
    dt = after.at_s - before.at_s
    requests = after.requests - before.requests
    prompt = after.prompt_tokens - before.prompt_tokens
    cached = after.cached_tokens - before.cached_tokens
    if dt <= 0 or requests < 0 or prompt < 0 or cached < 0:
        return None
    if requests == 0:
        return Observation(after.at_s, 0.0, (), (), 0.0)
    mean_prompt = max(1, round(prompt / requests))
    hit = min(max(cached / prompt, 0.0), 1.0) if prompt > 0 else 0.0
    count = min(int(requests), 64)
    return Observation(after.at_s, requests / dt, (mean_prompt,) * count, (output_tokens,) * count, hit)
