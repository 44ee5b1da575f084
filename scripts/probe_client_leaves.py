"""Tokens a real vLLM worker decodes for clients that left, through ``kvtier route``.

One vLLM worker (the tiny test model, the kvtier connector, pinned to core 0) behind a
tier-aware router. Each try sends a 64-token prompt with ``max_tokens`` 1,900 and
``ignore_eos``, and the client leaves: a stream once the router's first event is in its
socket, a non-streamed request after 0.5 s. The worker's ``vllm:generation_tokens_total``
tells how many tokens it decoded for it (1,900: the departure was never acted on).

    python scripts/probe_client_leaves.py --tries 8 [--whole-only] [--hogs 2] [--logs DIR]

``--hogs N`` puts N busy processes on the worker's core (an engine short of CPU). To compare
with another commit, run it with ``PYTHONPATH=<that tree>`` (its router and launcher are used).
Prints one JSON line: the tokens per try, streamed and whole.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import select
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tries", type=int, default=8, help="tries of each kind")
    p.add_argument("--whole-only", action="store_true", help="non-streamed requests only")
    p.add_argument("--hogs", type=int, default=0, help="busy processes on the worker's core")
    p.add_argument("--logs", default="/tmp/kvtier-client-leaves", help="worker and router logs")
    args = p.parse_args()

    from kvtier.bench.route_stack import kvtier_transfer_config, start_router, start_worker, wait_ready
    from kvtier.integrations.transformers.models import VLLM_TEST_SPEC, ensure_model
    from kvtier.server.launch import ServerProcess

    spec = VLLM_TEST_SPEC
    model = str(ensure_model(spec)[0])
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    server = ServerProcess.start({"acme": "tok"})
    worker = start_worker(model, logs / "worker.log", transfer=kvtier_transfer_config(server.url, "tok", block_tokens=256),
                          core=0)
    procs, hogs = [worker], []

    def metric(name: str) -> float:
        text = urllib.request.urlopen(worker.url + "/metrics", timeout=60).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and line[len(name)] in "{ ")

    out = {"hogs": args.hogs, "stream": [], "whole": []}
    try:
        wait_ready([worker])
        router = start_router(model, [worker], logs / "router.log", policy="tier-aware", extra_args=["--shared-writes"])
        procs.append(router)
        hogs = [subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", "while True: pass"])
                for _ in range(args.hogs)]
        rng = random.Random(5)
        kinds = [False] * args.tries if args.whole_only else [True, False] * args.tries
        for stream in kinds:
            before = metric("vllm:generation_tokens_total")
            body = {"model": model, "prompt": [rng.randrange(3, 2000) for _ in range(64)], "max_tokens": 1900,
                    "ignore_eos": True, "stream": stream}
            conn = http.client.HTTPConnection(router.url[len("http://"):], timeout=60)
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            if stream:
                select.select([conn.sock], [], [], 60)
            else:
                time.sleep(0.5)
            conn.close()
            time.sleep(0.3)
            for _ in range(120):
                if metric("vllm:num_requests_running") == 0:
                    break
                time.sleep(0.5)
            out["stream" if stream else "whole"].append(metric("vllm:generation_tokens_total") - before)
    finally:
        for h in hogs:
            h.kill()
        for proc in procs:
            proc.stop()
        server.stop()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
