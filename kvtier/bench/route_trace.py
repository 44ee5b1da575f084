"""``kvtier bench route --trace FILE``: a window of a Mooncake trace through ``kvtier route`` and two vLLM workers.

The window and its prompts are :mod:`kvtier.bench.vllm_trace`'s: a contiguous stretch
of the trace (each hash id → ``HASH_TOKENS`` tokens from a generator seeded by the id,
so equal ids give equal token blocks; ``--trace-block-tokens``: the trace's tokens per id), its first ``--warmup-requests`` sent through the
router first to fill the caches (a few at a time, not measured), then the counted
``--requests`` at their arrival times compressed to a span (``--span-s``; by default one that
loads the workers a fixed share, measured in the run: :func:`auto_span`). Every request is
streamed, with ``stream_options.include_usage`` so the last chunk carries
``usage.prompt_tokens_details.cached_tokens``.

Deployments, all in one run:

* **kvtier** — one ``kvtier serve`` and two workers with the kvtier connector (host
  tier + the shared server, written through), behind one ``kvtier route`` per policy
  (``--shared-writes``: the router counts every block a worker computes as loadable by
  every worker).
* **baseline** — the same two workers without the connector (vLLM's own prefix cache
  only, today's deployment) behind a round-robin ``kvtier route`` that sends every request
  at once (``--admission-tokens 0``: a plain proxy). ``--admission-tokens N`` gives the
  kvtier rounds' routers admission (:mod:`kvtier.router.admission`, off by default as in
  ``kvtier route``); ``--baseline-admission`` replays the baseline once more with it on, so a
  reader can tell the router's scheduling from the tiers.

vLLM's KV cache holds ``--kv-fraction`` of the stretch's working set, so that vLLM alone
must evict (as in ``bench vllm --trace``).

No policy round may profit from an earlier one's cache. The cheapest correct isolation:
each round sends its own ``cache_salt`` (vLLM folds it into the first block's hash, and
the kvtier connector keys its host and server tiers on vLLM's block hashes, so an earlier
round's blocks are misses everywhere and only age out under LRU), its GPU prefix caches
are also emptied first (``POST /reset_prefix_cache``, vLLM's dev-mode endpoint: the
stale pages would otherwise only crowd the cache), and each round has a router of its
own, started after the reset, so its index holds nothing of earlier rounds (the router
keys blocks on token ids, which are the same in every round). Restarting the workers
per round would cost ~1 min each on this machine and isolate nothing more.

Fair among the policies: the salts make every round's blocks misses, but the tiers they
land in are not in the same state for every round: the first round found each worker's
host tier (1.5 rounds of blocks) and the server (3 rounds) empty, later rounds found them
full of older rounds' blocks and paid the evictions on the workers' cores; the engines
also had done less work before the first round. So (1) one uncounted **priming** replay
of the warm-up (its own salt, round-robin) runs before the first policy round, and (2) the
rounds run in a **shuffled order** (``--order-seed``; the JSON says which), so that over
the ≥ 3 runs a figure is the median of, no policy keeps the first or the last slot; and (3)
the shared tier holds every round the run replays (:func:`shared_tier_mib`): with room for
three, the fourth policy round (the server evicting since the round before) was the slowest of
its run in 3 runs of 3 on an agent trace, whichever policy held that slot.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import shutil
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from kvtier.bench.vllm_trace import (
    HASH_TOKENS,
    WARMUP_REQUESTS,
    add_trace_block_tokens,
    against_bound,
    reusable_tokens,
    synthesise,
    trace_model_spec,
    trace_window,
    warmup_replay,
    window_facts,
)
from kvtier.core.units import finite_float
from kvtier.planner.observe import histogram_quantile as observed_quantile
from kvtier.router.config import measured_bandwidth

WORKERS = 2
#: the default span loads the two workers this much: the window's non-reusable tokens (what even
#: a deployment that hits every reusable token computes) at the workers' prefill speed measured in
#: the same run, over the span. The fixed 15 s it replaces loaded them by the size of a trace's
#: requests and by the machine: 4 % busy on an agent trace of short requests (every round's TTFT
#: the same 0.03 s of fixed costs: the comparison said nothing), and on the Mooncake conversation
#: trace ~0.35 on the Intel VM where 15 s was chosen "to make vLLM queue and evict, as on a busy
#: deployment" (its workers prefilled 3,700-4,500 tokens/s each), but 0.28 on an AMD VM 1.2-1.3x
#: faster. 0.35 keeps the load 15 s was chosen for, on every machine and trace. (TTFT is this
#: bench's figure: a busy deployment, not a saturated one.)
BUSY_SHARE = 0.35
#: the kvtier deployment's rounds, in the order run
POLICIES = ("round-robin", "least-loaded", "prefix", "approximate", "tier-aware")
TOKEN = "kvtier-bench-route-token"


def add_arguments(p) -> None:
    """``--trace``'s flags, added with ``p.add_argument``: the parser, or the
    :class:`~kvtier.bench.route.ModeFlags` that makes ``--synthetic`` refuse them."""
    add_trace_block_tokens(p)
    p.add_argument("--model", default="mid", choices=["tiny", "mid", "demo"],
                   help="--trace: random Llama (tiny: hidden 128 / 2 layers; mid: 512 / 4; demo: 1024 / 8)")
    p.add_argument("--requests", type=int, default=64, help="--trace: requests of the counted window")
    p.add_argument("--warmup-requests", type=int, default=WARMUP_REQUESTS,
                   help=f"--trace: requests before the window that fill the caches, not counted (default {WARMUP_REQUESTS})")
    p.add_argument("--start", type=int, default=0, help="--trace: the window's first request in the trace")
    p.add_argument("--full-warmup", action="store_true",
                   help="--trace: replay every warm-up request whole (default: the exact shortcut of "
                        "kvtier.bench.vllm_trace.warmup_replay)")
    # Defaults that put the two workers under load: spread too thin, they keep up, nothing
    # queues, and TTFT is mostly fixed overheads, so a cache's saving hardly shows; the auto
    # span (BUSY_SHARE) and a KV cache of a tenth of the working set (at least one longest
    # request) make vLLM queue and evict, as on a busy deployment.
    p.add_argument("--span-s", type=finite_float, default=None,
                   help=f"--trace: arrivals compressed to this span (default: auto, the span over which the "
                        f"window's non-reusable tokens keep the two workers {BUSY_SHARE * 100:.0f}%% busy "  # %%: argparse
                        f"at the prefill speed their warm-up showed)")
    p.add_argument("--kv-fraction", type=finite_float, default=0.1,
                   help="--trace: each worker's vLLM KV cache as a share of the stretch's working set")
    p.add_argument("--policies", default=",".join(POLICIES), help="--trace: comma-separated policies")
    p.add_argument("--order-seed", type=int, default=None,
                   help="--trace: seed of the rounds' shuffled order (default: a fresh one, in the JSON)")
    p.add_argument("--no-priming", action="store_true",
                   help="--trace: skip the uncounted priming replay before the first round")
    p.add_argument("--router-log-level", default="info", choices=["debug", "info"],
                   help="--trace: debug: each router logs every decision's per-worker costs (in --workdir)")
    p.add_argument("--admission-tokens", type=int, default=0,
                   help="--trace: the kvtier rounds' routers hold a worker's requests beyond this many predicted "
                        "prefill tokens (kvtier route --admission-tokens; default 0: off, as kvtier route)")
    p.add_argument("--baseline-admission", action="store_true",
                   help="--trace: also replay the baseline behind a round-robin router with admission "
                        "(--admission-tokens, 2048 if 0), reported as baseline_admission: how much of a gain "
                        "is the router's scheduling rather than the tiers (the targets use the plain baseline)")
    p.add_argument("--workdir", default=None,
                   help="--trace: keep logs and each round's per-request rows (rows-POLICY.json) here "
                        "(default: a temporary folder, removed)")


def round_order(policies: list[str], seed: int) -> list[str]:
    """The order the policy rounds run in: a permutation drawn from ``seed`` (the same seed,
    the same order), so that no policy always runs first (fresher tiers and engines) or last."""
    order = list(policies)
    random.Random(seed).shuffle(order)
    return order


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def paired_difference(a: list[float], b: list[float], q: float, *, resamples: int = 4000,
                      seed: int = 0) -> dict:
    """``a``'s ``q`` quantile less ``b``'s, where ``a[i]`` and ``b[i]`` are the same request in
    two rounds, with a 95 % interval from resampling the requests (the same draw for both
    rounds, so that what a request costs in itself cancels). Rounds of 64 requests on a shared
    2-core machine moved their p50 by 0.1 s from run to run: two rounds' quantiles alone
    cannot say which policy is lower; ``resolved`` says whether the interval does
    (``lower`` / ``higher``: it excludes 0; ``no``: it holds 0)."""
    import numpy as np

    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.size == 0:
        raise ValueError(f"paired_difference: {x.size} against {y.size} requests")
    draws = np.random.default_rng(seed).integers(0, x.size, size=(resamples, x.size))
    diffs = np.quantile(x[draws], q, axis=1) - np.quantile(y[draws], q, axis=1)
    lo, hi = np.quantile(diffs, [0.025, 0.975])
    return {"diff_s": round(float(np.quantile(x, q) - np.quantile(y, q)), 4),
            "ci95_s": [round(float(lo), 4), round(float(hi), 4)],
            "resolved": "lower" if hi < 0 else "higher" if lo > 0 else "no"}


def tier_aware_paired(ttfts: dict[str, list[float]]) -> dict:
    """Tier-aware's TTFT p50 and p90 less every other round's (:func:`paired_difference`)."""
    ta = ttfts.get("tier-aware")
    if not ta:
        return {}
    return {name: {"p50": paired_difference(ta, other, 0.5), "p90": paired_difference(ta, other, 0.9)}
            for name, other in ttfts.items() if name != "tier-aware" and len(other) == len(ta)}


def _bucket_counts(metrics_text: str, name: str) -> dict[float, float]:
    """Cumulative counts (upper edge -> count) of one unlabelled histogram's buckets."""
    return {float(m.group(1)): float(m.group(2))
            for m in re.finditer(rf'^{name}_bucket{{le="([^"]+)"}} ([0-9.e+-]+)$', metrics_text, re.M)}


