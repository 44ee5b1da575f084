"""Chats a worker renders, through a real router: the router's front door, its ``/tokenize`` call
to a worker whose ``/tokenize`` is vLLM's own (ServingTokenization, in-process over the test's
tiny tokenizers: tests/router/_vllm_ref.py), and the blocks it predicts a hit on. The worker's
``/v1/chat/completions`` refuses what vLLM refuses and holds, in the router's index, the blocks of
the prompt vLLM runs for the chat: a router that keys the chat's own ids predicts all of them
(less the last token, which no request finds cached). Blocks are two tokens: the prediction then
counts nearly every token the router's keys share with the chat's (all but an odd last one)."""

from __future__ import annotations

import contextlib
import re

import pytest
from aiohttp import ClientSession, web

pytest.importorskip("transformers")
pytest.importorskip("vllm")

from kvtier.router.app import Router  # noqa: E402
from kvtier.router.config import RouterConfig, WorkerSpec  # noqa: E402
from kvtier.router.requests import PromptTokenizer  # noqa: E402
from tests.router._vllm_ref import AGENT, DOCUMENTS, LLAMA3, SYSTEM_EFFORT, make_model, vllm_render, vllm_tokenize  # noqa: E402
from tests.router.test_http import StandIn, free_port, run  # noqa: E402

TEMPLATES = {"llama3": (LLAMA3, True), "effort": (SYSTEM_EFFORT, True), "documents": (DOCUMENTS, True),
             "agent": (AGENT, False)}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
