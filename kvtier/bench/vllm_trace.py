"""``kvtier bench vllm --trace FILE``: a window of a Mooncake-format trace replayed through vLLM.

The trace gives block identities, not text (:mod:`kvtier.sim.trace`): each hash id
becomes ``HASH_TOKENS`` tokens drawn from a generator seeded by the id, so that equal
ids give equal token blocks and a prompt is the concatenation of its blocks (the last
one cut to the request's length, scaled like its blocks; prompts cut at ``MAX_BLOCKS``).
A trace block is ``--trace-block-tokens`` tokens (Mooncake's 512 by default): any size
scales to one ``HASH_TOKENS`` page, lengths by the same ratio.

The window (:func:`trace_window`) is a contiguous stretch of the trace, not a sample:
``--warmup-requests`` requests that fill the caches and are not counted (replayed as
:func:`warmup_replay` says), then ``--requests`` counted ones whose arrival times are
compressed to ``--span-s`` (by default sized on the machine at hand, :func:`auto_span`) so
that every engine is loaded to the last arrival; a window whose counted requests share one
timestamp (a batch trace) is spread evenly over the span, as the JSON's ``arrivals`` says. Sampling conversations (what
this bench did first) keeps each conversation's reuse but shrinks the distance between
its turns, so that even a minimal vLLM cache hit every reusable token and no connector
could add any; in a contiguous stretch a conversation's next turn comes hundreds of
requests later, as in the trace.

Each system is one vLLM engine with its prefix cache on and a KV cache of
``--kv-fraction`` of the window's working set, so that vLLM alone must evict: vLLM
alone; vLLM + kvtier (host tier that holds the working set, a disk tier behind it);
vLLM + LMCache (its MP connector and an ``lmcache server`` with at least the same DRAM).
``reusable_token_ratio`` (:func:`reusable_token_ratio`) is exact: the share of the
window's prompt tokens an unbounded cache would hit, given everything before it in the
stretch, counted as vLLM counts ``cached_tokens`` (whole pages): the bound on the
``cached_token_ratio`` of vLLM alone and of kvtier, which count so. LMCache can pass it by under
a page a request, since it also stores and loads a prompt's last partial chunk. vLLM alone or
kvtier above it (:func:`above_bound`) is a bug: posted in ``warnings``, and the bench exits 1.
The systems run one after the other (an engine each; two at once would share the cores).
"""

from __future__ import annotations

import math
import random
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from kvtier.bench.vllm_systems import (
    LMCACHE_ENV,
    Unavailable,
    geometry,
    kvtier_extra,
    lmcache_server,
    lmcache_settings,
    model_spec,
    process_cpu_s,
)
from kvtier.core.units import finite_float

#: trace blocks are 512 tokens (Mooncake's; --trace-block-tokens for others); each becomes
#: HASH_TOKENS tokens (one vLLM page on CPU)
TRACE_BLOCK_TOKENS = 512
#: the loader's advice when a trace's hash ids do not fit the block size in use
TRACE_BLOCK_SIZE_HINT = "give the trace's block size with --trace-block-tokens"
HASH_TOKENS = 32
MAX_BLOCKS = 64  #: prompts cut to this many blocks, 2048 tokens (the trace reaches 240; median 14)
MAX_OUTPUT = 32  #: output lengths scaled like prompts, then capped
#: a conversation's next turn comes a median ~380 requests after its last on the Mooncake
#: conversation trace: the warm-up must reach that far back for the window to see its reuse
#: (the router bench's 64-request window keeps this 400)
WARMUP_REQUESTS = 400
#: this bench's history before its 256 counted requests. With 400, the window (requests
#: 400-655) was the least reusable of the trace's 29 windows of 256 (0.256 of its prompt
#: tokens, against a median of 0.384 over windows after 400, 800, ... 11,600 requests of
#: history and 0.374 for the whole trace by its README): a conversation service's first
#: minutes, before its conversations have earlier turns. 3,600 requests of history put the
#: window at the trace's median reuse (0.384); the warm-up shortcut sends only what the
#: window can hit, so the longer history costs ~40 % more warm-up, not 9x.
TRACE_WARMUP_REQUESTS = 3600
#: counted requests and the span their arrivals are compressed to. 64 over 5 s (until
#: 2026-12-03 15:00) made a 6-7 s replay whose drain after the last arrival (the last
#: requests decoding alone, ~40 one-token steps, the same for every system) was a third of
#: the engine time; 256 over 16 s (16 requests/s, more than any system here serves: all
#: engine-bound) leave that drain a few percent, as on a server that runs for hours.
TRACE_REQUESTS = 256
#: the auto span (the default) is the longest at which an engine that computes only the
#: window's non-reusable tokens, at the prefill speed vLLM alone's warm-up showed, would sit
#: idle for at most this share of its work before the last arrival: then every system's engine
#: stays busy to the end and output tokens/s measures what each serves, not the offered load.
#: (A fixed 16 s did that on one machine; on one 1.3x faster both vLLM alone and kvtier idled
#: 9-17 % of the window and the ratio between them fell toward 1.) Real engines are slower than
#: that ideal one (decode steps, attention over loaded context), which leaves a margin.
IDLE_SHARE = 0.02
KV_FRACTION = 0.25


