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


# --- an interval whose answers carry no usage (s27 P1) ----------------------------------------

def _interval(streams: list[bool]):
    """The observation over one 10 s interval in which ``streams`` requests went through a real
    router to a worker that streams usage only when asked (True: streamed, no include_usage)."""
    async def main():
        worker = VllmLikeStandIn("w0")
        await worker.start()
        router, runner, url = await start_router([worker], policy="round-robin")
        try:
            before = RouterCounters.from_samples(0.0, await asyncio.to_thread(scrape, url))
            prompt = " ".join(["word"] * PROMPT_WORDS)
            async with ClientSession() as s:
                for stream in streams:
                    async with s.post(url + "/v1/completions", json={"prompt": prompt, "stream": stream}) as r:
                        assert r.status == 200
                        await r.read()
            after = RouterCounters.from_samples(10.0, await asyncio.to_thread(scrape, url))
            return observation_between(before, after, output_tokens=3)
        finally:
            await runner.cleanup()
            await worker.stop()

    return run(main())


def test_an_interval_whose_answers_all_lack_usage_tells_the_rate_and_the_routers_prompt_lengths():
    """Every request streamed by a client that did not ask for include_usage (OpenAI clients'
    default; a chat UI streams everything): the router's prompt-token and usage-answer counters
    do not move. The prompt lengths are those the router priced (they were unknown, and before
    that 1 token each: the planner sized prefill for 1-token prompts and shed a saturated pool);
    the hit rate is not measured. Through a real router, as the planner reads it. (A router that
    does not count its lengths: tests/planner/test_observe_routed.py.)"""
    obs = _interval([True] * 8)
    assert obs is not None and obs.request_rate == pytest.approx(0.8)
    assert set(obs.input_tokens) == {PROMPT_WORDS} and not obs.hit_measured


@pytest.fixture(scope="module")
def sizer():
    from kvtier.planner.hardware import cost_models
    from kvtier.planner.live import FleetSizer
    from kvtier.planner.models import load_model
    from kvtier.planner.workers import SLATargets

    costs = cost_models(load_model("llama-3-70b"), "h100", 8)
    return FleetSizer(SLATargets(ttft_s=2.0, itl_s=0.05), costs.prefill, costs.decode, 22.5e9, 1_200_000)


def _decisions(sizer, usage: list[bool], start: int = 1):
    """The live planner over intervals of a constant load (40 req/s of 16,000-token prompts, a
    fifth cached) whose answers carry usage in the intervals ``usage`` marks True."""
    from kvtier.planner.live import LivePlanner, PlannerSettings

    planner = LivePlanner(sizer, PlannerSettings(interval_s=15, startup_s=60), start, start)
    before, out = RouterCounters(0.0, 0, 0, 0, 0), []
    for i, carried in enumerate(usage, 1):
        after = RouterCounters(15.0 * i, before.requests + 600,
                               before.prompt_tokens + (600 * 16_000 if carried else 0),
                               before.cached_tokens + (600 * 3_200 if carried else 0),
                               before.usage_answers + (600 if carried else 0))
        out.append(planner.decide(observation_between(before, after, 256)))
        before = after
    return out


def test_a_steady_load_whose_streams_stop_carrying_usage_keeps_its_pools(sizer):
    """Same rate, same prompts every interval; usage only in the first. The need went 32 -> 17
    -> 11 -> 9 -> 1 as 1-token 'prompts' filled the pooled mix, and the planner drained a quarter
    of a saturated pool. It must size on the mix it measured before."""
    decisions = _decisions(sizer, [True] + [False] * 5)
    needs = [d.prefill.needed for d in decisions]
    targets = [d.prefill.target for d in decisions]
    assert min(needs) >= needs[0] - 1, f"same load every interval; prefill need went {needs}"
    assert min(targets) == max(targets) > 1, f"same load every interval; prefill pool went {targets}"
    assert "no answer carried usage in this one" in decisions[-1].prefill.reason


def test_requests_with_no_prompt_length_ever_known_hold_the_pools(sizer):
    """No interval has carried usage yet: nothing to size on. The pools hold (and no interval
    counts towards a scale-down), rather than "no requests" shedding them to the minimum; the
    decision's TTFT is unknown, null in its JSON."""
    decisions = _decisions(sizer, [False] * 4, start=6)
    assert {(d.prefill.action, d.prefill.target, d.decode.target) for d in decisions} == {("hold", 6, 6)}
    assert "no prompt length known yet" in decisions[-1].prefill.reason
    assert json.loads(json.dumps(decisions[-1].to_json(), allow_nan=False))["predicted_ttft_s"] is None
    # once usage arrives, the planner sizes on it
    assert _decisions(sizer, [False, True], start=6)[-1].prefill.needed > 6


def test_a_router_without_the_usage_answers_counter_still_gives_the_mean_over_requests():
    """Control: an older router exports no kvtier_router_usage_answers_total; prompt tokens did
    move, so the mean is over the requests, as before."""
    obs = observation_between(RouterCounters(0.0, 0, 0, 0), RouterCounters(10.0, 10, 5_000, 1_000), 64)
    assert set(obs.input_tokens) == {500} and obs.hit_rate == pytest.approx(0.2)
