"""The router read as vLLM reads a request (audit s30 a4): a completion batch's load, ``stream``
and ``echo`` as its pydantic models read a boolean, token ids written as floats, the client's
body ``request_id``, and the paths every vLLM API server answers. Real sockets, the real
``Router`` app, stand-in workers as in test_http.py; no vLLM."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import NamedTuple

import pytest
from aiohttp import ClientSession, FormData, web

from tests.router.test_http import (BS, Deaf, distinct, free_port, leave_early, one_worker_router, run,
                                    start_router, until)

CHAT = {"messages": [{"role": "user", "content": " ".join(["abc"] * 40)}]}
COMPLETION = {"prompt": " ".join(["abc"] * 40)}


class Seen(NamedTuple):
    method: str
    path: str
    headers: dict
    body: bytes


class Recorder:
    """A worker that answers every path and keeps what it was sent. A completion or a chat waits
    until ``release`` is set (a prefill in progress: its tokens stay queued on the router's
    side), then answers whole, or streams when ``stream`` is what vLLM reads as true."""

    def __init__(self, name: str) -> None:
        self.name, self.port = name, free_port()
        self.seen: list[Seen] = []
        self.down = False
        self.release = asyncio.Event()
        self.release.set()
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def got(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.path == path]

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.answer)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        self.release.set()
        await self.runner.cleanup()

    async def answer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if request.path == "/health":
            return web.Response(status=503 if self.down else 200)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "tiny", "parent": None}]})
        self.seen.append(Seen(request.method, request.path, dict(request.headers), raw))
        if request.path == "/version":
            return web.json_response({"version": "0.test", "worker": self.name})
        if request.path not in ("/v1/completions", "/v1/chat/completions"):
            return web.json_response({"worker": self.name, "path": request.path})
        await self.release.wait()
        if json.loads(raw).get("stream") not in (True, "true", 1, "on"):
            return web.json_response({"id": "x", "worker": self.name, "choices": [{"text": "a"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')
        return resp


@contextlib.asynccontextmanager
async def recorders_router(names, **kw):
    """Recording workers behind a real router; yields (workers, router, url, client session)."""
    workers = [Recorder(name) for name in names]
    for w in workers:
        await w.start()
    router, runner, url = await start_router(workers, **kw)
    try:
        async with ClientSession() as s:
            yield workers, router, url, s
    finally:
        await runner.cleanup()
        for w in workers:
            await w.stop()


async def post(s: ClientSession, url: str, body: dict) -> tuple[int, str | None]:
    async with s.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status, r.headers.get("X-Kvtier-Worker")


# --- D1: a completion batch is priced as all its prompts ------------------------------------------
def test_a_worker_holding_a_batch_is_priced_for_every_prompt_of_it():
    """vLLM runs each prompt of a completion batch as an engine request of its own, but the
    router counted the batch as its first prompt: a worker holding 16 prompts of 100 tokens
    looked as loaded as one holding 100 tokens, and was chosen again over one holding 400.
    Control: the lighter queue (400 tokens) gets the next request."""
    async def main():
        async with recorders_router(["a", "b"]) as (workers, router, url, s):
            for w in workers:
                w.release.clear()                               # every prefill still in progress
            batch = asyncio.ensure_future(post(s, url, {"prompt": [[7] * 100] * 16}))
            await until(lambda: any(w.got("/v1/completions") for w in workers))
            holder = next(i for i, w in enumerate(workers) if w.got("/v1/completions"))
            assert router.workers[holder].pending_tokens == 1600
            single = asyncio.ensure_future(post(s, url, {"prompt": [5] * 400}))
            await until(lambda: router.workers[1 - holder].pending_tokens == 400)
            nxt = asyncio.ensure_future(post(s, url, {"prompt": [9] * 100}))
            await until(lambda: sum(len(w.got("/v1/completions")) for w in workers) == 3)
            assert len(workers[1 - holder].got("/v1/completions")) == 2, "the next went to the batch's worker"
            for w in workers:
                w.release.set()
            for task in (batch, single, nxt):
                assert (await task)[0] == 200
            # the tokens priced per routed request, the planner's prompt mix: the batch's whole
            routed = router.metrics.routed_prompt_tokens
            assert routed.labels(workers[holder].url)._value.get() == 1600
    run(main())


@pytest.mark.parametrize("extra, tokens", [({}, 4 * 100), ({"truncate_prompt_tokens": 30}, 4 * 30),
                                           ({"truncate_prompt_tokens": "30"}, 4 * 30)])
def test_a_batch_of_texts_is_priced_from_its_first_texts_tokens_per_character(extra, tokens):
    """A batch of texts: its first is tokenized, the others priced at its tokens per character
    (tokenizing every one would cost the router what the batch costs a worker), each cut to
    ``truncate_prompt_tokens`` as vLLM cuts each prompt. (The stand-in tokenizer gives a token per
    word: 100 words of 3 letters, 399 characters, are 100 tokens.)"""
    async def main():
        async with recorders_router(["a"]) as ([w], router, url, s):
            w.release.clear()
            task = asyncio.ensure_future(post(s, url, {"prompt": [" ".join(["abc"] * 100)] * 4, **extra}))
            await until(lambda: w.got("/v1/completions"))
            assert router.workers[0].pending_tokens == tokens
            w.release.set()
            assert (await task)[0] == 200
    run(main())


def test_a_streamed_batchs_first_byte_is_no_sample_of_the_prefill_speed():
    """A batch's first byte ends its first prompt's prefill, not the batch's: taken as a sample
    of the whole batch's tokens it would price prefills too fast (as the first prompt's, they
    were priced too slow). Control: a single streamed prompt on an idle worker is a sample."""
    async def main():
        async with recorders_router(["a"]) as ([w], router, url, s):
            assert (await post(s, url, {"prompt": [[1] * 64, [2] * 64], "stream": True}))[0] == 200
            assert router.speed.n == 0 and router.workers[0].speed.n == 0
            assert (await post(s, url, {"prompt": [3] * 64, "stream": True}))[0] == 200
            assert router.speed.n == 1                          # control
    run(main())


# --- D2: "stream" as vLLM reads it --------------------------------------------------------------
@pytest.mark.parametrize("stream, held", [(True, True), ("true", True), (1, True), ("on", True), ("false", False)])
def test_a_stream_asked_for_as_vllm_reads_a_boolean_is_held_for_admission(stream, held):
    """vLLM's pydantic models read ``"true"``, ``1``, ``"on"`` as ``stream: true``; the router
    took only ``true`` for a stream, so such a stream skipped admission (sent at once beside a
    prefill in progress) and its first byte gave no prefill sample. Controls: ``true``; and
    ``"false"``, a whole answer, which is never held."""
    async def main():
        async with recorders_router(["a"], admission_tokens=1) as ([w], router, url, s):
            w.release.clear()
            tasks = [asyncio.ensure_future(post(s, url, {"prompt": f"x{i} y z w", "stream": stream}))
                     for i in range(2)]
            await until(lambda: len(w.got("/v1/completions")) == 2 or router._held() == 1)
            await asyncio.sleep(0.2)
            assert (len(w.got("/v1/completions")), router._held()) == ((1, 1) if held else (2, 0))
            w.release.set()
            assert [(await t)[0] for t in tasks] == [200, 200]
            assert (router.speed.n > 0) == held   # a stream's first byte is its prefill's end
    run(main())


# --- D3: requests vLLM serves without reading its prefix cache -----------------------------------
@pytest.mark.parametrize("path, extra, reads", [
    ("/v1/chat/completions", {"echo": True}, False),                       # top_logprobs: 0 by default
    ("/v1/chat/completions", {"echo": "true", "top_logprobs": None}, False),
    ("/v1/completions", {"echo": 1, "logprobs": 1}, False),
    ("/v1/completions", {"echo": "true", "logprobs": 0}, False),
    ("/v1/completions", {"echo": 1}, True),                                # no logprobs: reads it
    ("/v1/chat/completions", {"echo": "false", "top_logprobs": 2, "logprobs": True}, True)])
def test_a_request_vllm_serves_without_its_prefix_cache_is_predicted_no_hit(path, extra, reads):
    """vLLM skips reading its prefix cache when a request has prompt logprobs: a chat that
    echoes always has them (its ``top_logprobs``, 0 when absent or null), a completion that
    echoes has its ``logprobs``, and ``echo`` is read as pydantic reads a boolean (``1``,
    ``"true"``). The router predicted these prefixes as hits. Controls: a completion that echoes
    without logprobs, and a chat whose echo is false, read the cache."""
    async def main():
        async with one_worker_router(policy="tier-aware") as (w, router, url, s):
            router.index.stored(0, list(range(10)), None, [3] * 40, BS, "GPU")
            body = COMPLETION if path == "/v1/completions" else CHAT
            async with s.post(url + path, json={**body, **extra}) as r:
                assert r.status == 200
                predicted = int(r.headers["X-Kvtier-Predicted-Cached"])
            assert (predicted > 0) == reads, predicted
    run(main())


# --- D4: token ids written as floats --------------------------------------------------------------
@pytest.mark.parametrize("prompt, hit", [([3.0] * 40, True), ([[3.0] * 40, [1.0, 2.0]], True),
                                         ([3] * 39 + ["3"], True), ([True] + [3] * 39, False)])
def test_token_ids_vllm_reads_as_ints_are_routed_as_those_ints_and_forwarded_as_sent(prompt, hit):
    """``[3.0, ...]`` is what a numpy or torch float array gives after ``tolist()``; vLLM's pydantic
    model reads it (and ``"3"``, ``true``) as ints, but the router refused it 400. It is routed on
    the ints (its cached prefix, forty 3s, predicted as a hit; ``true`` is 1, another prefix) and
    forwarded byte for byte."""
    async def main():
        async with recorders_router(["a"], policy="tier-aware") as ([w], router, url, s):
            router.index.stored(0, list(range(10)), None, [3] * 40, BS, "GPU")
            raw = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
            async with s.post(url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200, await r.text()
                predicted = int(r.headers["X-Kvtier-Predicted-Cached"])
            assert w.got("/v1/completions")[0].body == raw
            assert (predicted > 0) == hit, predicted
    run(main())


@pytest.mark.parametrize("prompt", [[1.5, 2.0], [[1.0], [2.5]], [-1.0], [1e20], [2.0 ** 32]])
def test_token_ids_vllm_refuses_are_still_refused(prompt):
    """What vLLM refuses stays the router's 400 (a fraction, a negative id, one past 2**32)."""
    async def main():
        async with recorders_router(["a"]) as ([w], router, url, s):
            async with s.post(url + "/v1/completions", json={"prompt": prompt}) as r:
                answer = await r.json()
                assert r.status == 400 and answer["error"]["param"] == "prompt", answer
            assert w.got("/v1/completions") == []
    run(main())


