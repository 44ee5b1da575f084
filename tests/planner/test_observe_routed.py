"""The planner's prompt mix from the lengths the router priced
(``kvtier_router_routed_prompt_tokens_total`` ÷ the requests whose length it knew), preferred over
the workers' usage, which only the answers that carry it give (streams without
``stream_options.include_usage`` carry none); usage stays the source for a router that does not
count its lengths. Real routers on real sockets, their /metrics text scraped as the planner does."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from aiohttp import ClientSession

from kvtier.cli.top import scrape
from kvtier.planner.live import LivePlanner, PlannerSettings
from kvtier.planner.observe import RouterCounters, observation_between
from tests.planner.test_observe import VllmLikeStandIn, sizer  # noqa: F401  (sizer: a fixture)
from tests.planner.test_planner_hostile import MetricsServer
from tests.router.test_http import run, start_router

NEW_COUNTERS = ("kvtier_router_routed_prompt_tokens", "kvtier_router_routed_unknown_length_requests")


def older_router_text(text: str) -> str:
    """A router's /metrics text as a router from before the routed-length counters exports it."""
    return "".join(line for line in text.splitlines(keepends=True) if not any(n in line for n in NEW_COUNTERS))


def scraped(url: str, older: bool):
    """The router's samples as the planner scrapes them; ``older``: its text less the new counters,
    served and scraped over HTTP in turn."""
    if not older:
        return scrape(url)
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    assert all(n in text for n in NEW_COUNTERS)   # (the real router has them: they are taken out)
    server = MetricsServer(older_router_text(text))
    try:
        return scrape(server.url)
    finally:
        server.close()


def interval(requests: list[tuple[str, dict]], older: bool = False):
    """The observation over one 10 s interval in which ``requests`` (path, body) went through a
    real router to a worker that streams usage only when asked, as vLLM does."""
    async def main():
        worker = VllmLikeStandIn("w0")
        await worker.start()
        router, runner, url = await start_router([worker], policy="round-robin")
        try:
            before = RouterCounters.from_samples(0.0, await asyncio.to_thread(scraped, url, older))
            async with ClientSession() as s:
                for path, body in requests:
                    async with s.post(url + path, json=body) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
            after = RouterCounters.from_samples(10.0, await asyncio.to_thread(scraped, url, older))
            return before, after, observation_between(before, after, output_tokens=3)
        finally:
            await runner.cleanup()
            await worker.stop()

    return run(main())


def completion(words: int, stream: bool = True) -> tuple[str, dict]:
    return "/v1/completions", {"prompt": " ".join(["word"] * words), "stream": stream}


LENGTHS = (100, 300, 500, 1100)   # mean 500


def test_the_mean_prompt_is_the_routers_over_the_requests_whose_length_it_knew():
    """Streams without include_usage of four lengths, and a Responses API request the router keys
    no prompt of: rate over all five, mean over the four (500), no hit rate measured (no usage)."""
    before, after, obs = interval([completion(n) for n in LENGTHS] + [("/v1/responses", {"input": "hi"})])
    assert before.routed_prompt_tokens is None     # a fresh router: no series yet, taken as 0
    assert (after.routed_prompt_tokens, after.unknown_length) == (sum(LENGTHS), 1)
    assert after.prompt_tokens == 0                # no answer carried usage
    assert obs is not None and obs.request_rate == pytest.approx(0.5)
    assert set(obs.input_tokens) == {500} and len(obs.input_tokens) == 5
    assert not obs.hit_measured


def test_the_routers_lengths_win_over_a_usage_sample_that_is_not_the_mix():
    """Only the short prompts' answers carried usage (non-streamed); the long ones streamed without.
    Usage alone says 100 tokens; the router priced every one: 500. The hit rate still comes from
    usage (half cached, as the worker reports)."""
    _, _, obs = interval([completion(100, stream=False)] + [completion(n) for n in LENGTHS[1:]])
    assert set(obs.input_tokens) == {500}
    assert obs.hit_measured and obs.hit_rate == pytest.approx(0.5)


