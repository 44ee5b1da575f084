"""``python -m tests.planner.standin_worker serve MODEL --host H --port P …``: a worker process for the
local launcher's tests (what ``vllm serve`` is to it, without a model): /health answers only after
``STANDIN_HEALTH_AFTER_S``; completions stream three chunks ``STANDIN_CHUNK_S`` apart; SIGTERM
exits 0 once in-flight streams are done; ``STANDIN_EXIT_AT_ONCE=1`` dies before listening."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

from aiohttp import web


def main(argv: list[str]) -> int:
    if os.environ.get("STANDIN_EXIT_AT_ONCE") == "1":
        print("standin: told to fail", flush=True)
        return 3
    host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
    ready_at = time.monotonic() + float(os.environ.get("STANDIN_HEALTH_AFTER_S", "0"))
    chunk_s = float(os.environ.get("STANDIN_CHUNK_S", "0.2"))
    print("standin args:", json.dumps(argv), flush=True)

    async def health(request):
        return web.Response(status=200 if time.monotonic() >= ready_at else 503)

    async def complete(request):
        body = await request.json()
        usage = {"prompt_tokens": 8, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}
        if not body.get("stream"):
            await asyncio.sleep(chunk_s)
            return web.json_response({"choices": [{"text": "a b c"}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for tok in ("a", "b", "c"):
            await resp.write(f"data: {json.dumps({'choices': [{'text': tok}]})}\n\n".encode())
            await asyncio.sleep(chunk_s)
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", complete)
    web.run_app(app, host=host, port=port, print=None, handle_signals=True, shutdown_timeout=10)
    print("standin: stopped on SIGTERM", flush=True)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main(sys.argv[1:]))
