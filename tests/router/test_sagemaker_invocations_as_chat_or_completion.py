"""SageMaker's ``/invocations``, which vLLM serves as a chat or a completion by the body's form
(messages: a chat; a prompt: a completion), is routed, keyed, named and aborted as that endpoint
is (audit s31 a4 D5): on SageMaker all traffic comes this way. Real sockets, the real ``Router``
app, a stand-in worker that serves ``/invocations`` as vLLM does (its engine ids from the
request's name); no vLLM."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from aiohttp import ClientSession, web

from tests.router.test_http import BS, Deaf, distinct, leave_early, run, start_router, until

CHAT = {"messages": [{"role": "user", "content": "a b c d e"}]}
COMPLETION = {"prompt": "a b c d e"}


class SageMakerWorker(Deaf):
    """vLLM's ``/invocations``: a body with messages runs as a chat (``chatcmpl-<id>``), one with
    a prompt as a completion (``cmpl-<id>-0``), the id the ``X-Request-Id`` header's or else the
    body's ``request_id``; deaf to a closed connection, until aborted by name; a whole answer."""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/invocations", self.invoke)
        app.router.add_post("/inference/v1/abort_requests", self.abort)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def invoke(self, request):
        body = await request.json()
        rid = request.headers.get("X-Request-Id", body.get("request_id"))
        ids = [f"chatcmpl-{rid}"] if body.get("messages") is not None else [f"cmpl-{rid}-0"]
        self.named.append(ids)
        self.requests += 1
        stop = asyncio.Event()
        self.running.update({i: stop for i in ids})
        for _ in range(self.steps):
            if stop.is_set():
                self.aborted += 1
                return web.Response(status=499)
            await asyncio.sleep(self.gap_s)
        self.finished += 1
        return web.json_response({"id": ids[0], "choices": [{"text": "done"}]})


@pytest.mark.parametrize("body, engine_id", [(CHAT, r"chatcmpl-[0-9a-f]{32}"), (COMPLETION, r"cmpl-[0-9a-f]{32}-0"),
                                              ({**CHAT, "request_id": "mine"}, r"chatcmpl-mine")])
def test_an_invocation_whose_client_leaves_is_aborted_by_the_name_vllm_runs_it_under(body, engine_id):
    """A client that leaves a non-streamed ``/invocations`` generation: the worker is told to
    abort the engine request vLLM runs it as (a chat's or a completion's id from the router's
    ``X-Request-Id``, or the body's own ``request_id``), and stops. Before, it was forwarded
    unnamed and decoded on to its end for nobody."""
    async def main():
        w = SageMakerWorker("w0", steps=40, gap_s=0.05)   # 2 s of decoding
        await w.start()
        router, runner, url = await start_router([w], abort_again_s=())
        try:
            async with ClientSession() as s:
                await leave_early(s, url, "/invocations", body, worker=w)
                await until(lambda: w.aborted + w.finished == 1, timeout_s=5)
            assert (w.aborted, w.finished) == (1, 0), (w.aborted, w.finished, w.named, w.abort_posts)
            assert re.fullmatch(engine_id, w.named[0][0]), w.named
            assert [p["request_ids"] for p in distinct(w.abort_posts)] == [w.named[0]]
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


@pytest.mark.parametrize("body", [CHAT, COMPLETION])
def test_an_invocation_is_keyed_and_priced_as_its_endpoint(body):
    """An ``/invocations`` chat or completion is tokenized and priced as one (its prompt's 5
    tokens counted for the planner, not an unknown length), and the client is told the id its
    request ran under. Before, it went on load alone, its length unknown."""
    async def main():
        w = SageMakerWorker("w0", steps=1, gap_s=0.0)
        await w.start()
        router, runner, url = await start_router([w])
        try:
            async with ClientSession() as s:
                async with s.post(url + "/invocations", json=body) as r:
                    status, answer, echoed = r.status, await r.json(), r.headers.get("X-Request-Id")
            assert status == 200 and answer["choices"][0]["text"] == "done"
            assert echoed is not None and answer["id"] in (f"chatcmpl-{echoed}", f"cmpl-{echoed}-0")
            assert router.metrics.routed_prompt_tokens.labels(w.url)._value.get() == 5
            assert router.metrics.unknown_length.labels(w.url)._value.get() == 0
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_an_invocation_that_is_neither_chat_nor_completion_is_forwarded_unchanged():
    """A pooling model's body (no messages, no prompt) goes to the worker as it came, on load, as
    before; a chat body whose messages are malformed is the router's 400, as on the chat path."""
    async def main():
        w = SageMakerWorker("w0", steps=1, gap_s=0.0)
        seen: list[bytes] = []

        async def pooled(request):
            seen.append(await request.read())
            return web.json_response({"data": [{"embedding": [0.5]}]})
        w.invoke = pooled
        await w.start()
        router, runner, url = await start_router([w])
        try:
            async with ClientSession() as s:
                raw = b'{"model": "tiny", "input": ["x"]}'
                async with s.post(url + "/invocations", data=raw, headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 200 and (await r.json())["data"][0]["embedding"] == [0.5]
                async with s.post(url + "/invocations", json={"messages": "not a list"}) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == "messages"
            assert seen == [raw]
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


class RecordingSageMakerWorker(SageMakerWorker):
    """:class:`SageMakerWorker`, noting each ``/invocations`` body as it came and its adapter header."""

    def __init__(self, name: str, **kw) -> None:
        super().__init__(name, **kw)
        self.seen: list[tuple[bytes, str | None]] = []

    async def invoke(self, request):
        self.seen.append((await request.read(), request.headers.get("X-Amzn-SageMaker-Adapter-Identifier")))
        return await super().invoke(request)


def test_an_invocation_runs_as_the_adapter_its_sagemaker_header_names():
    """SageMaker names an ``/invocations`` request's LoRA adapter in its
    ``X-Amzn-SageMaker-Adapter-Identifier`` header; vLLM (``inject_adapter_id(adapter_path="model")``)
    runs it as that adapter, whatever the body's ``model``, and as the base model when no header
    comes. The router keys and prices it so: the base model's cached prefix is no hit for the
    adapter's request (vLLM keys adapter blocks apart), and is one for a request without the
    header, even one whose body names the adapter. The worker gets body and header as they came.
    Before, the header was ignored: the adapter's request was predicted the base model's 39
    cached tokens and routed on them (audit s31 r3 D4)."""
    async def main():
        w = RecordingSageMakerWorker("w0", steps=1, gap_s=0.0)
        await w.start()
        router, runner, url = await start_router([w], policy="tier-aware", models_refresh_s=0.2)
        try:
            w.loras = ["sql-lora"]
            await until(lambda: router.index.is_lora("sql-lora"), timeout_s=5)
            router.index.stored(0, list(range(10)), None, [3] * 40, BS, "GPU")   # the base model's blocks
            prompt = " ".join(["abc"] * 40)
            asked = [({"model": "tiny", "prompt": prompt}, "sql-lora"), ({"model": "tiny", "prompt": prompt}, None),
                     ({"model": "sql-lora", "prompt": prompt}, None)]
            predicted = []
            async with ClientSession() as s:
                for body, adapter in asked:
                    headers = {"X-Amzn-SageMaker-Adapter-Identifier": adapter} if adapter else {}
                    async with s.post(url + "/invocations", json=body, headers=headers) as r:
                        assert r.status == 200, await r.text()
                        predicted.append(r.headers["X-Kvtier-Predicted-Cached"])
            assert predicted == ["0", "39", "39"], predicted
            assert [(json.loads(raw), adapter) for raw, adapter in w.seen] == asked
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())
