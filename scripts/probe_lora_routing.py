"""Requests for a LoRA adapter that only some workers serve, through ``kvtier route`` to real vLLM.

Two vLLM workers (the tiny test model, LoRA enabled, the kvtier connector, one shared
``kvtier serve``) behind a tier-aware router. An adapter with random weights is loaded at
run time on worker 1 only, straight to that worker (the router is not told), and 8 requests
for it are sent to the router at once. Then an adapter is loaded through the router, and a
700-token prompt is sent twice under it and once as the base model: what the router
predicted cached and what vLLM found.

    python scripts/probe_lora_routing.py [--logs DIR] [--wait S]

``--wait S`` waits before the 8 requests (past ``models_refresh_s``, 30 s, the router has
read the new listing; at 0 it has not). To compare with another commit, run it with
``PYTHONPATH=<that tree>``. Prints what each step got.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def post(url: str, body: dict) -> tuple[int, str, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), dict(err.headers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logs", default="/tmp/kvtier-probe-lora")
    parser.add_argument("--wait", type=float, default=0.0)
    args = parser.parse_args()
    from kvtier.bench.route_stack import kvtier_transfer_config, start_router, start_worker, wait_ready
    from kvtier.integrations.transformers.models import VLLM_TEST_SPEC, ensure_model, random_lora_adapter
    from kvtier.server.launch import ServerProcess

    spec = VLLM_TEST_SPEC
    model = str(ensure_model(spec)[0])
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    adapter = random_lora_adapter(model, logs / "adapter")
    server = ServerProcess.start({"acme": "tok"})
    transfer = kvtier_transfer_config(server.url, "tok", block_tokens=256)
    lora = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    workers = [start_worker(model, logs / f"w{i}.log", transfer=transfer, core=i, extra_args=lora,
                            env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) for i in range(2)]
    procs = list(workers)
    try:
        wait_ready(workers)
        router = start_router(model, workers, logs / "router.log", extra_args=["--shared-writes"])
        procs.append(router)
        print("workers:", [w.url for w in workers])
        print("load on worker 1:", post(workers[1].url + "/v1/load_lora_adapter",
                                        {"lora_name": "sql", "lora_path": adapter})[:2])
        time.sleep(args.wait)

        def one(k: int) -> tuple[int, str | None]:
            prompt = [3 + (k * 37 + j) % 1900 for j in range(300)]
            status, _, headers = post(router.url + "/v1/completions",
                                      {"model": "sql", "prompt": prompt, "max_tokens": 16})
            return status, headers.get("X-Kvtier-Worker")

        with ThreadPoolExecutor(8) as pool:
            print("8 requests for it, at once (status, worker):", list(pool.map(one, range(8))))
        status, body, _ = post(router.url + "/v1/completions", {"model": "nope", "prompt": [5] * 10, "max_tokens": 2})
        print("a model nobody serves:", status, body[:200])
        with urllib.request.urlopen(router.url + "/v1/models") as resp:
            print("the router's /v1/models:", [m["id"] for m in json.loads(resp.read())["data"]])
        print("load through the router:", post(router.url + "/v1/load_lora_adapter",
                                                {"lora_name": "sql2", "lora_path": adapter})[:2])
        prompt = [7 + j % 1500 for j in range(700)]
        for name in ("sql2", "sql2", model):
            status, body, headers = post(router.url + "/v1/completions",
                                         {"model": name, "prompt": prompt, "max_tokens": 2})
            usage = json.loads(body).get("usage") or {}
            print(f"{'base model' if name == model else name}: {status}, predicted cached",
                  headers.get("X-Kvtier-Predicted-Cached"), "vLLM cached",
                  (usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    finally:
        for p in procs:
            p.stop()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.environ.get("PYTHONPATH", "").split(":")[0] or str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
