"""Bursts through two engines that prefill in shared steps, routed by kvtier's own policies.

Why this exists: ``kvtier simulate`` runs one request at a time per prefill worker (FIFO, no
shared steps), which is right for its disaggregated H100 cluster but not for the bench of
issue 14, where vLLM on CPU prefills its waiting queue in steps of at most 2,048 tokens and
answers every request of a step when the step ends. There a request also delays the others
it shares a step with. This model replays arrivals through such engines and asks the real
policy objects (``kvtier.policy.routing``) and the real queue bookkeeping
(``kvtier.router.workers.Worker``) where each request goes, so that a change of the policy
can be judged on many inputs (the trace window's requests, synthetic bursts) in seconds
instead of one noisy 7-minute vLLM run. It is an analysis model, not a benchmark: its engine
is a line (``step_s = c0 + tokens / speed + per_request x requests``), every prompt block is
loadable by every worker (a shared tier holds it, as in the bench), and the figures it prints
are ratios between policies under the same model.

    python scripts/route_burst_model.py                    # synthetic bursts, several seeds
    python scripts/route_burst_model.py --rows rows-tier-aware.json   # a bench round's requests
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import deque
from types import SimpleNamespace

from kvtier.policy.routing import LeastLoaded, RoundRobin, TierAware
from kvtier.router.workers import Worker


class _View:
    """The ClusterView the policies read: the router's queue bookkeeping on ``Worker`` objects;
    every block loadable everywhere, so a request's service is the same on every worker."""

    def __init__(self, workers, speed, overhead_s, step_tokens, decode_step_s):
        self.workers, self.num_workers = workers, len(workers)
        self.speed, self.overhead_s = speed, overhead_s
        self.step_tokens, self.decode_step_s = step_tokens, decode_step_s

    def outstanding_tokens(self, w):
        return self.workers[w].pending_tokens

    def backlog_s(self, w):
        worker = self.workers[w]
        return worker.pending_tokens / self.speed + (self.decode_step_s if worker.inflight else 0.0)

    def service_seconds(self, request):
        return [self.overhead_s + request.uncached / self.speed] * self.num_workers

    def step_sharing_delay_s(self, w, request):
        return self.workers[w].step_sharing_delay_s(request.uncached, self.step_tokens, self.speed)


def replay(requests, policy, *, step_tokens=2048, c0=0.02, speed=4000.0, per_request=0.0, price_steps=True,
           jitter=0.3, seed=0, workers=2):
    """TTFTs of ``requests`` (dicts: t, uncached, out) routed by ``policy``."""
    rng = random.Random(seed)
    book = [Worker(i, f"model://{i}") for i in range(workers)]
    waiting = [deque() for _ in range(workers)]       # [request, tokens left to prefill, ticket]
    running = [[] for _ in range(workers)]            # [request, decode steps left]
    step = [None] * workers                           # (end, prefilled items, decodes)
    ttft = []
    arrivals = deque(sorted(requests, key=lambda r: r["t"]))

    def start_step(w, now):
        budget = step_tokens
        decodes = running[w][:budget]
        budget -= len(decodes)
        items, tokens = [], 0
        for item in waiting[w]:
            if budget <= 0:
                break
            take = min(budget, item[1])
            item[1] -= take
            budget -= take
            tokens += take
            items.append(item)
        seconds = c0 + tokens / speed + per_request * len(items) + 0.0005 * len(decodes)
        step[w] = (now + seconds * (1 + jitter * rng.random()), items, decodes)

    while arrivals or any(step):
        next_end = min((s[0] for s in step if s), default=float("inf"))
        if arrivals and arrivals[0]["t"] <= next_end:
            r = arrivals.popleft()
            view = _View(book, speed, c0, step_tokens if price_steps else 0, c0)
            w = policy.choose(SimpleNamespace(input_tokens=r["uncached"], uncached=r["uncached"], blocks=[]), view)
            ticket = book[w].start(r["uncached"], 1)
            waiting[w].append([r, r["uncached"], ticket])
            if step[w] is None:
                start_step(w, r["t"])
            continue
        w = min(range(workers), key=lambda i: step[i][0] if step[i] else float("inf"))
        end, items, decodes = step[w]
        for item in items:
            if item[1] == 0:
                waiting[w].remove(item)
                r = item[0]
                ttft.append(end - r["t"])
                book[w].first_byte(r["uncached"], end - r["t"], others=1, ticket=item[2])
                if r["out"] > 1:
                    running[w].append([r, r["out"] - 1])
                else:
                    book[w].finish(r["uncached"], 1, True)
        for d in decodes:
            d[1] -= 1
            if d[1] == 0:
                running[w].remove(d)
                book[w].finish(d[0]["uncached"], 1, True)
        step[w] = None
        if waiting[w] or running[w]:
            start_step(w, end)
    return ttft