def histogram_quantile(metrics_text: str, name: str, q: float, since: str = "") -> float | None:
    """Prometheus ``histogram_quantile`` over one unlabelled histogram: linear within the
    bucket that holds the ``q`` quantile (so the figure is as fine as the buckets).
    ``since``: an earlier scrape of the same histogram; only the observations made after it
    count (its bucket counts are subtracted, as ``bench remote``'s quota stress does)."""
    earlier = _bucket_counts(since, name)
    return observed_quantile(q, {edge: count - earlier.get(edge, 0.0)
                                 for edge, count in _bucket_counts(metrics_text, name).items()})


def server_timing(header: str) -> dict[str, float]:
    """``{name: seconds}`` of a W3C ``Server-Timing`` header (``name;dur=MS, …``)."""
    out = {}
    for part in header.split(","):
        name, *params = [p.strip() for p in part.split(";")]
        for param in params:
            key, _, value = param.partition("=")
            if key == "dur" and name:
                try:
                    out[name] = float(value) / 1e3
                except ValueError:
                    pass
    return out


VLLM_HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
                   "prefill": "vllm:request_prefill_time_seconds", "decode": "vllm:request_decode_time_seconds"}


def vllm_sums(metrics_text: str) -> dict[str, tuple[float, float]]:
    """``{part: (sum, count)}`` of vLLM's per-request histograms (summed over label sets)."""
    out = {}
    for part, name in VLLM_HISTOGRAMS.items():
        total = count = 0.0
        for m in re.finditer(rf'^{re.escape(name)}_(sum|count)(?:{{[^}}]*}})? ([0-9.e+-]+)$', metrics_text, re.M):
            if m.group(1) == "sum":
                total += float(m.group(2))
            else:
                count += float(m.group(2))
        out[part] = (total, count)
    return out