def add_trace_block_tokens(p) -> None:
    """``--trace-block-tokens``, in both trace benches: the trace's block size, not the engines'
    page (a trace block becomes one ``HASH_TOKENS`` page whatever its size)."""
    p.add_argument("--trace-block-tokens", type=int, default=TRACE_BLOCK_TOKENS,
                   help=f"--trace: tokens per hash id of the trace (default {TRACE_BLOCK_TOKENS}, Mooncake's); each "
                        f"becomes one {HASH_TOKENS}-token page, lengths scaled alike")


def add_arguments(p) -> None:
    add_trace_block_tokens(p)
    p.add_argument("--trace-model", default="mid", choices=["tiny", "mid", "demo"],
                   help="--trace: random Llama (tiny: hidden 128 / 2 layers; mid: 512 / 4; demo: 1024 / 8)")
    p.add_argument("--warmup-requests", type=int, default=TRACE_WARMUP_REQUESTS,
                   help="--trace: requests before the window that fill the caches, not counted "
                        f"(default {TRACE_WARMUP_REQUESTS})")
    p.add_argument("--start", type=int, default=0, help="--trace: the window's first request in the trace")
    p.add_argument("--full-warmup", action="store_true",
                   help="--trace: replay every warm-up request whole (default: the exact shortcut of warmup_replay)")
    # The span must keep every system's engine busy: only then does output tokens/s measure
    # what an engine can serve. (64 requests over 20 s: all three finished with the last
    # arrival and tokens/s was the offered load, 1.00x apart.) A fixed span does so on one
    # machine only, hence the default measured on this one (auto_span).
    p.add_argument("--span-s", type=finite_float, default=None,
                   help="--trace: the counted arrivals compressed to this span (default: auto, "
                        "the longest over which an engine computing only the window's non-reusable tokens at vLLM "
                        "alone's warm-up prefill speed is never idle)")
    # The share is of the blocks the counted window references (its working set), not of
    # the whole stretch: with a long history, a tenth of the stretch would exceed what the
    # window touches. 0.25 keeps vLLM's cache the size it had before (1,216 pages = 0.24 of
    # the window's 5,025 blocks at 400 requests of history; 1,281 at 3,600).
    p.add_argument("--kv-fraction", type=finite_float, default=KV_FRACTION,
                   help=f"--trace: vLLM's KV cache as a share of the window's working set (default {KV_FRACTION:g})")


class TraceWindow(NamedTuple):
    warm: list[dict]       #: the warm-up requests (sent at once, not counted)
    counted: list[dict]    #: the counted ones, ``arrival_s`` over ``span_s``
    arrivals: str          #: how the counted arrivals were placed (the JSON's ``arrivals``)


