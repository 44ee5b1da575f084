"""Requests a worker refuses (vLLM's 400 for a prompt over ``max_model_len``, aiohttp's 413 for a
body over its limit) ran no prefill: they are counted apart
(``kvtier_router_refused_requests_total{worker,status}``), never as routed with the length the
router priced, which the live planner sized its prefill pool on (audit s30 a7 D2: five refused
450k-token prompts moved the mean prompt from 80 to 160,766 tokens and the pool from 1 to 9).
A real router on real sockets, a stand-in worker that refuses as vLLM does, the planner's own
scrape and observation."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import ClientSession, web

from kvtier.cli.top import scrape
from kvtier.planner.observe import RouterCounters, observation_between
from tests.router.test_http import run, start_router
from tests.router.test_routed_prompt_lengths import UsageWhenAsked, words

MAX_MODEL_LEN = 100


class RefusesLongPrompts(UsageWhenAsked):
    """``vllm serve --max-model-len 100``: a longer prompt is answered 400 before any prefill.
    Its aiohttp server refuses a body over 1 MiB with a 413, as the a7 audit's stand-in did."""

    async def complete(self, request):
        body = await request.json()
        if len(str(body.get("prompt", "")).split()) > MAX_MODEL_LEN:
            return web.json_response({"error": {"message": f"This model's maximum context length is "
                                                           f"{MAX_MODEL_LEN} tokens", "type": "BadRequestError",
                                                "code": 400}}, status=400)
        return await super().complete(request)


@contextlib.asynccontextmanager
async def refusing_router():
    worker = RefusesLongPrompts("w")
    await worker.start()
    router, runner, url = await start_router([worker], policy="round-robin")
    try:
        async with ClientSession() as s:
            yield worker, url, s
    finally:
        await runner.cleanup()
        await worker.stop()


async def post(s, url: str, body: dict) -> int:
    async with s.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status


def test_refused_requests_are_counted_apart_and_stay_out_of_the_planners_prompt_mix():
    async def main():
        async with refusing_router() as (w, url, s):
            before = await asyncio.to_thread(scrape, url)
            served = [await post(s, url, {"prompt": words(20)}) for _ in range(3)]
            served.append(await post(s, url, {"prompt": words(30), "stream": True}))
            refused = [await post(s, url, {"prompt": words(500)}) for _ in range(2)]
            refused.append(await post(s, url, {"prompt": words(220_000)}))   # 1.1 MB: over aiohttp's 1 MiB
            return served, refused, before, await asyncio.to_thread(scrape, url), w.url

    served, refused, before, after, worker = run(main())
    assert served == [200] * 4 and refused == [400, 400, 413]      # control: the worker refused three
    assert after.by("kvtier_router_requests_total", "worker") == {worker: 4.0}
    assert after.by("kvtier_router_routed_prompt_tokens_total", "worker") == {worker: 3 * 20 + 30}
    assert after.by("kvtier_router_routed_unknown_length_requests_total", "worker") == {worker: 0.0}
    assert after.by("kvtier_router_refused_requests_total", "status") == {"400": 2.0, "413": 1.0}
    assert after.by("kvtier_router_refused_requests_total", "worker") == {worker: 3.0}
    # what the planner reads of the interval: the four prompts the worker ran, at their rate
    obs = observation_between(RouterCounters.from_samples(0.0, before), RouterCounters.from_samples(10.0, after), 8)
    assert obs.request_rate == 0.4
    assert set(obs.input_tokens) == {round(90 / 4)}


def test_a_refused_stream_is_no_sample_of_the_workers_prefill_speed():
    """A stream the worker refuses (400: no prefill ran) answered its first byte at once: taken as
    the end of a 5,000-token prefill, one set an idle worker's prefill speed to 5.9M tokens/s. A
    served stream (the control) is a sample."""

    async def main():
        async with refusing_router() as (_worker, url, s):
            refused = await post(s, url, {"prompt": words(5000), "stream": True})
            after_refused = (await asyncio.to_thread(scrape, url)).by("kvtier_router_worker_prefill_tokens_per_s",
                                                                      "worker")
            served = await post(s, url, {"prompt": words(50), "stream": True})
            after_served = (await asyncio.to_thread(scrape, url)).by("kvtier_router_worker_prefill_tokens_per_s",
                                                                     "worker")
            return refused, after_refused, served, after_served

    refused, after_refused, served, after_served = run(main())
    assert (refused, served) == (400, 200)
    assert list(after_refused.values()) == [0.0], after_refused
    assert list(after_served.values())[0] > 0.0, after_served
