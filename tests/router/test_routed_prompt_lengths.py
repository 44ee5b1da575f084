"""The prompt lengths the router priced, counted per routed request
(``kvtier_router_routed_prompt_tokens_total``) beside the requests whose length it did not know
(``kvtier_router_routed_unknown_length_requests_total``): the live planner's prompt mix, which
the workers' usage gave only for the answers that carried it (a stream without
``stream_options.include_usage``, the OpenAI clients' default, carries none). A real router on
real sockets, stand-in workers that stream usage only when asked, as vLLM does."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from aiohttp import ClientSession, web

from kvtier.cli.top import scrape
from tests.router.test_http import StandIn, run, standin_router, start_router


class UsageWhenAsked(StandIn):
    """As ``vllm serve`` answers: a stream's usage chunk only with ``stream_options.include_usage``
    (vllm/entrypoints/openai/completion/serving.py, should_include_usage); usage.prompt_tokens
    is the prompt's words (the router's WordTokenizer counts them alike)."""

    async def complete(self, request):
        body = await request.json()
        if self.fail_next:
            self.fail_next -= 1
            request.transport.close()          # dies before the first byte: the router retries
            await asyncio.sleep(1)
        self.requests += 1
        text = body.get("prompt") or " ".join(m.get("content", "") for m in body.get("messages", ()))
        n = len(text) if isinstance(text, list) else len(str(text).split())
        usage = {"prompt_tokens": n, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": n // 2}}
        if not body.get("stream"):
            return web.json_response({"id": "x", "object": "text_completion", "choices": [{"text": "a b c"}],
                                      "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for tok in ("a", "b", "c"):
            await resp.write(f"data: {json.dumps({'choices': [{'text': tok}]})}\n\n".encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


@contextlib.asynccontextmanager
async def router_over(names, **kw):
    """:class:`UsageWhenAsked` workers behind a real router; yields (workers, router, url, session)."""
    workers = [UsageWhenAsked(name) for name in names]
    for w in workers:
        await w.start()
    router, runner, url = await start_router(workers, policy="round-robin", **kw)
    try:
        async with ClientSession() as s:
            yield workers, router, url, s
    finally:
        await runner.cleanup()
        for w in workers:
            await w.stop()


def words(n: int) -> str:
    return " ".join(["word"] * n)


async def counters(url: str) -> dict[str, dict[str, float]]:
    """The router's per-worker counters as the planner scrapes them (real /metrics text)."""
    samples = await asyncio.to_thread(scrape, url)
    assert samples.up, samples.error
    return {name: samples.by(name + "_total", "worker")
            for name in ("kvtier_router_requests", "kvtier_router_routed_prompt_tokens",
                         "kvtier_router_routed_unknown_length_requests", "kvtier_router_prompt_tokens",
                         "kvtier_router_usage_answers")}


async def post(s, url: str, path: str, body: dict) -> str:
    async with s.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["X-Kvtier-Worker"]