def _scaled(r, arrival_s: float, block_tokens: int, warmup: bool) -> dict:
    """One trace request as the benches send it: each block one ``HASH_TOKENS`` page, the
    prompt and output lengths scaled by the same ratio (``block_tokens`` trace tokens a page)."""
    blocks = r.blocks[:MAX_BLOCKS]
    tokens = min(len(blocks) * HASH_TOKENS, -(-r.input_tokens * HASH_TOKENS // block_tokens))
    return {"arrival_s": arrival_s, "blocks": list(blocks), "tokens": tokens,
            # a warm-up request only has to leave its blocks in the caches: one output token
            "max_tokens": 1 if warmup else min(MAX_OUTPUT, max(1, r.output_tokens * HASH_TOKENS // block_tokens))}


def counted_arrivals(arrivals_s: list[float], span_s: float) -> tuple[list[float], str]:
    """The counted requests' arrival times over ``span_s``, and how they were placed: the
    trace's gaps compressed so that the last arrives ``span_s`` after the first; or, where they
    all share one timestamp (a batch or offline trace, or a burst at the trace's start), spread
    evenly, since compressing no spread would send them at once while the JSON says ``span_s``."""
    t0, t1 = arrivals_s[0], arrivals_s[-1]
    n = len(arrivals_s)
    if t1 > t0:
        squeeze = span_s / (t1 - t0)
        return [round((t - t0) * squeeze, 4) for t in arrivals_s], "the trace's gaps, compressed to span_s"
    if n == 1:
        return [0.0], "one counted request, at 0"
    return [round(i * span_s / (n - 1), 4) for i in range(n)], \
        (f"spread evenly over span_s: the window's {n} counted requests share one timestamp in the trace "
         f"({t0 * 1000:g} ms from its first)")


def trace_window(path: str, requests: int, warmup: int, span_s: float, start: int = 0,
                 block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceWindow:
    """A contiguous stretch of the trace: ``warmup`` requests, then ``requests`` counted ones.

    Returns the warm-up and the counted requests, each ``arrival_s``, ``blocks`` (hash ids),
    ``tokens``, ``max_tokens``, and how the arrivals were placed. Contiguous (every request
    of the stretch, in arrival order), so that reuse distances are the trace's own: a
    conversation's next turn comes hundreds of requests after the last one (the median on
    the Mooncake conversation trace is ~380), which is what pushes it out of a small engine
    cache. The warm-up requests fill the caches as the trace before the window would have
    (sent at once, one output token each, not measured); the counted requests keep their
    order and gaps, compressed so that the last arrives ``span_s`` after the first
    (:func:`counted_arrivals`). ``block_tokens``: the trace's tokens per hash id.
    """
    from kvtier.sim.trace import load_trace

    if requests <= 0 or warmup < 0 or start < 0:
        raise SystemExit("--requests must be > 0, --warmup-requests and --start >= 0")
    if block_tokens <= 0:
        raise SystemExit(f"--trace-block-tokens must be > 0 (the trace's tokens per hash id), got {block_tokens}")
    trace = load_trace(path, block_tokens, block_size_hint=TRACE_BLOCK_SIZE_HINT).requests
    if start + warmup + requests > len(trace):
        raise SystemExit(f"{path}: {len(trace)} requests, fewer than --start {start} + --warmup-requests "
                         f"{warmup} + --requests {requests}")
    warm = trace[start:start + warmup]
    counted = trace[start + warmup:start + warmup + requests]
    arrivals, how = counted_arrivals([r.arrival_s for r in counted], span_s)
    return TraceWindow([_scaled(r, 0.0, block_tokens, True) for r in warm],
                       [_scaled(r, a, block_tokens, False) for r, a in zip(counted, arrivals)], how)


def synthesise(requests: list[dict], vocab: int) -> list[dict]:
    """Prompts: each hash id's tokens drawn from a generator seeded by the id."""
    memo: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in memo:
            rng = random.Random(hash_id * 7919 + 1)
            memo[hash_id] = [rng.randrange(16, vocab) for _ in range(HASH_TOKENS)]
        return memo[hash_id]

    return [{"arrival_s": r["arrival_s"], "max_tokens": r["max_tokens"],
             "prompt": [t for b in r["blocks"] for t in block(b)][: r["tokens"]]} for r in requests]


def cacheable_blocks(tokens: int) -> int:
    """Whole pages of a ``tokens``-token prompt that a prefix cache can hit: vLLM computes at
    least the last prompt token (its logits start the answer), so at most ``tokens - 1``."""
    return max(0, tokens - 1) // HASH_TOKENS


def reusable_tokens(requests: list[dict], warmup: list[dict] = ()) -> list[int]:
    """Per request, the prompt tokens an unbounded prefix cache would hit, exactly.

    The cache holds every whole block of every earlier prompt (the warm-up's included; a
    last partial block is never cached) and nothing else (outputs are the model's tokens,
    not the trace's, so they match no later prompt); a request hits its leading blocks up
    to the first one not held, at most :func:`cacheable_blocks`, as vLLM and the kvtier
    connector count ``cached_tokens``.
    """
    seen: set[int] = set()
    for r in warmup:
        seen.update(r["blocks"][: r["tokens"] // HASH_TOKENS])
    out = []
    for r in requests:
        hit = 0
        for b in r["blocks"][: cacheable_blocks(r["tokens"])]:
            if b not in seen:
                break
            hit += HASH_TOKENS
        out.append(hit)
        seen.update(r["blocks"][: r["tokens"] // HASH_TOKENS])
    return out


def reusable_token_ratio(requests: list[dict], warmup: list[dict] = ()) -> float:
    """Share of ``requests``' prompt tokens an unbounded prefix cache would hit (:func:`reusable_tokens`):
    the bound on the ``cached_token_ratio`` of a system that caches whole pages, as vLLM and
    kvtier do. Not of every system: LMCache also stores a prompt's last partial chunk and can
    load up to a page's tokens more a request (0.9707 against a bound of 0.9662 in BENCHMARKS)."""
    total = sum(r["tokens"] for r in requests)
    return sum(reusable_tokens(requests, warmup)) / total if total else 0.0


def against_bound(cached: list[int], bound: list[int]) -> dict:
    """Where a system's cached tokens fall short of (or exceed) the bound, request by request: the
    cached-ratio gap explained by requests, not guessed from the total. Above the bound is a bug
    for vLLM alone and kvtier (whole pages); for LMCache, its prompts' last partial chunks."""
    short = [(b - c) for c, b in zip(cached, bound) if c < b]
    over = [(c - b) for c, b in zip(cached, bound) if c > b]
    return {"requests_below": len(short), "tokens_below": sum(short),
            "requests_above": len(over), "tokens_above": sum(over)}


#: the systems that count cached tokens in whole pages, as the bound does: above it, one hit
#: blocks never stored (KV that is not the prompt's). Not LMCache, which also loads a prompt's
#: last partial chunk (see :func:`reusable_token_ratio`).
WHOLE_PAGE_SYSTEMS = ("vllm", "kvtier")


def above_bound(systems: dict) -> list[str]:
    """One line per whole-page system (:data:`WHOLE_PAGE_SYSTEMS`) with requests that cached more
    tokens than the exact bound: a bug, and its figures no result. Empty when none did; ``bench
    vllm --trace`` posts them as ``warnings`` and exits 1."""
    lines = []
    for name in WHOLE_PAGE_SYSTEMS:
        over = (systems.get(name) or {}).get("cached_vs_reusable", {})
        if over.get("requests_above"):
            lines.append(f"{name}: {over['requests_above']} requests cached {over['tokens_above']} tokens more than "
                         "an unbounded prefix cache could hit (blocks never stored: KV that is not the prompt's); "
                         "its figures are no result")
    return lines


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def metrics(reply: dict, bound: list[int] | None = None, helper_cpu_s: float = 0.0) -> dict:
    """A system's figures from its replay; ``helper_cpu_s``: CPU seconds its helper processes
    (LMCache's server) used meanwhile, counted with the engine's."""
    rows = reply["requests"]
    unfinished = [r for r in rows if r["finish_s"] is None or r["first_token_s"] is None]
    if unfinished:
        raise RuntimeError(f"{len(unfinished)} requests did not finish")
    makespan = max(r["finish_s"] for r in rows)
    ttfts = [r["first_token_s"] - r["arrival_s"] for r in rows]
    return {
        "requests": len(rows),
        "makespan_s": round(makespan, 2),
        # the drain after the last arrival: the window's tail, which every system pays alike
        "after_last_arrival_s": round(makespan - max(r["arrival_s"] for r in rows), 2),
        "output_tokens_per_s": round(sum(r["output_tokens"] for r in rows) / makespan, 2),
        "requests_per_s": round(len(rows) / makespan, 3),
        # time the engine had nothing to run before the last arrival: while it idles,
        # tokens/s is paced by the arrivals, not by what the engine can serve
        **({"engine_idle_s": reply["idle_s"]} if "idle_s" in reply else {}),
        "ttft_p50_s": round(_percentile(ttfts, 0.5), 3),
        "ttft_p90_s": round(_percentile(ttfts, 0.9), 3),
        "cached_token_ratio": round(sum(r["cached_tokens"] or 0 for r in rows)
                                    / sum(r["prompt_tokens"] for r in rows), 4),
        **({"cpu_ms_per_output_token": round(1000 * (reply["cpu_s"] + helper_cpu_s)
                                             / sum(r["output_tokens"] for r in rows), 2)} if "cpu_s" in reply else {}),
        **({"cached_vs_reusable": against_bound([r["cached_tokens"] or 0 for r in rows], bound)} if bound else {}),
    }


def warmup_replay(warm: list[dict], counted: list[dict], cache_pages: int, full: bool = False) -> list[dict]:
    """What the engines are sent before the window: the same caches, for less compute.

    ``full``: every warm-up request. Otherwise (the default) an exact shortcut for caches
    that either hold the whole working set (kvtier's host tier, LMCache's DRAM: sized so)
    or are much smaller than the warm-up (vLLM's KV cache): (1) each earlier warm-up
    request cut after its last whole block the window can hit, duplicates dropped (what
    the big caches must hold, and all the window can use of them), then (2) the warm-up's
    last requests whole, as many as hold ``2 x cache_pages`` distinct whole blocks (the
    whole warm-up if it holds fewer), so that the small cache ends in the state the whole
    stretch leaves (its older content evicted, LRU).
    """
    if full:
        return warm
    used: set[int] = set()
    for r in counted:
        used.update(r["blocks"][: cacheable_blocks(r["tokens"])])
    tail_start = _tail_start(warm, 2 * cache_pages)
    out, sent = [], set()
    for r in warm[:tail_start]:
        whole = r["blocks"][: r["tokens"] // HASH_TOKENS]
        last = max((i for i, b in enumerate(whole) if b in used), default=-1)
        prefix = tuple(whole[: last + 1])
        if last < 0 or prefix in sent:
            continue
        sent.add(prefix)
        # one token past the last block: a prompt of exactly whole blocks would leave its
        # last block uncached (vLLM computes at least the last token)
        out.append({**r, "blocks": list(prefix) + list(r["blocks"][last + 1: last + 2]),
                    "tokens": min(r["tokens"], (last + 1) * HASH_TOKENS + 1)})
    return out + warm[tail_start:]


def _tail_start(warm: list[dict], distinct_blocks: int) -> int:
    """Where the shortest tail of ``warm`` that holds ``distinct_blocks`` distinct whole blocks
    starts (0 if the whole warm-up holds fewer). Distinct, not counted: an LRU cache's state
    after a stretch is its last distinct blocks, and a tail that repeats a shared system prompt
    or a prompt sent again holds fewer than its blocks, so the requests before it still decide
    what the cache keeps."""
    start, seen = len(warm), set()
    while start > 0 and len(seen) < distinct_blocks:
        start -= 1
        r = warm[start]
        seen.update(r["blocks"][: r["tokens"] // HASH_TOKENS])
    return start


def trace_model_spec(name: str, positions: int):
    """The replays' random Llama: ``tiny`` / ``demo`` as ``kvtier bench vllm``, or ``mid``
    (hidden 512 / 4 layers, between the two: prefill costs enough that a cache hit shows in
    TTFT, and a replay still fits in minutes on two shared cores)."""
    from kvtier.integrations.transformers.models import ModelSpec

    if name != "mid":
        return model_spec(name, positions)
    spec = ModelSpec(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                     intermediate_size=1408, vocab_size=2048, max_position_embeddings=8192)
    if positions > spec.max_position_embeddings:
        spec = replace(spec, max_position_embeddings=1 << (positions - 1).bit_length())
    return spec


def ideal_idle_s(arrivals: list[float], work_tokens: list[int], tokens_per_s: float) -> float:
    """Time a one-queue engine serving ``work_tokens`` at ``tokens_per_s`` sits idle before the
    last of ``arrivals`` (a fluid model: no step granularity, no decode)."""
    t = idle = 0.0
    for arrival, work in sorted(zip(arrivals, work_tokens)):
        idle += max(0.0, arrival - t)
        t = max(t, arrival) + work / tokens_per_s
    return idle


def auto_span(unit_arrivals: list[float], nonreusable_tokens: list[int], prefill_tokens_per_s: float) -> float:
    """The default span: the longest (to 0.01 s) over which ``unit_arrivals`` (spread over a span
    of 1) leave an engine that computes only each request's ``nonreusable_tokens`` at
    ``prefill_tokens_per_s`` idle for at most ``IDLE_SHARE`` of its work, so that no engine,
    not even one that hits every reusable token, runs out of work before the last arrival.
    The arrivals' own bursts and lulls decide it, not a fixed fraction."""
    if prefill_tokens_per_s <= 0:
        raise ValueError("the warm-up computed no token: no prefill speed to size the span by")
    busy = sum(nonreusable_tokens) / prefill_tokens_per_s
    lo, hi = 0.0, 2 * busy + 1.0  # idle grows with the span; at 2x the work time it is well past the share
    for _ in range(40):
        mid = (lo + hi) / 2
        scaled = [a * mid for a in unit_arrivals]
        if ideal_idle_s(scaled, nonreusable_tokens, prefill_tokens_per_s) <= IDLE_SHARE * busy:
            lo = mid
        else:
            hi = mid
    return max(0.01, math.floor(lo * 100) / 100)


def warmup_prefill_speed(reply: dict) -> float:
    """Prompt tokens computed per second in a warm-up replay (sent at once: the engine saturated)."""
    rows = reply["requests"]
    return sum(r["prompt_tokens"] - (r["cached_tokens"] or 0) for r in rows) / reply["seconds"]


def window_facts(window: TraceWindow, sent_warm: list[dict], span_s: float | None, block_tokens: int) -> dict:
    """What the JSON says about the replayed window (both trace benches)."""
    warm, counted = window.warm, window.counted
    return {
        "requests": len(counted),
        "warmup_requests": len(warm),
        "warmup_replayed": {"requests": len(sent_warm), "prompt_tokens": sum(r["tokens"] for r in sent_warm)},
        "span_s": span_s,
        "arrivals": window.arrivals,
        "prompt_tokens": sum(r["tokens"] for r in counted),
        "trace_block_tokens": block_tokens,
        "hash_tokens": HASH_TOKENS,
        "reusable_token_ratio": round(reusable_token_ratio(counted, warm), 4),
    }


def run(args) -> dict:
    from kvtier.integrations.transformers.models import ensure_model

    started = time.monotonic()
    # arrivals over a span of 1 here, scaled by each replay (the auto span is known only once
    # vLLM alone's warm-up has shown this machine's prefill speed)
    # None: not given (an explicit 0 is refused by trace_window, not replaced by the default)
    requests = TRACE_REQUESTS if args.requests is None else args.requests
    window = trace_window(args.trace, requests, args.warmup_requests, 1.0, args.start, args.trace_block_tokens)
    warm, counted = window.warm, window.counted
    # vLLM refuses a KV cache smaller than one request of max_model_len: fit it to the slice.
    max_len = max(r["tokens"] + r["max_tokens"] for r in warm + counted) + HASH_TOKENS
    spec = trace_model_spec(args.trace_model, max_len)
    model = str(ensure_model(spec)[0])
    geo = geometry(spec)
    unique_blocks = len({b for r in counted for b in r["blocks"]})  # the window's working set
    page_bytes = HASH_TOKENS * geo["kv_bytes_per_token"]
    working_set = unique_blocks * page_bytes
    kv_pages = max(math.ceil(max_len / HASH_TOKENS) + 16, int(unique_blocks * args.kv_fraction))
    sent_warm = warmup_replay(warm, counted, kv_pages, args.full_warmup)
    # The stores hold everything sent (so that the shortcut is exact), not more.
    sent_blocks = len({b for r in sent_warm + counted for b in r["blocks"]})
    store_bytes = max(256 << 20, int(sent_blocks * page_bytes * 1.25))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-bench-vllm-trace-"))
    workdir.mkdir(parents=True, exist_ok=True)
    base = {"model": model, "max_model_len": max_len, "kv_pages": kv_pages}
    result: dict = {
        "trace": str(args.trace),
        "window": f"requests {args.start}..{args.start + len(warm) + len(counted) - 1} of the trace, "
                  f"the first {len(warm)} as warm-up (not counted)",
        **window_facts(window, sent_warm, args.span_s, args.trace_block_tokens),
        "working_set_bytes": working_set,
        "vllm_kv_pages": kv_pages,
        "vllm_kv_share_of_working_set": round(kv_pages / unique_blocks, 3),
        "model": {"preset": args.trace_model, **geo},
        "systems": {},
    }
    phases = {"first_use": [random.Random(-1).randrange(16, spec.vocab_size) for _ in range(512)],
              "warmup": synthesise(sent_warm, spec.vocab_size), "counted": synthesise(counted, spec.vocab_size),
              "bound": reusable_tokens(counted, warm)}
    try:
        return _run_systems(args, base, phases, result, workdir, store_bytes, started)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def _run_systems(args, base, phases, result, workdir, store_bytes, started) -> dict:
    disk = workdir / "kvtier-disk"
    kvtier = kvtier_extra(HASH_TOKENS, host_bytes=f"{store_bytes >> 20}MiB", disk_path=str(disk), disk_bytes="4GiB")
    span = args.span_s
    if span is None:
        unit = [r["arrival_s"] for r in phases["counted"]]
        work = [len(r["prompt"]) - hit for r, hit in zip(phases["counted"], phases["bound"])]

        def span(warm_reply: dict) -> float:  # noqa: F811 - the auto span, once vLLM alone warmed up
            speed = warmup_prefill_speed(warm_reply)
            result["auto_span"] = {"idle_share": IDLE_SHARE, "nonreusable_tokens": sum(work),
                                   "warmup_prefill_tokens_per_s": round(speed, 1)}
            return auto_span(unit, work, speed)
    result["systems"]["vllm"] = _replay(base | {"extra": None}, phases, workdir / "engine-vllm.log", span=span)
    span = result["span_s"] = result["systems"]["vllm"].pop("span_s", span)
    result["systems"]["kvtier"] = _replay(base | {"extra": kvtier}, phases, workdir / "engine-kvtier.log", span=span)
    shutil.rmtree(disk, ignore_errors=True)
    result["systems"]["lmcache"] = None
    if args.no_lmcache:
        result["lmcache_reason"] = "skipped (--no-lmcache)"
    else:
        try:
            pids: list[int] = []
            with lmcache_server(workdir, chunk_tokens=HASH_TOKENS, l1_gib=max(1, math.ceil(store_bytes / (1 << 30))),
                                pids=pids) as port:
                try:
                    lm = _replay(lmcache_settings(base, port, prefix_caching=True), phases,
                                 workdir / "engine-lmcache.log", span=span, env=LMCACHE_ENV, helpers=pids)
                    lm["vllm_prefix_caching"] = True
                except Exception as exc:  # noqa: BLE001 - its connector may refuse vLLM's prefix cache
                    lm = _replay(lmcache_settings(base, port, prefix_caching=False), phases,
                                 workdir / "engine-lmcache-noprefix.log", span=span, env=LMCACHE_ENV, helpers=pids)
                    lm["vllm_prefix_caching"] = False
                    lm["note"] = f"with vLLM's prefix cache on it failed ({str(exc).splitlines()[0][:200]})"
            result["systems"]["lmcache"] = lm
        except Unavailable as exc:
            result["lmcache_reason"] = str(exc)
    vllm_alone, ours, lm = result["systems"]["vllm"], result["systems"]["kvtier"], result["systems"]["lmcache"]
    for system in (vllm_alone, ours, lm):
        if system:
            # arrivals: the engine ran dry before the last arrival (idle over 5 % of the replay),
            # so tokens/s is partly the offered load and understates what the engine serves
            system["throughput_bound_by"] = "engine" if system["engine_idle_s"] <= 0.05 * system["makespan_s"] \
                else "arrivals"
    result["kvtier_vs_vllm_tokens_per_s"] = round(ours["output_tokens_per_s"] / vllm_alone["output_tokens_per_s"], 3)
    if lm:
        result["kvtier_vs_lmcache_tokens_per_s"] = round(ours["output_tokens_per_s"] / lm["output_tokens_per_s"], 3)
    cpu = "cpu_ms_per_output_token"
    if cpu in ours and cpu in vllm_alone:
        # CPU per output token, a peer's over kvtier's: the cost ratio, steadier than tokens/s on shared cores
        result["kvtier_cpu_saving_vs_vllm"] = round(vllm_alone[cpu] / ours[cpu], 3)
        if lm and cpu in lm:
            result["kvtier_cpu_saving_vs_lmcache"] = round(lm[cpu] / ours[cpu], 3)
    result["kvtier_cached_vs_reusable"] = round(ours["cached_token_ratio"] / result["reusable_token_ratio"], 3) \
        if result["reusable_token_ratio"] else None
    result["warnings"] = above_bound(result["systems"])
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def _replay(settings: dict, phases: dict, log: Path, *, span, env: dict | None = None,
            helpers: list[int] = ()) -> dict:
    """One system's engine: first use, warm-up, then the counted replay. ``span``: the counted
    arrivals' span in seconds (``phases["counted"]`` arrive over a span of 1), or a function of
    the warm-up's reply that returns it (the auto span, on the first engine); the result's
    ``span_s`` says which. ``helpers``: pids of processes that work for it (LMCache's server),
    whose CPU counts with the engine's."""
    from kvtier.integrations.vllm.engine_proc import EngineProcess

    engine = EngineProcess(settings, log, env=env)
    try:
        engine.wait_ready(timeout=600)
        # First-use costs, untimed. Its tokens share no block with the slice, and it is not
        # reset away: LMCache's connector makes vLLM refuse resets (it holds pages for its
        # asynchronous saves), and every system must start alike.
        engine.call(op="ttft", prompt=phases["first_use"], max_tokens=2, timeout=600)
        # The warm-up stretch, as fast as the engine takes it (not measured), then the window.
        t0 = time.monotonic()
        warm = engine.call(op="replay", requests=phases["warmup"], timeout=3600)
        warm_s = time.monotonic() - t0
        span_s = span(warm) if callable(span) else span
        arrivals = [{**r, "arrival_s": round(r["arrival_s"] * span_s, 4)} for r in phases["counted"]]
        helper_cpu = sum(process_cpu_s(pid) for pid in helpers)
        counted = engine.call(op="replay", requests=arrivals, timeout=3600)
        helper_cpu = sum(process_cpu_s(pid) for pid in helpers) - helper_cpu
        out = metrics(counted, phases["bound"], helper_cpu)
        out["warmup_s"] = round(warm_s, 1)
        if callable(span):
            out["span_s"] = span_s  # the auto span, for the next systems
        if "profile" in counted:  # KVTIER_ENGINE_PROFILE set: where the engine's time went
            out["profile"] = {"warmup": warm["profile"], "counted": counted["profile"]}
        return out
    finally:
        engine.close()


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result['requests']} requests of {result['trace']} over {result['span_s']} s "
                        f"(reusable tokens {result['reusable_token_ratio']:.1%})")
    cols = ("output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p90_s", "cached_token_ratio")
    table.add_column("system")
    for col in cols:
        table.add_column(col, justify="right")
    for name, row in result["systems"].items():
        if row:
            table.add_row(name, *(str(row[c]) for c in cols))
    Console().print(table)
    if not result["systems"]["lmcache"]:
        Console().print(f"LMCache: {result.get('lmcache_reason')}")