def worker_side(before: list[dict], after: list[dict]) -> dict:
    """Mean seconds per request of the counted phase as the workers' vLLM measured them:
    TTFT (from the engine's arrival, no HTTP), queue (waiting to be scheduled) and prefill
    (scheduled to first token), over both workers."""
    out = {}
    for part in VLLM_HISTOGRAMS:
        total = sum(a[part][0] - b[part][0] for a, b in zip(after, before))
        count = sum(a[part][1] - b[part][1] for a, b in zip(after, before))
        out[f"{part}_mean_s"] = round(total / count, 4) if count else None
    return out


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def reset_prefix_cache(worker_url: str) -> bool:
    """vLLM's dev-mode ``POST /reset_prefix_cache``; False where it is refused or absent."""
    req = urllib.request.Request(worker_url + "/reset_prefix_cache", data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status == 200
    except OSError:
        return False


async def _one(session, url: str, model: str, r: dict, salt: str, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + r["arrival_s"] - time.monotonic()))
    body = {"model": model, "prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
    sent = time.monotonic()
    first = None
    usage = None
    worker = None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"request answered {resp.status}: {(await resp.text())[:300]}")
        worker = resp.headers.get("X-Kvtier-Worker")
        predicted = resp.headers.get("X-Kvtier-Predicted-Cached")
        timing = server_timing(resp.headers.get("Server-Timing", ""))
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            if first is None:
                first = time.monotonic()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
    if usage is None or first is None:
        raise RuntimeError("a streamed answer without tokens or usage")
    details = usage.get("prompt_tokens_details") or {}
    return {"arrival_s": sent - t0, "ttft_s": first - sent, "finish_s": time.monotonic() - t0,
            "output_tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": details.get("cached_tokens") or 0, "worker": worker,
            # what the router expected that worker to have cached (None: a router without the header)
            "predicted_cached_tokens": int(predicted) if predicted is not None else None,
            # the router's own time before forwarding, and the worker's time to first byte as
            # the router saw it (None from a router that does not send Server-Timing)
            "router_s": timing.get("router"), "upstream_s": timing.get("upstream"),
            # the time it waited in the router for its worker's queue (kvtier.router.admission)
            "held_s": timing.get("held")}


