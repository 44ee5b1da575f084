"""Whether a real vLLM worker acts on an abort by name that comes with, or soon after, the request.

One vLLM worker (the tiny test model, pinned to core 0). Each try sends a 64-token prompt with
``max_tokens`` 6,000, ``ignore_eos`` and ``X-Request-Id``, stays connected, and ``--delay``
seconds after sending it posts ``/inference/v1/abort_requests`` for the id vLLM derives
(``cmpl-<id>-0``). The answer's ``finish_reason`` tells what became of it: ``abort``, or
``length`` (the abort was a no-op: vLLM had not registered the request yet, and answered 200
all the same). This is why kvtier's router sends an abort again when a client left before its
worker's first byte (kvtier/router/abort.py, ``abort_again_s``).

    python scripts/probe_abort_before_registered.py --delay 0 --tries 6

Prints one JSON line: per try, when the abort was answered, its status, the finish reason and
the tokens decoded.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
import urllib.request
from pathlib import Path


def post(url: str, body: dict, path: str, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=600) as resp:
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--delay", type=float, default=0.0, help="seconds from sending the request to its abort")
    p.add_argument("--tries", type=int, default=6)
    p.add_argument("--logs", default="/tmp/kvtier-abort-early", help="the worker's log")
    args = p.parse_args()

    from kvtier.bench.route_stack import start_worker, wait_ready
    from kvtier.integrations.transformers.models import VLLM_TEST_SPEC, ensure_model

    model = str(ensure_model(VLLM_TEST_SPEC)[0])
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    # room for 6,000 tokens past the tiny model's 2,048 positions (random weights do not care)
    worker = start_worker(model, logs / "worker.log", core=0, max_model_len=8192,
                          env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    rng = random.Random(1)
    tries = []
    try:
        wait_ready([worker])
        for n in range(args.tries):
            rid = f"probe-{n}"
            body = {"model": model, "prompt": [rng.randrange(3, 2048) for _ in range(64)], "max_tokens": 6000,
                    "ignore_eos": True}
            answer: dict = {}
            client = threading.Thread(target=lambda: answer.update(
                out=post(worker.url, body, "/v1/completions", {"X-Request-Id": rid})[1]))
            t0 = time.monotonic()
            client.start()
            time.sleep(args.delay)
            status, _ = post(worker.url, {"request_ids": [f"cmpl-{rid}-0"]}, "/inference/v1/abort_requests")
            answered_s = time.monotonic() - t0
            client.join()
            out = answer["out"]
            tries.append({"abort_answered_s": round(answered_s, 2), "status": status,
                          "finish_reason": out["choices"][0]["finish_reason"],
                          "tokens": out["usage"]["completion_tokens"]})
            print(json.dumps(tries[-1]), flush=True)
    finally:
        worker.stop()
    print(json.dumps({"delay_s": args.delay, "tries": tries,
                      "decoded_whole": sum(t["finish_reason"] == "length" for t in tries)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