BLOCK = 2
TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Paris?"},
         {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Check the tool."},
         {"role": "user", "content": "and tomorrow?"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {name: make_model(root, name, template, bos=bos) for name, (template, bos) in TEMPLATES.items()}


class VllmWorker(StandIn):
    """A worker whose ``/tokenize`` answers as vLLM's does and whose ``/v1/chat/completions``
    refuses what vLLM refuses (400); ``renders`` False: its ``/tokenize`` takes no chat (404),
    so the router renders the chat itself."""

    def __init__(self, name: str, model_path: str) -> None:
        super().__init__(name)
        self.model_path = model_path
        self.renders = True

    async def tokenize(self, request):
        body = await request.json()
        if "messages" in body:
            self.tokenized.append(body)
            if not self.renders:
                return web.json_response({"error": {"message": "not found"}}, status=404)
        status, answer = await vllm_tokenize(self.model_path, body)
        return web.json_response(answer, status=status)

    async def complete(self, request):
        if request.path == "/v1/chat/completions":
            try:
                await vllm_render(self.model_path, "chat", await request.json())
            except Exception as exc:  # noqa: BLE001 - vLLM's refusal: its 400
                return web.json_response({"error": {"message": str(exc), "code": 400}}, status=400)
        return await super().complete(request)


@contextlib.asynccontextmanager
async def vllm_worker_router(model_path: str):
    """A router keying with the model's tokenizer, two-token blocks, in front of one
    :class:`VllmWorker`."""
    w = VllmWorker("w0", model_path)
    await w.start()
    config = RouterConfig(workers=[WorkerSpec(w.url)], block_tokens=BLOCK, kv_bytes_per_token=4096,
                          health_interval_s=0.2, port=free_port())
    router = Router(config, PromptTokenizer(model_path))
    runner = router.runner()
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", config.port).start()
    try:
        async with ClientSession() as s:
            yield w, router, f"http://127.0.0.1:{config.port}", s
    finally:
        await runner.cleanup()
        await w.stop()


async def routed_tokens(s: ClientSession, url: str) -> float:
    text = await (await s.get(url + "/metrics")).text()
    return sum(float(v) for v in re.findall(r"^kvtier_router_routed_prompt_tokens_total\{[^}]*\} (\S+)$", text, re.M))


def assert_keyed_as_the_chat_runs(model_path: str, body: dict, worker_renders: bool = True) -> None:
    """``body`` sent to the router: it predicts every block of the prompt vLLM runs for it (held
    by the worker) and prices that prompt's length; the worker was asked to render it (or, where
    it cannot, the router rendered it itself)."""
    async def main():
        runs = await vllm_render(model_path, "chat", body)
        async with vllm_worker_router(model_path) as (w, router, url, s):
            w.renders = worker_renders
            router.index.stored(0, list(range(len(runs) // BLOCK)), None, runs, BLOCK, "GPU")
            async with s.post(url + "/v1/chat/completions", json={"model": "tiny", **body}) as r:
                assert r.status == 200, await r.text()
                predicted = int(r.headers["X-Kvtier-Predicted-Cached"])
            assert len(w.tokenized) == 1
            assert (predicted, await routed_tokens(s, url)) == (len(runs) - 1, len(runs)), \
                f"keyed {predicted} of the chat's {len(runs)} tokens"
    run(main())


@pytest.mark.parametrize("name, extra", [
    ("effort", {"tools": TOOLS, "reasoning_effort": "none"}),
    ("agent", {"tools": TOOLS, "reasoning_effort": "none"}),
    ("agent", {"tools": TOOLS}),
    ("documents", {"documents": [{"title": "Paris", "text": "Sunny all week, 21C."}]})],
    ids=["effort-header", "effort-thinking", "thinking-turns", "documents"])
def test_a_chat_a_worker_renders_is_keyed_as_the_chat_runs(models, name, extra):
    """An agent's chat (tools, a reasoning effort, the assistant's thinking turns) or a RAG chat
    (documents): the router asks a worker's /tokenize, whose request has no ``documents`` or
    ``reasoning_effort`` and never renames ``reasoning_content``. Sent the chat as it came, the
    worker rendered another prompt than the chat runs (block 0 keyed wrong for an effort in the
    system header, every block for documents, every block from a thinking turn on)."""
    assert_keyed_as_the_chat_runs(models[name], {"messages": TURNS, **extra})


def test_a_truncated_chat_a_worker_renders_keeps_its_bos(models):
    """``add_special_tokens`` + ``truncate_prompt_tokens`` N (no side): vLLM keeps the BOS it
    adds, ``[BOS] + the last N-1``; the router keyed the last N of the worker's ids."""
    body = {"messages": TURNS * 3, "add_special_tokens": True, "truncate_prompt_tokens": 40}
    assert_keyed_as_the_chat_runs(models["llama3"], body)


@pytest.mark.parametrize("extra", [{}, {"truncate_prompt_tokens": 40}, {"truncate_prompt_tokens": 40,
                                                                       "truncation_side": "right"}])
def test_a_chat_asking_for_special_tokens_is_keyed_with_them_when_no_worker_renders(models, extra):
    """The router's own rendering (no worker's /tokenize answers) took no special tokens for a
    chat asking ``add_special_tokens``, and truncated it past its BOS."""
    body = {"messages": TURNS * 3, "add_special_tokens": True, **extra}
    assert_keyed_as_the_chat_runs(models["llama3"], body, worker_renders=False)


def test_a_text_chat_is_rendered_by_the_router(models):
    """Control: a chat of text alone is rendered by the router itself, and keyed as it runs."""
    async def main():
        body = {"messages": [{"role": "user", "content": "hi"}]}
        runs = await vllm_render(models["llama3"], "chat", body)
        async with vllm_worker_router(models["llama3"]) as (w, router, url, s):
            router.index.stored(0, list(range(len(runs) // BLOCK)), None, runs, BLOCK, "GPU")
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200 and int(r.headers["X-Kvtier-Predicted-Cached"]) == len(runs) - 1
            assert w.tokenized == []
    run(main())


async def answered(model_path: str, path: str, body: dict) -> tuple[int, str]:
    async with vllm_worker_router(model_path) as (w, router, url, s):
        async with s.post(url + path, json={"model": "tiny", **body}) as r:
            return r.status, await r.text()


@pytest.mark.parametrize("kind", [["text"], {"t": 1}])
def test_a_part_whose_type_is_no_string_is_answered_400(models, kind):
    """A content part whose ``type`` is a list or an object: vLLM answers 400; the router
    answered 500 (TypeError: unhashable, in worker_renders)."""
    body = {"messages": [{"role": "user", "content": [{"type": kind, "text": "a"}]}]}
    status, text = run(answered(models["llama3"], "/v1/chat/completions", body))
    assert status == 400, text


@pytest.mark.parametrize("n", [10 ** 30, 2 ** 64])
def test_truncate_prompt_tokens_past_int64_is_answered_400(models, n):
    """vLLM takes ``truncate_prompt_tokens`` up to 2**63-1 (a 400 past it); the router's tokenizer
    raised OverflowError past 2**64 (a 500)."""
    status, text = run(answered(models["llama3"], "/v1/completions", {"prompt": "a b", "truncate_prompt_tokens": n}))
    assert status == 400 and '"param": "truncate_prompt_tokens"' in text, text
