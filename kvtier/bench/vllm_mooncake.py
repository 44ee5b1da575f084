"""The Mooncake system of ``kvtier bench vllm --stores …,mooncake``: a kvtier engine whose only
tier is a Mooncake Store fleet (a real ``mooncake_master`` + one segment holder on loopback).

One engine, ``host_bytes=0``, write-through: its cold run computes the prompt and saves every
block into the fleet; after a flush and a reset of vLLM's own prefix cache, its warm run finds
nothing but the fleet, so every loaded token crossed the transfer engine (as on a node that
never saw the prompt). Reported beside the ``remote`` system (the same, through one
``kvtier serve``): ``speedup_mooncake`` and ``mooncake_vs_remote`` = speedup_mooncake /
speedup_remote (target ≥ 0.8).
"""

from __future__ import annotations

import os
import statistics

from kvtier.bench.vllm_systems import kvtier_extra, reset


def start(stack, base: dict, args, workdir, store_bytes: str) -> dict:
    """Start the fleet and the engine (not waited for); everything stops with ``stack``."""
    from kvtier.core.units import parse_size
    from kvtier.integrations.vllm.engine_proc import EngineProcess
    from kvtier.tiers.mooncake_launch import MooncakeCluster

    cluster = stack.enter_context(MooncakeCluster.start(holders=1, segment_bytes=parse_size(store_bytes, "store")))
    secret = workdir / "mooncake.secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    extra = kvtier_extra(args.block_tokens, host_bytes=0, write_mode="write-through",
                         mooncake_master=cluster.master_address, mooncake_metadata=cluster.metadata_url,
                         mooncake_secret_file=str(secret))
    engine = EngineProcess({**base, "extra": extra}, workdir / "engine-mooncake.log")
    stack.callback(engine.close)
    return {"mooncake": engine}


def one_prompt(engines: dict, prompt: list[int], args, runs: dict) -> None:
    """Cold (compute and save into the fleet), then warm (load from it) on one prompt."""
    engine = engines["mooncake"]

    def ttft() -> dict:
        return engine.call(op="ttft", prompt=prompt, max_tokens=args.gen_tokens, timeout=1800)

    runs["mooncake_cold"] = ttft()
    engine.call(op="flush", timeout=600)
    reset(engine)
    before = engine.call(op="stats")["worker"]["load_seconds"]
    runs["mooncake"] = ttft()
    runs["mooncake"]["load_s"] = engine.call(op="stats")["worker"]["load_seconds"] - before
    loaded = (runs["mooncake"]["kv_transfer_params"] or {}).get("kvtier_loaded_tokens", 0)
    runs["mooncake"]["loaded_tokens"] = loaded
    if loaded < len(prompt) - args.block_tokens:
        raise RuntimeError(f"kvtier mooncake loaded {loaded} of {len(prompt)} tokens; log: {engine.log_path}")


def summary(runs: list[dict], result: dict) -> dict:
    """The Mooncake figures, against the same run's recompute and ``remote`` system."""
    from kvtier.bench.vllm import _compare

    med = round(statistics.median(r["mooncake"]["ttft_s"] for r in runs), 4)
    speedup = round(result["ttft_recompute_s"] / med, 2)
    checks = [_compare(r["mooncake"], r["recompute"]) for r in runs]
    worst = max(w for _, w in checks)
    return {
        "ttft_mooncake_s": med,
        "ttft_mooncake_cold_s": round(statistics.median(r["mooncake_cold"]["ttft_s"] for r in runs), 4),
        "load_mooncake_s": round(statistics.median(r["mooncake"]["load_s"] for r in runs), 4),
        "speedup_mooncake": speedup,
        "mooncake_vs_remote": round(speedup / result["speedup_remote"], 3),
        "mooncake_loaded_tokens": min(r["mooncake"]["loaded_tokens"] for r in runs),
        "mooncake_logprobs_max_abs_diff": worst if worst != float("inf") else None,
        "mooncake_logprobs_equal": all(w <= result["logprob_tolerance"] for _, w in checks),
        # the store's own exactness, as for host and remote: where vLLM's own hit is itself off the
        # recompute (latent attention on CPU), the tolerance above says nothing
        "logprobs_equal_to_floor": {**result.get("logprobs_equal_to_floor", {}),
                                    "mooncake": all(_compare(r["mooncake"], r["prefix_cache"])[0] for r in runs)},
    }
