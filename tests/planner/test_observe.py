"""Router counters → planner observations (rate, prompt mean, hit rate), resets refused."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import ClientSession, web

from kvtier.cli.top import scrape
from kvtier.planner.observe import RouterCounters, observation_between
from tests.router.test_http import StandIn, run, start_router


def test_deltas_give_rate_prompt_mix_and_hit_rate():
    obs = observation_between(RouterCounters(10.0, 100, 200_000, 50_000),
                              RouterCounters(20.0, 150, 300_000, 90_000), output_tokens=128)
    assert obs.request_rate == pytest.approx(5.0)
    assert set(obs.input_tokens) == {2000}
    assert obs.hit_rate == pytest.approx(0.4)


def test_a_restarted_router_is_a_new_baseline_not_a_negative_rate():
    assert observation_between(RouterCounters(10.0, 100, 1000, 10), RouterCounters(20.0, 3, 30, 0), 64) is None
    idle = observation_between(RouterCounters(10.0, 5, 100, 0), RouterCounters(20.0, 5, 100, 0), 64)
    assert idle.request_rate == 0.0


PROMPT_WORDS = 200


class VllmLikeStandIn(StandIn):
    """As `vllm serve` answers /v1/completions: the final usage chunk of a stream only with
    ``stream_options.include_usage`` (vllm/entrypoints/openai/completion/serving.py,
    should_include_usage); a non-streamed answer always carries usage. Prompt tokens are the
    prompt's words; half of them cached."""

    async def complete(self, request):
        body = await request.json()
        self.requests += 1
        n = len(str(body.get("prompt", "")).split())
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


def test_mean_prompt_is_not_diluted_by_streams_that_carry_no_usage():
    """The router counts every routed request but prompt tokens only for answers that carry usage:
    each stream whose client did not ask for include_usage (the OpenAI clients' default) counted as
    a 0-token prompt, and the planner sized prefill for prompts half as long (all streamed: 1 token).
    A real router on a real socket, a worker that streams usage only when asked, as vLLM does."""
    async def main():
        worker = VllmLikeStandIn("w0")
        await worker.start()
        router, runner, url = await start_router([worker], policy="round-robin")
        try:
            before = RouterCounters.from_samples(0.0, await asyncio.to_thread(scrape, url))
            prompt = " ".join(["word"] * PROMPT_WORDS)
            async with ClientSession() as s:
                for stream in (True, False) * 4:
                    async with s.post(url + "/v1/completions", json={"prompt": prompt, "stream": stream}) as r:
                        assert r.status == 200
                        await r.read()
            after = RouterCounters.from_samples(10.0, await asyncio.to_thread(scrape, url))
            return observation_between(before, after, output_tokens=3)
        finally:
            await runner.cleanup()
            await worker.stop()

    obs = run(main())
    assert obs is not None and obs.request_rate == pytest.approx(0.8)
    mean_prompt = sum(obs.input_tokens) / len(obs.input_tokens)
    assert mean_prompt == pytest.approx(PROMPT_WORDS, rel=0.1), \
        f"every prompt had {PROMPT_WORDS} tokens; the planner sizes for {mean_prompt:.0f}"
    assert obs.hit_rate == pytest.approx(0.5, abs=0.01)