def test_an_older_router_falls_back_to_usage():
    """Control: a router that exports no routed-length counters (the same traffic, its text less
    them): the mean comes from the answers that carried usage, as before."""
    _, after, obs = interval([completion(100, stream=False)] + [completion(n) for n in LENGTHS[1:]], older=True)
    assert after.routed_prompt_tokens is None and after.unknown_length is None
    assert set(obs.input_tokens) == {100} and obs.hit_rate == pytest.approx(0.5)
    # every answer streamed without usage: no prompt length known, as before (the pools hold)
    _, _, obs = interval([completion(n) for n in LENGTHS], older=True)
    assert obs.request_rate == pytest.approx(0.4) and obs.input_tokens == ()


def test_the_routers_length_counters_going_back_restart_the_baseline():
    """A counter reset (a restarted router) gives no interval, judged on the length counters too:
    here the request counter happened to pass its old value."""
    before = RouterCounters(0.0, 10, 0, 0, 0, 5_000, 2)
    assert observation_between(before, RouterCounters(10.0, 12, 0, 0, 0, 400, 0), 3) is None
    assert observation_between(before, RouterCounters(10.0, 12, 0, 0, 0, 5_400, 1), 3) is None
    fine = observation_between(before, RouterCounters(10.0, 12, 0, 0, 0, 5_400, 2), 3)
    assert set(fine.input_tokens) == {200}


def test_requests_whose_length_the_router_never_knew_fall_back_to_usage():
    """An interval of Responses API requests only (keyed by no prompt): the router knew no length,
    so usage (when answers carry it) gives the mean; without usage, none is known."""
    before = RouterCounters(0.0, 10, 0, 0, 0, 5_000, 0)
    obs = observation_between(before, RouterCounters(10.0, 14, 2_400, 600, 4, 5_000, 4), 3)
    assert set(obs.input_tokens) == {600} and obs.hit_rate == pytest.approx(0.25)
    assert observation_between(before, RouterCounters(10.0, 14, 0, 0, 0, 5_000, 4), 3).input_tokens == ()


def _decisions(sizer, usage: list[bool], start: int = 1):   # noqa: F811 (the fixture)
    """The live planner over intervals of a constant load (40 req/s of 16,000-token prompts, a
    fifth cached), the router counting every prompt's length; answers carry usage in the
    intervals ``usage`` marks True."""
    planner = LivePlanner(sizer, PlannerSettings(interval_s=15, startup_s=60), start, start)
    before, out = RouterCounters(0.0, 0, 0, 0, 0, 0, 0), []
    for i, carried in enumerate(usage, 1):
        after = RouterCounters(15.0 * i, before.requests + 600,
                               before.prompt_tokens + (600 * 16_000 if carried else 0),
                               before.cached_tokens + (600 * 3_200 if carried else 0),
                               before.usage_answers + (600 if carried else 0),
                               before.routed_prompt_tokens + 600 * 16_000, before.unknown_length)
        out.append(planner.decide(observation_between(before, after, 256)))
        before = after
    return out


def test_intervals_without_usage_keep_the_measured_hit_rate(sizer):   # noqa: F811
    """Usage in the first interval only: the later ones have the router's lengths but measured no
    hit rate. Counted as 0 % hits they would pull the pooled rate from 20 % towards 0 and grow
    the prefill pool under the same load; they weigh nothing in it."""
    decisions = _decisions(sizer, [True] + [False] * 5)   # (more intervals than the mix pools)
    assert {round(d.hit_rate, 6) for d in decisions} == {0.2}
    assert len({d.prefill.needed for d in decisions}) == 1, [d.prefill.needed for d in decisions]
    assert "hit rate of earlier intervals" in decisions[-1].prefill.reason


def test_a_router_counting_lengths_sizes_streams_that_never_carry_usage(sizer):   # noqa: F811
    """No answer ever carries usage: the pools were held for want of any prompt length. With the
    router's lengths they are sized, as if nothing were cached (no hit rate measured), and the
    reason says so; once usage comes, its hit rate lowers the need."""
    blind = _decisions(sizer, [False] * 3, start=6)
    assert blind[0].prefill.action == "scale_up" and blind[0].prefill.target > 6   # (held at 6 before)
    assert {d.prefill.needed for d in blind} == {blind[0].prefill.target}
    assert blind[-1].hit_rate == 0.0
    assert "no hit rate measured yet" in blind[-1].prefill.reason
    measured = _decisions(sizer, [False, False, True], start=6)
    assert measured[-1].hit_rate == pytest.approx(0.2)
    assert measured[-1].prefill.needed < blind[-1].prefill.needed