def quantile(values, q):
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def synthetic(seed, n=64, bursts=6, gap_s=3.0):
    """Bursts of requests sent together (as the trace's 3-second timestamps make them), uncached
    tokens log-normal (median ~330, a long tail to 4000), 32 output tokens."""
    rng = random.Random(seed)
    return [{"t": (i * bursts // n) * gap_s + i * 1e-4,
             "uncached": min(4000, int(rng.lognormvariate(5.8, 1.0)) + 2), "out": 32} for i in range(n)]


def from_rows(path):
    """A bench round's requests (``rows-POLICY.json`` of ``kvtier bench route --trace --workdir``):
    arrivals by their 3-s burst, uncached tokens as measured."""
    rows = json.loads(open(path).read())
    return [{"t": round(r["arrival_s"] / 3) * 3.0 + i * 1e-4,
             "uncached": max(2, r["prompt_tokens"] - r["cached_tokens"]), "out": r["output_tokens"]}
            for i, r in enumerate(rows)]


POLICIES = {
    "round-robin": lambda: (RoundRobin(), True),
    "least-loaded": lambda: (LeastLoaded(), True),
    "tier-aware, own TTFT only (before)": lambda: (TierAware(), False),
    "tier-aware, + step-sharing delay": lambda: (TierAware(), True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", action="append", default=[], help="a bench round's rows-POLICY.json (repeatable)")
    p.add_argument("--seeds", type=int, default=12, help="synthetic inputs (without --rows)")
    p.add_argument("--repeats", type=int, default=7, help="jittered replays per input (medians)")
    p.add_argument("--per-request", type=float, default=0.0, help="engine seconds per request in a step")
    p.add_argument("--speed", type=float, default=4000.0, help="prefill tokens/s of the engine model")
    args = p.parse_args()
    inputs = ([(path, from_rows(path)) for path in args.rows]
              or [(f"synthetic {s}", synthetic(s)) for s in range(args.seeds)])
    ratios = {name: [] for name in POLICIES}
    for label, requests in inputs:
        figures = {}
        for name, make in POLICIES.items():
            runs = []
            for seed in range(args.repeats):
                policy, price_steps = make()
                t = replay(requests, policy, price_steps=price_steps, per_request=args.per_request, speed=args.speed,
                           seed=seed)
                runs.append((quantile(t, 0.5), quantile(t, 0.9)))
            figures[name] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
        base = figures["least-loaded"]
        for name, (p50, p90) in figures.items():
            ratios[name].append((p50 / base[0], p90 / base[1]))
        print(label + ": " + "; ".join(f"{n} {a:.3f}/{b:.3f}" for n, (a, b) in figures.items()))
    print("median over inputs, TTFT p50 / p90 as a ratio to least-loaded's:")
    for name, values in ratios.items():
        p50, p90 = statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)
        print(f"  {name:38s} p50 {p50:.3f}   p90 {p90:.3f}"
              f"   (p50 lower on {sum(v[0] < 0.999 for v in values)}/{len(values)} inputs)")


if __name__ == "__main__":
    main()
