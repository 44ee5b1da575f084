"""The router tokenizes with the model's own tokenizer (a real local one), so its ids are the worker's."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def test_prompt_ids_are_the_model_tokenizers(tmp_path):
    from transformers import AutoTokenizer

    from kvtier.integrations.transformers.models import VLLM_TEST_SPEC, ensure_model
    from kvtier.router.requests import PromptTokenizer, RequestError

    spec = VLLM_TEST_SPEC
    path = str(ensure_model(spec)[0])
    tok = PromptTokenizer(path)
    ref = AutoTokenizer.from_pretrained(path)
    text = "the quick brown fox jumps over the lazy dog " * 20
    assert tok.completion(text) == ref.encode(text)
    twin = tok.clone()                 # the tokenizer thread's own instance: same ids, another object
    assert twin.completion(text) == ref.encode(text) and twin.tok is not tok.tok
    assert tok.completion([text, "other"]) == ref.encode(text)        # a batch routes on its first prompt
    assert tok.completion([5, 6, 7]) == [5, 6, 7]
    with pytest.raises(RequestError):
        tok.completion({"a": 1})
    # JSON can carry a lone UTF-16 surrogate, which is no Unicode text: the client's error (a 400),
    # not a tokenizer's TypeError (a 500); the same text with the pair whole is tokenized
    for bad in ("a \ud800 b", ["\udfff"]):
        with pytest.raises(RequestError) as caught:
            tok.completion(bad)
        assert caught.value.status == 400 and caught.value.param == "prompt", caught.value
    assert tok.completion("a \U0001f600 b") == ref.encode("a \U0001f600 b")
    with pytest.raises(RequestError) as caught:     # a chat, with its model's template or without
        tok.chat([{"role": "user", "content": "a \ud800"}], {})
    assert caught.value.status == 400 and caught.value.param == "messages", caught.value
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    ids = tok.chat(messages, {})
    if ref.chat_template:
        assert ids == list(ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    else:   # no template: keyed on the contents, the same for every turn of a session
        assert ids == ref.encode("be brief\n" + text)


class SteadyStreamer:
    """An OpenAI-speaking worker stand-in that streams one chunk every 5 ms for ``chunks`` chunks."""

    def __init__(self, chunks: int = 300) -> None:
        from tests.router.test_http import free_port

        self.chunks, self.port, self.runner = chunks, free_port(), None

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/health", lambda r: web.Response())
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def complete(self, request):
        import asyncio
        import json

        from aiohttp import web

        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x"}], "usage": {"prompt_tokens": 1}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(self.chunks):
            await resp.write(f"data: {json.dumps({'choices': [{'text': 'a'}]})}\n\n".encode())
            await asyncio.sleep(0.005)
        await resp.write(b"data: [DONE]\n\n")
        return resp


def test_a_long_prompt_is_tokenized_off_the_event_loop():
    """Tokenizing a long prompt must not stall the streams the router relays meanwhile. The
    positive control does the same tokenization on the event loop and must see the stall."""
    import asyncio
    import time

    from aiohttp import ClientSession, web

    from kvtier.integrations.transformers.models import VLLM_TEST_SPEC, ensure_model
    from kvtier.router.app import Router
    from kvtier.router.config import RouterConfig, WorkerSpec
    from kvtier.router.requests import PromptTokenizer
    from tests.router.test_http import free_port

    spec = VLLM_TEST_SPEC
    tok = PromptTokenizer(str(ensure_model(spec)[0]))
    text = " ".join(f"word{i % 9973} and{i % 7}" for i in range(150_000))
    tokens = tok.completion(text)                   # warm: the first call is slower
    t0 = time.perf_counter()
    tok.completion(text)
    inline_s = time.perf_counter() - t0
    assert len(tokens) > 100_000

    async def max_gap_while(during) -> float:
        """The longest gap between chunks of a stream through the router while ``during()`` runs."""
        worker = SteadyStreamer()
        await worker.start()
        config = RouterConfig(workers=[WorkerSpec(f"http://127.0.0.1:{worker.port}", None)],
                              block_tokens=16, kv_bytes_per_token=4096, policy="round-robin", port=free_port())
        router = Router(config, tok)
        runner = router.runner()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", config.port).start()
        url = f"http://127.0.0.1:{config.port}"
        arrivals = []
        try:
            async with ClientSession() as s:
                async def stream():
                    async with s.post(url + "/v1/completions", json={"prompt": "a b", "stream": True}) as r:
                        assert r.status == 200
                        async for _ in r.content.iter_any():
                            arrivals.append(time.perf_counter())

                streaming = asyncio.ensure_future(stream())
                while len(arrivals) < 20:           # the stream is flowing
                    await asyncio.sleep(0.005)
                started = len(arrivals)
                await during(s, url)
                await streaming
        finally:
            await runner.cleanup()
            await worker.runner.cleanup()
        gaps = [b - a for a, b in zip(arrivals[started - 1:], arrivals[started:])]
        return max(gaps)

    async def long_request(s, url):
        async with s.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 1}) as r:
            assert r.status == 200, await r.text()

    async def tokenize_on_the_loop(s, url):
        tok.completion(text)                        # what the router did before: blocks the loop

    offloaded = asyncio.run(asyncio.wait_for(max_gap_while(long_request), 120))
    blocked = asyncio.run(asyncio.wait_for(max_gap_while(tokenize_on_the_loop), 120))
    print(f"tokenize {inline_s:.3f} s; longest stream gap: offloaded {offloaded:.3f} s, on the loop {blocked:.3f} s")
    # Relative, as this machine's speed varies: the positive control must see a stall, and the
    # router's own longest gap must be a small part of it.
    assert blocked > 0.1, (blocked, inline_s)
    assert offloaded < blocked / 4, (offloaded, blocked)


def test_a_prompt_without_special_tokens_is_keyed_as_vllm_tokenizes_it(tmp_path):
    """vLLM takes a completion's ``add_special_tokens`` (default true: a BOS first, for most
    models). The router always encoded with them, so a client that sends ``false`` (its prompt
    already formatted, as many clients do) had every block keyed one token off: never predicted
    a hit. A tokenizer that adds a BOS (the test model's, with a BOS template); blocks indexed as
    vLLM computes them without it. Control: the same text with special tokens, one token off, hits
    nothing."""
    import asyncio
    import json
    import shutil

    from aiohttp import ClientSession, web

    from kvtier.integrations.transformers.models import VLLM_TEST_SPEC, ensure_model
    from kvtier.router.app import Router
    from kvtier.router.config import RouterConfig, WorkerSpec
    from kvtier.router.requests import PromptTokenizer
    from tests.router.test_http import StandIn, free_port

    spec = VLLM_TEST_SPEC
    model = tmp_path / "with-bos"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_model(spec)[0] / name, model / name)
    doc = json.loads((model / "tokenizer.json").read_text())
    bos = next(t["id"] for t in doc["added_tokens"] if t["content"] == "<s>")
    doc["post_processor"] = {"type": "TemplateProcessing",
                             "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                        {"Sequence": {"id": "A", "type_id": 0}}],
                             "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                             "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}}}
    (model / "tokenizer.json").write_text(json.dumps(doc))
    tok = PromptTokenizer(str(model))
    text = " ".join(f"word{i} and{i % 7}" for i in range(300))
    plain = tok.completion(text, add_special_tokens=False)
    assert tok.completion(text) == [bos, *plain]

    async def main():
        worker = StandIn("w0")
        await worker.start()
        config = RouterConfig(workers=[WorkerSpec(worker.url)], block_tokens=16, kv_bytes_per_token=4096,
                              policy="tier-aware", port=free_port(), models_refresh_s=0)
        router = Router(config, tok)
        router.index.stored(0, list(range(len(plain) // 16)), None, plain[:len(plain) // 16 * 16], 16, "GPU")
        runner = router.runner()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", config.port).start()
        try:
            async with ClientSession() as s:
                url = f"http://127.0.0.1:{config.port}/v1/completions"
                async with s.post(url, json={"prompt": text, "add_special_tokens": False}) as r:
                    assert r.status == 200 and int(r.headers["X-Kvtier-Predicted-Cached"]) >= len(plain) - 16
                async with s.post(url, json={"prompt": text}) as r:       # control: a BOS first
                    assert r.status == 200 and r.headers["X-Kvtier-Predicted-Cached"] == "0"
        finally:
            await runner.cleanup()
            await worker.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