def test_streams_without_usage_count_the_prompt_lengths_the_router_priced():
    """Completions and chats streamed without include_usage: the usage counters do not move (the
    planner saw no prompt length at all), the routed prompt tokens grow by each prompt's length,
    once per request, under the worker that served it."""
    async def main():
        async with router_over(["a"]) as ([w], _, url, s):
            before = await counters(url)
            for n in (10, 200, 35, 1):
                await post(s, url, "/v1/completions", {"prompt": words(n), "stream": True})
            await post(s, url, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": words(50)}], "stream": True})
            await post(s, url, "/v1/completions", {"prompt": list(range(7)), "stream": True})   # token ids
            return before, await counters(url), w.url

    before, after, w = run(main())
    assert before["kvtier_router_routed_prompt_tokens"] == {}      # a fresh router: no series yet
    assert after["kvtier_router_requests"] == {w: 6.0}
    assert after["kvtier_router_routed_prompt_tokens"] == {w: 10 + 200 + 35 + 1 + 50 + 7}
    assert after["kvtier_router_routed_unknown_length_requests"] == {w: 0.0}   # set, at 0: all known
    # what the planner had before: nothing (no answer carried usage)
    assert after["kvtier_router_prompt_tokens"].get(w, 0.0) == 0.0
    assert after["kvtier_router_usage_answers"].get(w, 0.0) == 0.0


def test_a_retried_request_counts_once_under_the_worker_that_answered():
    """A worker that dies before its first byte: the request goes to another. Its length counts
    once (not per attempt), beside the one routed request, under the worker that answered."""
    async def main():
        async with router_over(["a", "b"]) as ((a, b), router, url, s):
            a.fail_next = 1                        # a dies before the first byte of its first request
            served = [await post(s, url, "/v1/completions", {"prompt": words(n), "stream": True})
                      for n in (40, 30, 20, 10)]
            return (a.url, b.url), served, await counters(url), router.metrics.retries._value.get()

    (a, b), served, after, retries = run(main())
    assert retries == 1                                         # one request went to b after a failed it
    assert sum(after["kvtier_router_requests"].values()) == 4
    assert sum(after["kvtier_router_routed_prompt_tokens"].values()) == 100   # 40 + 30 + 20 + 10, once each
    for url in (a, b):   # under the worker that answered
        lengths = sum(n for n, w in zip((40, 30, 20, 10), served) if w == url)
        assert after["kvtier_router_routed_prompt_tokens"].get(url, 0.0) == lengths
    assert sum(after["kvtier_router_routed_unknown_length_requests"].values()) == 0


def test_the_whole_length_is_counted_past_max_route_tokens():
    """Only ``max_route_tokens`` leading tokens are keyed; the whole prompt is priced and counted:
    token ids exactly, a text cut before tokenizing by the share of it tokenized."""
    async def main():
        async with router_over(["a"], max_route_tokens=16) as ([w], _, url, s):
            await post(s, url, "/v1/completions", {"prompt": list(range(1000)), "stream": True})
            ids = (await counters(url))["kvtier_router_routed_prompt_tokens"][w.url]
            await post(s, url, "/v1/completions", {"prompt": words(500), "stream": True})
            return ids, (await counters(url))["kvtier_router_routed_prompt_tokens"][w.url]

    ids, both = run(main())
    assert ids == 1000
    assert both - ids == pytest.approx(500, rel=0.1)   # estimated from the 64 characters tokenized


def test_requests_of_unknown_length_are_counted_apart():
    """The router keys no prompt for the Responses API, vLLM's other endpoints, prompt embeddings
    or a Messages request no worker renders: counted in the unknown-length counter, nothing in
    the tokens. Control: a Messages request a worker renders counts its rendered length."""
    async def main():
        async with standin_router(["w0"], policy="round-robin") as ([w], _, url, s):
            await post(s, url, "/v1/responses", {"model": "tiny", "input": words(30)})
            await post(s, url, "/v1/embeddings", {"model": "tiny", "input": words(30)})
            await post(s, url, "/v1/completions", {"model": "tiny", "prompt_embeds": "AAAA"})
            body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            await post(s, url, "/v1/messages", body)               # no worker renders (403)
            unknown = await counters(url)
            w.rendered_messages = [5] * 12
            await post(s, url, "/v1/messages", body)
            rendered = await counters(url)
            return w.url, unknown, rendered

    w, unknown, rendered = run(main())
    assert unknown["kvtier_router_requests"] == {w: 4.0}
    assert unknown["kvtier_router_routed_unknown_length_requests"] == {w: 4.0}
    assert unknown["kvtier_router_routed_prompt_tokens"] == {w: 0.0}
    assert rendered["kvtier_router_routed_unknown_length_requests"] == {w: 4.0}
    assert rendered["kvtier_router_routed_prompt_tokens"] == {w: 12.0}