def shared_tier_mib(round_mib: float, rounds: int) -> int:
    """The kvtier server's capacity: every round the run replays (the priming one and each policy's,
    each under its own salt) and one more, so that no round pays the shared tier's evictions. With
    room for three rounds, the fourth policy round on an agent trace's window was the slowest of its run
    (TTFT p50 2-4x the others') and hit fewer tokens (0.690-0.698 of its prompts against 0.704),
    in three runs of three, whichever policy held that slot; with room for all, that slot was like
    the others. The cause was the server's: it capped a tenant's uploads in flight at a count of
    ``max_block`` slots (2 here), refusing the workers' concurrent writes once evictions slowed
    each one (fixed in kvtier/server/service.py). Room for every round still keeps the rounds'
    conditions equal: no round pays evictions the others do not."""
    return max(128, math.ceil(round_mib * (rounds + 1)))


def auto_span(nonreusable_tokens: int, prefill_tokens_per_s: float) -> float:
    """The default span: the one over which ``nonreusable_tokens`` at ``prefill_tokens_per_s``
    (both workers together) keep the workers ``BUSY_SHARE`` busy."""
    if prefill_tokens_per_s <= 0:
        raise ValueError("the warm-up computed no token: no prefill speed to size the span by")
    return max(0.01, round(nonreusable_tokens / (BUSY_SHARE * prefill_tokens_per_s), 2))


def replay_prefill_speed(rows: list[dict], seconds: float) -> float:
    """Prompt tokens the workers computed per second, together, in a warm-up replay (sent a few
    at a time: the workers kept busy, decoding little)."""
    return sum(r["prompt_tokens"] - r["cached_tokens"] for r in rows) / seconds


def at_span(requests: list[dict], span_s: float) -> list[dict]:
    """``requests`` with arrivals over a span of 1 spread over ``span_s``."""
    return [{**r, "arrival_s": r["arrival_s"] * span_s} for r in requests]


async def _replay(url: str, model: str, requests: list[dict], salt: str, at_once: int | None = None) -> list[dict]:
    """Every request at its arrival time; ``at_once``: instead, in order, that many in flight
    (the warm-up: as fast as the workers take it, the router still deciding on a live load)."""
    from aiohttp import ClientSession, ClientTimeout, TCPConnector

    async with ClientSession(timeout=ClientTimeout(total=1800), connector=TCPConnector(limit=at_once or 0)) as session:
        t0 = time.monotonic() + 0.2
        if at_once:
            requests = [{**r, "arrival_s": 0.0} for r in requests]
        return await asyncio.gather(*(_one(session, url, model, r, salt, t0) for r in requests))


