"""``kvtier bench vllm --trace FILE``: a slice of a Mooncake-format trace replayed through vLLM.

The trace gives block identities, not text (:mod:`kvtier.sim.trace`): each hash id
becomes ``--hash-tokens`` tokens drawn from a generator seeded by the id, so that
equal ids give equal token blocks and a prompt is the concatenation of its
blocks (the last one cut to the request's length, scaled like its blocks). The
slice keeps whole conversations (requests grouped by their first block past the
shared system prompt, every ``k``-th group, ``k`` chosen for about
``--requests`` requests), so that its reuse is the trace's own; the trace's
arrival times are compressed to ``--span-s`` seconds, enough to keep one engine
busy, so that what a cache saves shows as throughput.

Each system is one vLLM engine with its prefix cache on (LMCache: off if its
connector refuses it) and a KV cache of ``--kv-fraction`` of the slice's working
set, so that vLLM alone must evict: vLLM alone; vLLM + kvtier (host tier that
holds the working set, a disk tier behind it); vLLM + LMCache (its MP connector
and an ``lmcache server`` with at least the same DRAM). ``reusable_token_ratio``
is the share of prompt tokens an unbounded cache would hit (each request's
longest prefix of blocks seen in earlier requests): the bound on any
``cached_token_ratio``.

Known limit (measured, see BENCHMARKS.md): keeping one conversation in ~170 keeps its reuse but
divides the requests between two of its turns by as much, so even a minimal vLLM cache (one
max-length request) hits every reusable token and a connector cannot add hits. A contiguous
window of the trace after a warm-up stretch would keep reuse distances; not done yet.
"""

from __future__ import annotations

import contextlib
import math
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from kvtier.bench.vllm_systems import (
    LMCACHE_ENV,
    Unavailable,
    geometry,
    kvtier_extra,
    lmcache_server,
    lmcache_settings,
    model_spec,
)

#: trace blocks are 512 tokens; each becomes HASH_TOKENS tokens (one vLLM page on CPU)
TRACE_BLOCK_TOKENS = 512
HASH_TOKENS = 32
MAX_BLOCKS = 128  #: prompts cut to this many blocks (the trace reaches 240)
MAX_OUTPUT = 32  #: output lengths scaled like prompts, then capped


def add_arguments(p) -> None:
    p.add_argument("--span-s", type=float, default=40.0, help="--trace: the slice's arrivals compressed to this span")
    p.add_argument("--kv-fraction", type=float, default=0.25,
                   help="--trace: vLLM's KV cache as a share of the slice's working set (default 0.25)")


