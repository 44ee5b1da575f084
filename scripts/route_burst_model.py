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
    python scripts/route_burst_model.py --bound rows-baseline.json rows-tier-aware.json   # what bounds p50
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import deque
from types import SimpleNamespace

from kvtier.policy.routing import LeastLoaded, RoundRobin, TierAware
from kvtier.router.admission import AdmissionQueue
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
           jitter=0.3, seed=0, workers=2, admission=0, release_lag_s=0.002):
    """TTFTs of ``requests`` (dicts: t, uncached, out) routed by ``policy``.

    ``admission``: the router's admission cap in tokens (:mod:`kvtier.router.admission`, the
    router's own queue code; 0: every request sent at once). A held request reaches its
    engine ``release_lag_s`` after the first byte that freed it, so it joins the step after
    the one that starts then (the engine does not wait for the router)."""
    rng = random.Random(seed)
    book = [Worker(i, f"model://{i}") for i in range(workers)]
    gates = [AdmissionQueue(admission) for _ in range(workers)]
    lagged = []                                       # (time, worker, [request, tokens, ticket]) on their way
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

    while arrivals or any(step) or lagged:
        next_end = min((s[0] for s in step if s), default=float("inf"))
        if lagged and lagged[0][0] <= next_end and (not arrivals or lagged[0][0] <= arrivals[0]["t"]):
            at, w, item = lagged.pop(0)
            waiting[w].append(item)
            if step[w] is None:
                start_step(w, at)
            continue
        if arrivals and arrivals[0]["t"] <= next_end:
            r = arrivals.popleft()
            view = _View(book, speed, c0, step_tokens if price_steps else 0, c0)
            w = policy.choose(SimpleNamespace(input_tokens=r["uncached"], uncached=r["uncached"], blocks=[]), view)
            ticket = book[w].start(r["uncached"], 1)
            item = [r, r["uncached"], ticket]
            if gates[w].offer(r["uncached"], r["t"] + c0 + r["uncached"] / speed, item):
                waiting[w].append(item)
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
                for sent in gates[w].done(r["uncached"]):
                    lagged.append((end + release_lag_s, w, sent))
                lagged.sort(key=lambda x: x[0])
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


#: name → (policy, whether it prices step sharing, the router's admission cap in tokens)
POLICIES = {
    "round-robin": lambda: (RoundRobin(), True, 0),
    "least-loaded": lambda: (LeastLoaded(), True, 0),
    "tier-aware, own TTFT only (before)": lambda: (TierAware(), False, 0),
    "tier-aware, + step-sharing delay": lambda: (TierAware(), True, 0),
    "round-robin + admission 2048": lambda: (RoundRobin(), True, 2048),
    "least-loaded + admission 2048": lambda: (LeastLoaded(), True, 2048),
    "tier-aware + admission 2048 (now)": lambda: (TierAware(), True, 2048),
}


def spt_order(requests):
    """The same requests, each burst (equal 3-s slot) re-sent shortest first: with least-loaded
    routing this is SPT list scheduling, the schedule that minimises the summed completion
    time on identical parallel machines, which no router that sends a burst as it arrives can
    beat on the median except by luck. An oracle: it needs a router that holds a burst and
    reorders it."""
    bursts = {}
    for r in requests:
        bursts.setdefault(round(r["t"] / 3.0), []).append(r)
    out = []
    for slot, members in bursts.items():
        for i, r in enumerate(sorted(members, key=lambda r: r["uncached"])):
            out.append({**r, "t": slot * 3.0 + i * 1e-4})
    return out


def bound(args) -> None:
    """What bounds the p50 ratio: for a baseline round's and a kvtier round's measured uncached
    tokens, the engine model's p50 under round-robin (the baseline's router), under each policy,
    under the SPT oracle, and with no queueing at all (every request alone on an idle worker)."""
    base, kv = from_rows(args.bound[0]), from_rows(args.bound[1])
    def p50(requests, make, order=lambda r: r):
        runs = []
        for seed in range(args.repeats):
            policy, price_steps, admission = make()
            runs.append(quantile(replay(order(requests), policy, price_steps=price_steps, c0=args.c0,
                                        per_request=args.per_request, speed=args.speed, seed=seed,
                                        admission=admission, release_lag_s=args.release_lag), 0.5))
        return statistics.median(runs)
    ref = p50(base, POLICIES["round-robin"])
    print(f"engine model: step {args.c0 * 1e3:.0f} ms + tokens / {args.speed:.0f} tok/s"
          f" + {args.per_request * 1e3:.0f} ms per request; uncached tokens: baseline {sum(r['uncached'] for r in base)},"
          f" kvtier {sum(r['uncached'] for r in kv)}")
    print(f"  baseline, round-robin                    p50 {ref:.3f} s")
    for name, make in POLICIES.items():
        print(f"  kvtier, {name:33s} p50 {p50(kv, make):.3f} s  ({p50(kv, make) / ref:.3f}x baseline)")
    for name in ("round-robin + admission 2048", "tier-aware + admission 2048 (now)"):
        print(f"  baseline tokens, {name:24s} p50 {p50(base, POLICIES[name]):.3f} s")
    spt = p50(kv, POLICIES["least-loaded"], spt_order)
    print(f"  kvtier, SPT oracle (burst held, shortest first) p50 {spt:.3f} s  ({spt / ref:.3f}x baseline)")
    alone = quantile([args.c0 + r["uncached"] / args.speed for r in kv], 0.5)
    print(f"  kvtier, no queueing at all (each alone)   p50 {alone:.3f} s  ({alone / ref:.3f}x baseline)")
    base_spt = p50(base, POLICIES["least-loaded"], spt_order)
    print(f"  baseline tokens, SPT oracle               p50 {base_spt:.3f} s  (kvtier SPT / baseline SPT {spt / base_spt:.3f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", action="append", default=[], help="a bench round's rows-POLICY.json (repeatable)")
    p.add_argument("--seeds", type=int, default=12, help="synthetic inputs (without --rows)")
    p.add_argument("--repeats", type=int, default=7, help="jittered replays per input (medians)")
    p.add_argument("--per-request", type=float, default=0.0, help="engine seconds per request in a step")
    p.add_argument("--speed", type=float, default=4000.0, help="prefill tokens/s of the engine model")
    p.add_argument("--c0", type=float, default=0.02, help="engine seconds per step (fixed part)")
    p.add_argument("--release-lag", type=float, default=0.002,
                   help="seconds from a first byte to the held request it frees reaching the engine")
    p.add_argument("--bound", nargs=2, metavar=("BASELINE_ROWS", "KVTIER_ROWS"),
                   help="what bounds the p50 ratio on a bench run's rows (see bound())")
    args = p.parse_args()
    if args.bound:
        return bound(args)
    inputs = ([(path, from_rows(path)) for path in args.rows]
              or [(f"synthetic {s}", synthetic(s)) for s in range(args.seeds)])
    ratios = {name: [] for name in POLICIES}
    for label, requests in inputs:
        figures = {}
        for name, make in POLICIES.items():
            runs = []
            for seed in range(args.repeats):
                policy, price_steps, admission = make()
                t = replay(requests, policy, price_steps=price_steps, c0=args.c0, per_request=args.per_request,
                           speed=args.speed, seed=seed, admission=admission, release_lag_s=args.release_lag)
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