def summarise(rows: list[dict], metrics_text: str, bound: list[int] | None = None,
              metrics_before: str = "") -> dict:
    """One round's figures; ``decision_p99_ms`` from the router's own histogram, over the
    decisions made after ``metrics_before`` (the router's scrape before the counted requests:
    the warm-up goes through the same router and is not measured)."""
    ttfts = [r["ttft_s"] for r in rows]
    timed = [r for r in rows if r.get("upstream_s") is not None]
    makespan = max(r["finish_s"] for r in rows) - min(r["arrival_s"] for r in rows)
    p99 = histogram_quantile(metrics_text, "kvtier_router_decision_seconds", 0.99, since=metrics_before)
    per_worker: dict[str, int] = {}
    for r in rows:
        per_worker[r["worker"]] = per_worker.get(r["worker"], 0) + 1
    return {
        "requests": len(rows),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 3),
        "ttft_p90_s": round(percentile(ttfts, 0.9), 3),
        "output_tokens_per_s": round(sum(r["output_tokens"] for r in rows) / makespan, 2),
        "cached_token_ratio": round(sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows), 4),
        # what the router expected the chosen workers to find, on the same scale (None: no header)
        "predicted_cached_ratio": (round(sum(r["predicted_cached_tokens"] for r in rows)
                                         / sum(r["prompt_tokens"] for r in rows), 4)
                                   if all(r.get("predicted_cached_tokens") is not None for r in rows) else None),
        "decision_p99_ms": round(p99 * 1e3, 3) if p99 is not None else None,
        "makespan_s": round(makespan, 2),
        "requests_per_worker": sorted(per_worker.values(), reverse=True),
        **({"cached_vs_reusable": against_bound([r["cached_tokens"] for r in rows], bound)} if bound else {}),
        **({"ttft_parts_p50_ms": {
            # client TTFT = router's own time + held in the router + the worker's first byte + relay and HTTP
            "router": round(percentile([r["router_s"] for r in timed], 0.5) * 1e3, 2),
            "held": round(percentile([r.get("held_s") or 0.0 for r in timed], 0.5) * 1e3, 2),
            "held_p90": round(percentile([r.get("held_s") or 0.0 for r in timed], 0.9) * 1e3, 2),
            "upstream": round(percentile([r["upstream_s"] for r in timed], 0.5) * 1e3, 2),
            "client_minus_upstream": round(percentile([r["ttft_s"] - r["upstream_s"] - (r.get("held_s") or 0.0)
                                                       for r in timed], 0.5) * 1e3, 2),
        }} if timed else {}),
    }


def _round(model: str, workers: list, phases: dict, policy: str, workdir: Path, *, events: bool,
           salt: str, span, measured: list[str] = (), keep_rows: Path | None = None, log_level: str = "info",
           router_args: tuple = (), ttfts: list[float] | None = None) -> dict:
    """One round; ``ttfts``, if given, gets each counted request's TTFT in request order.
    ``span``: the counted arrivals' span, or ``span(warm-up rows, seconds)`` that sizes it from
    this round's warm-up (the first round's, when no priming replay measured it)."""
    from kvtier.bench.route_stack import events_connected, start_router

    reset = all(reset_prefix_cache(w.url) for w in workers)
    extra = ["--shared-writes", *measured] if events else []
    extra += ["--log-level", log_level, *router_args]
    router = start_router(model, workers, workdir / f"router-{salt}.log", policy=policy, events=events,
                          extra_args=["--block-tokens", str(HASH_TOKENS), *extra])
    try:
        if events and not events_connected(router, len(workers)):
            raise RuntimeError(f"router {policy}: workers' KV events not connected\n{router.log_tail()}")
        t0 = time.monotonic()
        warm_rows = asyncio.run(_replay(router.url, model, phases["warmup"], salt, at_once=4))
        warm_s = time.monotonic() - t0
        if callable(span):
            span = span(warm_rows, warm_s)
        time.sleep(0.5)   # the warm-up's last KV events reach the router
        before = [vllm_sums(_get(w.url + "/metrics")) for w in workers]
        router_before = _get(router.url + "/metrics")
        rows = asyncio.run(_replay(router.url, model, at_span(phases["counted"], span), salt))
        out = summarise(rows, _get(router.url + "/metrics"), phases["bound"], router_before)
        out["worker_side"] = worker_side(before, [vllm_sums(_get(w.url + "/metrics")) for w in workers])
        if keep_rows is not None:
            keep_rows.write_text(json.dumps(rows))
        if ttfts is not None:
            ttfts.extend(r["ttft_s"] for r in rows)
        out["warmup_s"] = round(warm_s, 1)
        out["wall_s"] = round(time.monotonic() - t0, 1)
        out["prefix_cache_reset"] = reset
        return out
    finally:
        router.stop()