def slice_trace(path: str, requests: int, span_s: float) -> list[dict]:
    """The replayed requests: ``arrival_s``, ``blocks`` (hash ids), ``tokens``, ``max_tokens``."""
    from kvtier.sim.trace import load_trace

    trace = load_trace(path, TRACE_BLOCK_TOKENS)
    groups = [r for r in trace.requests if len(r.blocks) > 1]
    if not groups:
        raise SystemExit(f"{path}: no request has more than one block")
    every = max(1, round(len(groups) / max(1, requests)))
    # Knuth's multiplicative hash spreads consecutive conversation ids over the residues.
    picked = [r for r in groups if (r.blocks[1] * 2654435761) % (1 << 32) % every == 0]
    t0, t1 = picked[0].arrival_s, picked[-1].arrival_s
    squeeze = span_s / (t1 - t0) if t1 > t0 else 0.0
    scale = TRACE_BLOCK_TOKENS // HASH_TOKENS
    out = []
    for r in picked:
        blocks = r.blocks[:MAX_BLOCKS]
        tokens = min(len(blocks) * HASH_TOKENS, math.ceil(r.input_tokens / scale))
        out.append({"arrival_s": round((r.arrival_s - t0) * squeeze, 4), "blocks": list(blocks), "tokens": tokens,
                    "max_tokens": min(MAX_OUTPUT, max(1, r.output_tokens // scale))})
    return out


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


def reusable_token_ratio(requests: list[dict]) -> float:
    """Tokens an unbounded cache holding every earlier request's blocks would hit, as a share."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        total += r["tokens"]
        for i, b in enumerate(r["blocks"]):
            if b not in seen or (i + 1) * HASH_TOKENS > r["tokens"]:
                break  # a prefix cache hits whole blocks, and only up to the first miss
            hit += HASH_TOKENS
        seen.update(r["blocks"])
    return hit / total if total else 0.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def metrics(reply: dict) -> dict:
    rows = reply["requests"]
    unfinished = [r for r in rows if r["finish_s"] is None or r["first_token_s"] is None]
    if unfinished:
        raise RuntimeError(f"{len(unfinished)} requests did not finish")
    makespan = max(r["finish_s"] for r in rows)
    ttfts = [r["first_token_s"] - r["arrival_s"] for r in rows]
    return {
        "requests": len(rows),
        "makespan_s": round(makespan, 2),
        "output_tokens_per_s": round(sum(r["output_tokens"] for r in rows) / makespan, 2),
        "requests_per_s": round(len(rows) / makespan, 3),
        "ttft_p50_s": round(_percentile(ttfts, 0.5), 3),
        "ttft_p90_s": round(_percentile(ttfts, 0.9), 3),
        "cached_token_ratio": round(sum(r["cached_tokens"] or 0 for r in rows)
                                    / sum(r["prompt_tokens"] for r in rows), 4),
    }


def run(args) -> dict:
    from kvtier.integrations.transformers.models import ensure_model

    started = time.monotonic()
    sliced = slice_trace(args.trace, args.requests or 64, args.span_s)
    # vLLM refuses a KV cache smaller than one request of max_model_len: fit it to the slice.
    max_len = max(r["tokens"] + r["max_tokens"] for r in sliced) + HASH_TOKENS
    spec = model_spec(args.model, max_len)
    model = str(ensure_model(spec)[0])
    geo = geometry(spec)
    requests = synthesise(sliced, spec.vocab_size)
    unique_blocks = len({b for r in sliced for b in r["blocks"]})
    page_bytes = HASH_TOKENS * geo["kv_bytes_per_token"]
    working_set = unique_blocks * page_bytes
    kv_pages = max(math.ceil(max_len / HASH_TOKENS) + 16, int(unique_blocks * args.kv_fraction))
    store_bytes = max(256 << 20, int(working_set * 1.25))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-bench-vllm-trace-"))
    workdir.mkdir(parents=True, exist_ok=True)
    base = {"model": model, "max_model_len": max_len, "kv_pages": kv_pages}
    result: dict = {
        "trace": str(args.trace),
        "requests": len(requests),
        "span_s": args.span_s,
        "prompt_tokens": sum(len(r["prompt"]) for r in requests),
        "hash_tokens": HASH_TOKENS,
        "reusable_token_ratio": round(reusable_token_ratio(sliced), 4),
        "working_set_bytes": working_set,
        "vllm_kv_pages": kv_pages,
        "vllm_kv_share_of_working_set": round(kv_pages / unique_blocks, 3),
        "model": {"preset": args.model, **geo},
        "systems": {},
    }
    warmup = [random.Random(-1).randrange(16, spec.vocab_size) for _ in range(512)]
    try:
        return _run_systems(args, base, requests, warmup, result, workdir, store_bytes, started)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def _run_systems(args, base, requests, warmup, result, workdir, store_bytes, started) -> dict:
    disk = workdir / "kvtier-disk"
    kvtier = kvtier_extra(HASH_TOKENS, host_bytes=f"{store_bytes >> 20}MiB", disk_path=str(disk), disk_bytes="4GiB")
    result["systems"]["vllm"] = _replay(base | {"extra": None}, requests, warmup, workdir / "engine-vllm.log")
    result["systems"]["kvtier"] = _replay(base | {"extra": kvtier}, requests, warmup, workdir / "engine-kvtier.log")
    shutil.rmtree(disk, ignore_errors=True)
    result["systems"]["lmcache"] = None
    if args.no_lmcache:
        result["lmcache_reason"] = "skipped (--no-lmcache)"
    else:
        try:
            with lmcache_server(workdir, chunk_tokens=HASH_TOKENS, l1_gib=max(1, math.ceil(store_bytes / (1 << 30)))) as port:
                try:
                    lm = _replay(lmcache_settings(base, port, prefix_caching=True), requests, warmup,
                                 workdir / "engine-lmcache.log", env=LMCACHE_ENV)
                    lm["vllm_prefix_caching"] = True
                except Exception as exc:  # noqa: BLE001 - its connector may refuse vLLM's prefix cache
                    lm = _replay(lmcache_settings(base, port, prefix_caching=False), requests, warmup,
                                 workdir / "engine-lmcache-noprefix.log", env=LMCACHE_ENV)
                    lm["vllm_prefix_caching"] = False
                    lm["note"] = f"with vLLM's prefix cache on it failed ({str(exc).splitlines()[0][:200]})"
            result["systems"]["lmcache"] = lm
        except Unavailable as exc:
            result["lmcache_reason"] = str(exc)
    vllm_alone, ours, lm = result["systems"]["vllm"], result["systems"]["kvtier"], result["systems"]["lmcache"]
    result["kvtier_vs_vllm_tokens_per_s"] = round(ours["output_tokens_per_s"] / vllm_alone["output_tokens_per_s"], 3)
    if lm:
        result["kvtier_vs_lmcache_tokens_per_s"] = round(ours["output_tokens_per_s"] / lm["output_tokens_per_s"], 3)
    result["kvtier_cached_vs_reusable"] = round(ours["cached_token_ratio"] / result["reusable_token_ratio"], 3) \
        if result["reusable_token_ratio"] else None
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def _replay(settings: dict, requests: list[dict], warmup: list[int], log: Path, *, env: dict | None = None) -> dict:
    from kvtier.integrations.vllm.engine_proc import EngineProcess

    engine = EngineProcess(settings, log, env=env)
    try:
        engine.wait_ready(timeout=600)
        # First-use costs, untimed. Its tokens share no block with the slice, and it is not
        # reset away: LMCache's connector makes vLLM refuse resets (it holds pages for its
        # asynchronous saves), and every system must start alike.
        engine.call(op="ttft", prompt=warmup, max_tokens=2, timeout=600)
        return metrics(engine.call(op="replay", requests=requests, timeout=3600))
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