# --- D5: the client's body request_id ------------------------------------------------------------
class NamingDeaf(Deaf):
    """:class:`Deaf`, keeping the ``X-Request-Id`` header each request came with."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.headers: list[str | None] = []

    async def complete(self, request):
        self.headers.append(request.headers.get("X-Request-Id"))
        return await super().complete(request)


@pytest.mark.parametrize("own", ["job 42 / step 7", "réq-1", "t" * 300, "job-1\r\nX-Evil: 1"])
def test_a_body_request_id_names_the_request_on_its_worker_as_it_would_direct(own):
    """vLLM names a request by its body's ``request_id`` when no ``X-Request-Id`` header comes.
    The router replaced one that is no header value (a space, non-ASCII, over 256 characters)
    with its own, sent as the header, which vLLM prefers: the answer's ``id`` and the worker's
    logs named the router's uuid. Now no header is sent, and an abort names the body's id."""
    async def main():
        w = NamingDeaf("w0")
        await w.start()
        router, runner, url = await start_router([w])
        try:
            async with ClientSession() as s:
                w.steps = 1
                async with s.post(url + "/v1/completions", json={"prompt": "a b", "request_id": own}) as r:
                    answer = await r.json()
                    assert answer["id"] == f"cmpl-{own}-0" and w.headers == [None], (answer, w.headers)
                    # echoed only as a short header-safe token (test_ids_batches_and_counts.py); never
                    # an injected header
                    assert r.headers.get("X-Request-Id") is None
                    assert "X-Evil" not in r.headers
                w.steps = 30
                await leave_early(s, url, "/v1/completions", {"prompt": "a b", "request_id": own}, worker=w)
                await until(lambda: w.aborted == 1)
                assert [p["request_ids"] for p in distinct(w.abort_posts)] == [[f"cmpl-{own}-0"]]
                assert router._names == {}
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


# --- D6: the paths every vLLM API server answers ------------------------------------------------
def test_vllms_probe_version_load_and_pooling_paths_are_answered():
    """``/ping`` (SageMaker's probe, GET and POST), ``/version``, ``/load``, ``/invocations``,
    ``/v2/embed`` and ``/generative_scoring`` answered the router's 404. ``/ping`` is answered as
    ``/health``; ``/version`` comes from a healthy worker; ``/load`` is the router's own (the
    requests it is forwarding now); the others are forwarded on load, body unchanged."""
    async def main():
        async with recorders_router(["a", "b"]) as ((a, b), router, url, s):
            for method in ("GET", "POST"):
                async with s.request(method, url + "/ping") as r:
                    assert r.status == 200 and (await r.json())["status"] == "ok"
            b.down = True
            await until(lambda: not router.workers[1].healthy)
            for _ in range(3):
                async with s.get(url + "/version") as r:
                    assert r.status == 200 and await r.json() == {"version": "0.test", "worker": "a"}
            b.down = False
            await until(lambda: router.workers[1].healthy)
            for path in ("/invocations", "/v2/embed", "/generative_scoring"):
                raw = json.dumps({"model": "tiny", "texts": ["x"], "path": path}).encode()
                async with s.post(url + path, data=raw, headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 200 and (await r.json())["path"] == path
                assert [seen.body for seen in a.got(path) + b.got(path)] == [raw]
            async with s.get(url + "/load") as r:
                assert await r.json() == {"server_load": 0}
            a.release.clear()
            b.release.clear()
            held = asyncio.ensure_future(post(s, url, {"prompt": "a b"}))
            await until(lambda: a.got("/v1/completions") or b.got("/v1/completions"))
            async with s.get(url + "/load") as r:
                assert await r.json() == {"server_load": 1}
            a.release.set()
            b.release.set()
            assert (await held)[0] == 200
    run(main())


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/audio/translations"])
def test_a_multipart_audio_request_is_forwarded_as_it_came(path):
    """A speech-to-text request is a multipart form (the audio file and its fields), which the
    router refused as no JSON (a 404 before that). It is forwarded unparsed, with its form's
    content type (the boundary), to a worker chosen on load."""
    async def main():
        async with recorders_router(["a"]) as ([w], router, url, s):
            form = FormData()
            form.add_field("file", b"RIFF\x00\x01audio", filename="a.wav", content_type="audio/wav")
            form.add_field("model", "tiny")
            async with s.post(url + path, data=form) as r:
                assert r.status == 200 and (await r.json())["path"] == path
            [seen] = w.got(path)
            assert seen.headers["Content-Type"].startswith("multipart/form-data; boundary=")
            assert b"RIFF\x00\x01audio" in seen.body and b'name="model"' in seen.body
    run(main())