def _prime(model: str, workers: list, phases: dict, workdir: Path, salt: str) -> tuple[list[dict], float]:
    """The warm-up once through a round-robin router, not counted (see the module's "Fair
    among the policies"): the first policy round then finds the workers' host tiers and the
    server holding an earlier round's blocks, as every later round does. Its rows and seconds."""
    from kvtier.bench.route_stack import start_router

    router = start_router(model, workers, workdir / f"router-{salt}.log", policy="round-robin", events=False,
                          extra_args=["--block-tokens", str(HASH_TOKENS)])
    try:
        t0 = time.monotonic()
        rows = asyncio.run(_replay(router.url, model, phases["warmup"], salt, at_once=4))
        return rows, time.monotonic() - t0
    finally:
        router.stop()


def measure_shared_tier(workdir: Path, block_bytes: int) -> list[str]:
    """``kvtier bench remote`` on blocks of the connector's size (a few seconds): the routers
    price shared-tier loads with this bandwidth (``--measured``), not a default."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "remote", "--block-mib",
                          str(block_bytes / (1 << 20)), "--run-mib", "16", "--runs", "3", "--no-redis", "--json"],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"kvtier bench remote failed:\n{out.stderr[-2000:]}")
    path = workdir / "bench-remote.json"
    path.write_text(out.stdout)
    return ["--measured", str(path)]


def _warm(model: str, workers: list, vocab: int) -> None:
    """First-use costs (allocations, first forward) outside every round: one request per worker."""
    import random

    prompt = [random.Random(-1).randrange(16, vocab) for _ in range(4 * HASH_TOKENS)]
    for w in workers:
        req = urllib.request.Request(w.url + "/v1/completions", method="POST",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": model, "prompt": prompt, "max_tokens": 2,
                                                      "cache_salt": "warm-up"}).encode())
        with urllib.request.urlopen(req, timeout=600) as resp:
            resp.read()


def _deployment(model: str, workdir: Path, name: str, *, transfer: dict | None, max_len: int, kv_pages: int) -> list:
    from kvtier.bench.route_stack import start_worker, wait_ready

    workers = [start_worker(model, workdir / f"{name}-worker{i}.log", transfer=transfer, core=i % 2,
                            max_model_len=max_len, block_size=HASH_TOKENS,
                            extra_args=["--num-gpu-blocks-override", str(kv_pages)]) for i in range(WORKERS)]
    try:
        wait_ready(workers, timeout_s=600)
    except BaseException:
        _stop_all(workers)
        raise
    return workers


def _stop_all(workers: list) -> None:
    """Stop a deployment's workers side by side: each waits seconds for its engine's shutdown
    (about 8 s for a pair one after the other), and nothing is timed then."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, len(workers))) as pool:
        list(pool.map(lambda w: w.stop(), workers))


