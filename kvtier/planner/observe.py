"""Observations for the live planner from a running deployment's Prometheus counters.

The router counts what the planner needs: requests routed, the prompt lengths it priced, and
the prompt and cached tokens the workers' usage reported (``kvtier_router_*_total``, summed
over workers). Between two scrapes ``Δt`` apart: rate = Δrequests / Δt; mean prompt =
Δrouted prompt tokens / Δrequests whose length the router knew (Δrequests − Δunknown-length
requests); hit rate = Δcached tokens / Δusage prompt tokens.

The router's own lengths come with every routed request; usage only with the answers that
carry it (a stream carries usage only when its client asks, which OpenAI clients do not by
default). A router that does not count its lengths (an older one), or an interval in which it
knew none (every request on the Responses API, say), falls back to usage: Δusage prompt
tokens / Δanswers whose usage the router read (a router without that counter: Δrequests).
An interval with requests but no prompt length either way says nothing of prompt lengths:
its observation carries the rate and no lengths, and the planner keeps the mix it measured
before (never 1-token prompts). One whose answers carried no usage measured no hit rate.
Counters that went backwards (a restarted router) restart the baseline instead of giving
negative rates. Figures no deployment can produce (a mean prompt over
:data:`MAX_MEAN_PROMPT_TOKENS`, by the router's lengths or by usage, whichever gives the
lengths; usage prompt tokens under one per answer counted; a request rate over
:data:`MAX_REQUEST_RATE`) are a garbled counter, not load: that interval gives no observation
either, as NaN and Inf do.

The observation carries a sample of at most :data:`SAMPLE_REQUESTS` prompt lengths (the
interval's mean, repeated: the router counts sums, not lengths), and beside it what the sample
stands for: the interval's requests and the prompt tokens its hit rate is over, so that the
planner pools intervals by their traffic, not by their capped samples.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from kvtier.planner.live import Observation

ROUTED_PROMPT_TOKENS = "kvtier_router_routed_prompt_tokens_total"
UNKNOWN_LENGTH = "kvtier_router_routed_unknown_length_requests_total"
#: no model serves a context near 100M tokens: a mean prompt above it is a garbled counter (a
#: router exporting ``1e300``), and sizing on it overflowed the cost model and ended the planner;
#: a usage mean above it, beside sane router lengths, weighed its ~0 hit rate by 1e300 tokens in
#: the pooled hit rate (as if nothing were cached for the next few intervals)
MAX_MEAN_PROMPT_TOKENS = 1e8
#: no router routes a million requests a second (one ``kvtier route`` handles thousands): a rate
#: above it is a garbled requests counter (``1e300``), whose mean prompt came out under one token
#: and whose rate scaled both pools to the sizing's bound
MAX_REQUEST_RATE = 1e6
#: prompt lengths an observation carries: the queue model's cost is linear in them
SAMPLE_REQUESTS = 64


class RouterCounters(NamedTuple):
    at_s: float
    requests: float
    prompt_tokens: float          # usage.prompt_tokens of the answers that carried usage
    cached_tokens: float
    usage_answers: float = 0.0    # answers whose usage prompt_tokens sums over (0: a router without it)
    # the lengths the router priced, and the requests whose length it did not know: None where it
    # exports neither (an older router, or no request routed yet: 0 then, as its other counters)
    routed_prompt_tokens: float | None = None
    unknown_length: float | None = None

    @classmethod
    def from_samples(cls, at_s: float, samples) -> "RouterCounters":
        counts = any(name in (ROUTED_PROMPT_TOKENS, UNKNOWN_LENGTH) for name, _ in samples.values)
        return cls(at_s, samples.get("kvtier_router_requests_total"), samples.get("kvtier_router_prompt_tokens_total"),
                   samples.get("kvtier_router_actual_cached_tokens_total"),
                   samples.get("kvtier_router_usage_answers_total"),
                   samples.get(ROUTED_PROMPT_TOKENS) if counts else None,
                   samples.get(UNKNOWN_LENGTH) if counts else None)


def _routed_mean(before: RouterCounters, after: RouterCounters, requests: float) -> float | None:
    """The interval's mean prompt from the lengths the router priced; None where it counts none
    (an older router) or knew none in the interval. NaN when its counters went back (a reset).
    A baseline without them is 0: the router had routed nothing (both are set at a worker's
    first routed request)."""
    if after.routed_prompt_tokens is None or after.unknown_length is None:
        return None
    tokens = after.routed_prompt_tokens - (before.routed_prompt_tokens or 0.0)
    unknown = after.unknown_length - (before.unknown_length or 0.0)
    if not (math.isfinite(tokens) and math.isfinite(unknown)) or tokens < 0 or unknown < 0:
        return math.nan
    known = requests - unknown
    return tokens / known if known > 0 else None


def _usage_mean(before: RouterCounters, after: RouterCounters, requests: float, prompt: float) -> float | None:
    """The interval's mean prompt by its answers' usage: Δusage prompt tokens over Δanswers whose
    usage the router read (a router that does not count them: over Δrequests). None where no
    usage prompt tokens came; NaN where they came in under one token an answer, which no answer
    reports (its usage counts the prompt's tokens, one at least): a garbled answers counter, whose
    mean came out as 1-token prompts."""
    if prompt <= 0:
        return None
    answers = after.usage_answers - before.usage_answers
    if not (math.isfinite(answers) and answers > 0):
        return prompt / requests  # a router that does not count them: prompt tokens moved, so usage came
    return prompt / answers if prompt >= answers else math.nan


def observation_between(before: RouterCounters, after: RouterCounters, output_tokens: int) -> Observation | None:
    """The interval's observation, or None when there is no interval (first scrape, a reset)."""
    dt = after.at_s - before.at_s
    requests = after.requests - before.requests
    prompt = after.prompt_tokens - before.prompt_tokens
    cached = after.cached_tokens - before.cached_tokens
    if not all(math.isfinite(x) for x in (dt, requests, prompt, cached)):
        return None   # a router exporting NaN or Inf: no figure to size on, like a reset
    if dt <= 0 or requests < 0 or prompt < 0 or cached < 0:
        return None
    routed = _routed_mean(before, after, requests)
    if routed is not None and math.isnan(routed):
        return None
    if requests == 0:
        return Observation(after.at_s, 0.0, (), (), 0.0)
    rate = requests / dt
    if not rate <= MAX_REQUEST_RATE:
        return None   # a garbled counter (or finite counters over a tiny interval): no measurement
    usage = _usage_mean(before, after, requests, prompt)
    if usage is not None and not usage <= MAX_MEAN_PROMPT_TOKENS:
        # a garbled usage counter, whichever source gives the lengths: the hit rate is over the
        # usage prompt tokens, and they are its weight in the planner's pooled hit rate
        return None
    hit = min(max(cached / prompt, 0.0), 1.0) if prompt > 0 else 0.0
    mean = routed if routed is not None else usage
    if mean is None:   # no length known either way: the prompt lengths are unknown, not 0 (nor 1) tokens
        return Observation(after.at_s, rate, (), (), 0.0, hit_measured=False)
    if mean > MAX_MEAN_PROMPT_TOKENS:
        return None   # a garbled counter, not load: nothing to size on, as after a reset
    count = min(int(requests), SAMPLE_REQUESTS)
    return Observation(after.at_s, rate, (max(1, round(mean)),) * count, (output_tokens,) * count, hit,
                       hit_measured=prompt > 0, requests=requests, prompt_tokens=prompt)


# --- the workers' own metrics (vLLM's /metrics) ----------------------------------------------
#
# What the router cannot see: requests queued inside an engine, its KV cache fill, and the
# TTFT the engine measured. The planner reports them beside its decision (its reasons, its
# /metrics, ``kvtier top``) so that an operator can check the queue model against what the
# workers say; the sizing itself stays on the router's counters (one source for the rate).

TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"
ITL_HISTOGRAM = "vllm:inter_token_latency_seconds"


class FleetLoad(NamedTuple):
    workers: int                   # workers whose /metrics answered
    running: float                 # requests running in the engines
    waiting: float                 # requests queued in the engines
    kv_usage_max: float | None     # the fullest worker's KV cache, fraction
    ttft_s: float | None           # TTFT at the planner's percentile over the interval (vLLM's histogram)
    itl_s: float | None            # inter-token latency, same percentile


def _finite(samples, name: str) -> list[float]:
    """The finite values of ``name``'s series: a NaN (a 0/0 while an engine restarts) or an
    infinity is no measurement, and it would poison a sum or a ``max`` over the fleet."""
    return [v for (n, _), v in samples.values.items() if n == name and math.isfinite(v)]


def _buckets(samples, name: str) -> dict[float, float]:
    """Cumulative bucket counts of a histogram summed over its series: upper bound → count
    (a non-finite count skipped)."""
    out: dict[float, float] = {}
    for (n, labels), value in samples.values.items():
        if n == name + "_bucket" and math.isfinite(value):
            try:
                le = float(dict(labels).get("le", "inf").replace("+Inf", "inf"))
            except ValueError:   # not a bound: the series is not a histogram bucket after all
                continue
            out[le] = out.get(le, 0.0) + value
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear within the bucket the rank falls in; the
    largest finite bound when it falls in +Inf; None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            width = count - below
            return lower + (bound - lower) * ((rank - below) / width if width > 0 else 1.0)
        lower, below = bound, count
    return lower


def _restarted(cur: dict[float, float], prev: dict[float, float], now, before, name: str) -> bool:
    """Whether a worker's histogram ``name`` began again between two scrapes (an engine restart),
    judged on the whole histogram, as a counter reset is: a bucket or ``_count`` went down; the
    deltas are not cumulative (a restart whose new counts passed the old ones in every bucket,
    e.g. 0, 40, 40 → 50, 60, 60); or the process started at another time."""
    if any(cur.get(le, 0.0) < count for le, count in prev.items()):
        return True
    deltas = [cur[le] - prev.get(le, 0.0) for le in sorted(cur)]
    counts = _finite(now, name + "_count"), _finite(before, name + "_count")
    if counts[0] and counts[1]:
        if sum(counts[0]) < sum(counts[1]):
            return True
        deltas.append(sum(counts[0]) - sum(counts[1]))   # as many as the +Inf bucket's
    if any(low > high for low, high in zip(deltas, deltas[1:])):
        return True
    started = _finite(now, "process_start_time_seconds"), _finite(before, "process_start_time_seconds")
    return bool(started[0] and started[1]) and max(started[0]) != max(started[1])


def fleet_load(now: dict, before: dict | None, quantile: float) -> FleetLoad:
    """``now`` / ``before``: worker URL → scraped samples (``kvtier.cli.top.scrape``). Latencies
    are over the interval between the two (bucket deltas, for workers up in both scrapes), else
    since each worker started. A worker whose histogram began again (:func:`_restarted`) is read
    from its current counts, all of them, as Prometheus reads a counter reset: deltas taken
    bucket by bucket across a restart are not a histogram. Non-finite samples are skipped
    worker by worker; a worker's KV fill is its fullest series."""
    up = {url: s for url, s in now.items() if s.up}
    running = sum(sum(_finite(s, "vllm:num_requests_running")) for s in up.values())
    waiting = sum(sum(_finite(s, "vllm:num_requests_waiting")) for s in up.values())
    usage = [max(fills) for s in up.values()
             if (fills := _finite(s, "vllm:kv_cache_usage_perc") + _finite(s, "vllm:gpu_cache_usage_perc"))]

    def interval_quantile(name: str) -> float | None:
        total: dict[float, float] = {}
        for url, s in up.items():
            cur = _buckets(s, name)
            base = before.get(url) if before else None
            prev = _buckets(base, name) if base is not None and base.up else {}
            reset = bool(prev) and _restarted(cur, prev, s, base, name)
            for le, count in cur.items():
                total[le] = total.get(le, 0.0) + (count if reset else count - prev.get(le, 0.0))
        return histogram_quantile(quantile, total)

    return FleetLoad(len(up), running, waiting, max(usage) if usage else None,
                     interval_quantile(TTFT_HISTOGRAM), interval_quantile(ITL_HISTOGRAM))
