"""A real router and one stand-in worker in a process of their own (tests/router/test_router_load.py),
so that a test can time requests against a router whose event loop is busy (a client on the same
loop would stall with it) and read the router process's own peak memory.

Usage: python _load_child.py WORKER TOKENIZER ROUTER_KWARGS_JSON
  WORKER: "raw" (takes bodies up to 1 GiB and answers without parsing them: the time measured is
          the router's) or "huge404" (answers 404 with a JSON error padded to HUGE404_MIB MiB)
  TOKENIZER: "word" (the tests' WordTokenizer) or "hf" (the real test model's PromptTokenizer)
Prints the router's URL on one line, then serves until SIGTERM or its parent dies.
"""

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from aiohttp import web  # noqa: E402

from kvtier.router.app import Router  # noqa: E402
from kvtier.router.config import RouterConfig, WorkerSpec  # noqa: E402
from tests.router.test_http import WordTokenizer, free_port  # noqa: E402


class Raw:
    """An OpenAI-speaking worker that reads a request whole and answers at once, without parsing
    it (a stand-in's own JSON parsing of large bodies would stall this process's loop too)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "tiny", "parent": None}]})

    async def health(self, request):
        return web.Response()

    async def complete(self, request):
        size = len(await request.read())
        return web.json_response({"id": "x", "object": "text_completion", "choices": [{"text": "a"}],
                                  "received": size})


class Huge404(Raw):
    """A worker whose 404 for a model carries a huge body (a broken or hostile worker, or a
    proxy's error page in front of one)."""

    async def complete(self, request):
        await request.read()
        resp = web.StreamResponse(status=404, headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"error": {"message": "The model `x` does not exist.", "param": "model", "pad": "')
        pad = b"x" * (1 << 20)
        for _ in range(int(os.environ.get("HUGE404_MIB", "300"))):
            await resp.write(pad)
        await resp.write(b'"}}')
        return resp


async def main() -> None:
    kind, tok, kw = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    worker = {"raw": Raw, "huge404": Huge404}[kind]()
    await worker.start()
    if tok == "hf":
        from kvtier.integrations.transformers.models import VLLM_TEST_SPEC, ensure_model
        from kvtier.router.requests import PromptTokenizer
        tokenizer = PromptTokenizer(str(ensure_model(VLLM_TEST_SPEC)[0]))
    else:
        tokenizer = WordTokenizer()
    kw.setdefault("block_tokens", 16)   # vLLM's default --block-size
    config = RouterConfig(workers=[WorkerSpec(worker.url)], kv_bytes_per_token=4096, port=free_port(), **kw)
    router = Router(config, tokenizer)
    runner = router.runner()
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", config.port).start()
    print(f"http://127.0.0.1:{config.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    parent = os.getppid()

    async def orphaned() -> None:   # the test process died: no router left behind
        while os.getppid() == parent:
            await asyncio.sleep(1)
        stop.set()
    watch = asyncio.ensure_future(orphaned())
    await stop.wait()
    watch.cancel()
    await runner.cleanup()
    await worker.stop()


if __name__ == "__main__":
    asyncio.run(main())