def run(args) -> dict:
    from kvtier.bench.route_stack import kvtier_transfer_config
    from kvtier.bench.vllm_systems import geometry
    from kvtier.integrations.transformers.models import ensure_model
    from kvtier.server.launch import ServerProcess

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown or not policies:
        raise SystemExit(f"--policies: unknown {unknown}; use some of {', '.join(POLICIES)}")
    started = time.monotonic()
    seed = args.order_seed if args.order_seed is not None else random.SystemRandom().randrange(1 << 16)
    order = round_order(policies, seed)
    # arrivals over a span of 1 here, spread over the span by each round (the auto span is
    # known only once a warm-up has shown the workers' prefill speed)
    window = trace_window(args.trace, args.requests, args.warmup_requests, 1.0, args.start, args.trace_block_tokens)
    warm, counted = window.warm, window.counted
    max_len = max(r["tokens"] + r["max_tokens"] for r in warm + counted) + HASH_TOKENS
    spec = trace_model_spec(args.model, max_len)
    model = str(ensure_model(spec)[0])
    geo = geometry(spec)
    unique_blocks = len({b for r in warm + counted for b in r["blocks"]})
    kv_pages = max(math.ceil(max_len / HASH_TOKENS) + 16, int(unique_blocks * args.kv_fraction))
    # The shortcut's tail must overflow every vLLM cache the warm-up spreads over (two
    # workers): with one worker's worth, the baseline kept warm-up blocks that the whole
    # stretch would have evicted (cached 0.22 against 0.04 for one engine).
    sent_warm = warmup_replay(warm, counted, WORKERS * kv_pages, args.full_warmup)
    phases = {"warmup": synthesise(sent_warm, spec.vocab_size), "counted": synthesise(counted, spec.vocab_size),
              "bound": reusable_tokens(counted, warm)}
    nonreusable = sum(len(r["prompt"]) - hit for r, hit in zip(phases["counted"], phases["bound"]))
    sent_blocks = len({b for r in sent_warm + counted for b in r["blocks"]})
    # Each worker's host tier holds everything sent (every round's, as the salts keep them
    # apart and LRU ages the old ones out first).
    round_mib = sent_blocks * HASH_TOKENS * geo["kv_bytes_per_token"] / (1 << 20)
    host_mib = max(64, math.ceil(round_mib * 1.5))
    server_mib = shared_tier_mib(round_mib, len(order) + (0 if args.no_priming else 1))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-bench-route-"))
    workdir.mkdir(parents=True, exist_ok=True)
    nonce = uuid.uuid4().hex[:8]
    result: dict = {
        "trace": str(args.trace),
        "window": f"requests {args.start}..{args.start + len(warm) + len(counted) - 1} of the trace, "
                  f"the first {len(warm)} as warm-up (not counted)",
        **window_facts(window, sent_warm, args.span_s, args.trace_block_tokens),   # span_s: the auto span once known
        "vllm_kv_pages_per_worker": kv_pages,
        "vllm_kv_share_of_working_set": round(kv_pages / unique_blocks, 3),
        "kvtier_host_mib_per_worker": host_mib,
        "kvtier_server_mib": server_mib,
        "model": {"preset": args.model, **geo},
        "isolation": "per-round cache_salt + POST /reset_prefix_cache + a fresh router per round",
        "admission_tokens": args.admission_tokens,   # kvtier rounds' routers (0: off); the baseline: off
        "round_order": order,
        "order_seed": seed,
        "priming": not args.no_priming,
        "baseline": None,
        "policies": {},
    }
    load = [os.getloadavg()[0]]
    ttfts: dict[str, list[float]] = {}   # each round's TTFT per counted request, in request order

    def sized(rows: list[dict], seconds: float, measured_in: str = "the first round's warm-up") -> float:
        """The auto span, from the first warm-up replay (every round then gets the same)."""
        speed = replay_prefill_speed(rows, seconds)
        result["auto_span"] = {"busy_share": BUSY_SHARE, "nonreusable_tokens": nonreusable,
                               "prefill_tokens_per_s": round(speed, 1), "measured_in": measured_in}
        result["span_s"] = auto_span(nonreusable, speed)
        return result["span_s"]

    def span():
        return result["span_s"] if result["span_s"] is not None else sized

    # The shared tier holds every round (shared_tier_mib). A server of ~2 GiB pages its arena
    # in before it answers: over 20 s (the launcher's default wait) on the shared 2-core
    # machine at load 7, so wait longer.
    server = ServerProcess.start({"bench": TOKEN}, server={"capacity": f"{server_mib}MiB",
                                                           "max_block": "8MiB"}, timeout_s=300.0)
    try:
        measured = measure_shared_tier(workdir, HASH_TOKENS * geo["kv_bytes_per_token"])
        result["shared_read_gbps_measured"] = measured_bandwidth(measured[1])[1] / 1e9
        transfer = kvtier_transfer_config(server.url, TOKEN, block_tokens=HASH_TOKENS, host_bytes=f"{host_mib}MiB")
        workers = _deployment(model, workdir, "kvtier", transfer=transfer, max_len=max_len, kv_pages=kv_pages)
        try:
            _warm(model, workers, spec.vocab_size)
            if not args.no_priming:
                rows, seconds = _prime(model, workers, phases, workdir, salt=f"prime-{nonce}")
                result["priming_s"] = round(seconds, 1)
                if result["span_s"] is None:
                    sized(rows, seconds, "the priming replay")
            for policy in order:
                result["policies"][policy] = _round(model, workers, phases, policy, workdir, events=True,
                                                    span=span(), measured=measured, salt=f"{policy}-{nonce}",
                                                    keep_rows=workdir / f"rows-{policy}.json" if args.workdir else None,
                                                    log_level=args.router_log_level,
                                                    router_args=("--admission-tokens", str(args.admission_tokens)),
                                                    ttfts=ttfts.setdefault(policy, []))
                load.append(os.getloadavg()[0])
        finally:
            _stop_all(workers)
    finally:
        server.stop()
    workers = _deployment(model, workdir, "baseline", transfer=None, max_len=max_len, kv_pages=kv_pages)
    try:
        _warm(model, workers, spec.vocab_size)
        # Today's deployment: a plain round-robin proxy that sends every request at once
        # (the router's admission off), as the baseline has always been run.
        result["baseline"] = _round(model, workers, phases, "round-robin", workdir, events=False,
                                    salt=f"baseline-{nonce}", span=span(),
                                    keep_rows=workdir / "rows-baseline.json" if args.workdir else None,
                                    router_args=("--admission-tokens", "0"), ttfts=ttfts.setdefault("baseline", []))
        load.append(os.getloadavg()[0])
        if args.baseline_admission:
            result["baseline_admission"] = _round(
                model, workers, phases, "round-robin", workdir, events=False, salt=f"baseline-admission-{nonce}",
                span=span(),
                keep_rows=workdir / "rows-baseline-admission.json" if args.workdir else None,
                router_args=("--admission-tokens", str(args.admission_tokens or 2048)),
                ttfts=ttfts.setdefault("baseline_admission", []))
            load.append(os.getloadavg()[0])
    finally:
        _stop_all(workers)
    result["targets"] = targets(result)
    # the same requests in every round: tier-aware's quantiles against each other round's,
    # request by request, say whether a difference is the policy's or the machine's noise
    result["tier_aware_paired"] = tier_aware_paired(ttfts)
    result["load_average_1m"] = {"min": round(min(load), 2), "max": round(max(load), 2)}
    result["cpus"] = os.cpu_count()
    result["wall_s"] = round(time.monotonic() - started, 1)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def targets(result: dict) -> dict:
    """The issue's targets, each met or not (None where a round is missing)."""
    base, ta = result.get("baseline"), result["policies"].get("tier-aware")
    if not base or not ta:
        return {}
    others = [v for k, v in result["policies"].items() if k != "tier-aware"]
    return {
        "ttft_p50_vs_baseline": round(ta["ttft_p50_s"] / base["ttft_p50_s"], 3) if base["ttft_p50_s"] else None,
        "ttft_p50_half_of_baseline": ta["ttft_p50_s"] <= 0.5 * base["ttft_p50_s"],
        "ttft_p50_best_policy": all(ta["ttft_p50_s"] <= o["ttft_p50_s"] for o in others),
        "ttft_p90_best_policy": all(ta["ttft_p90_s"] <= o["ttft_p90_s"] for o in others),
        "cached_vs_baseline": (round(ta["cached_token_ratio"] / base["cached_token_ratio"], 3)
                               if base["cached_token_ratio"] else None),
        "cached_1_5x_baseline": ta["cached_token_ratio"] >= 1.5 * base["cached_token_ratio"],
    }
