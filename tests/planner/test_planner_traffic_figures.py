"""The live planner's figures from the router's counters, against the traffic they stand for
(audit s32 a6 D3, D4). Real parts: a real HTTP ``/metrics`` server and scrape, the real loop,
planner, cost models and dry-run launcher.

D3: a garbled ``kvtier_router_requests_total`` (a huge but finite value) gave a rate of 6.7e298
req/s and a mean prompt of under one token: both pools were sized to the bound (100,000 workers),
where a garbled prompt-token counter already gave no observation.
D4: intervals were pooled by their samples, which hold at most 64 prompt lengths: a quiet
interval of 2 long uncached prompts outweighed a busy one of 1,000 prompts 90 % cached (hit rate
0.505 sized on where the pooled tokens say 0.857), and its 2 prompts weighed 2/66 of the mix.

Audit s32 r2 D2: beside sane router lengths, a garbled usage prompt-token counter (1e300) was
taken as an interval of ~0 % hits weighing 1e300 tokens: the pooled hit rate fell from 0.9 to
7e-294 for the next four intervals (prefill sized as if nothing were cached, 6 -> 14 workers).
D3: a garbled usage-answers counter on a router without the routed lengths gave a mean prompt
under one token, sized as 1-token prompts (1 prefill worker where the traffic needs 120)."""

from __future__ import annotations

import pytest

from kvtier.planner.hardware import cost_models
from kvtier.planner.live import FleetSizer, LivePlanner, Observation, PlannerSettings
from kvtier.planner.models import load_model
from kvtier.planner.observe import RouterCounters, observation_between
from kvtier.planner.workers import MAX_WORKERS, SLATargets
from tests.planner.test_planner_absurd_figures import _dry_run_loop, routed_text
from tests.planner.test_planner_hostile import MetricsServer, router_text

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def sizer():
    costs = cost_models(load_model("llama-3-70b"), "h100", 8)
    return FleetSizer(SLATargets(ttft_s=2.0, itl_s=0.05), costs.prefill, costs.decode, 22.5e9, 1_200_000)


# --- D3: a request rate no router produces is no observation -------------------------------------

def test_a_request_rate_past_the_bound_is_no_observation():
    """A million requests a second (MAX_REQUEST_RATE) is a rate; two million are a garbled counter."""
    # at_s, requests, usage prompt tokens, cached, usage answers, routed prompt tokens, unknown length
    before = RouterCounters(0.0, 1000, 2_000_000, 800_000, 1000, 2_000_000, 0)
    at_bound = RouterCounters(1.0, 1000 + 1e6, 2_000_000 + 2e9, 800_000, 1000, 2_000_000 + 2e9, 0)
    assert observation_between(before, at_bound, 200).request_rate == 1e6   # control
    assert observation_between(before, at_bound._replace(requests=1000 + 2e6), 200) is None
    garbled = RouterCounters(15.0, 1e300, 2_030_000, 812_000, 1015, 2_030_000, 0)   # one field garbled
    assert observation_between(before, garbled, 200) is None


def test_a_garbled_requests_counter_holds_the_pools_and_the_next_sane_interval_decides(sizer):
    server = MetricsServer(routed_text(1000, 2_000_000))
    try:
        loop, launcher = _dry_run_loop(sizer, server.url, PlannerSettings())
        assert loop.step() is None                         # the baseline
        server.body = routed_text(1e300, 2_030_000)        # sized both pools to 100,000 workers
        assert loop.step() is None
        assert launcher.out.getvalue() == "" and len(launcher.list("prefill")) == 2
        server.body = routed_text(1010, 2_050_000)         # went back: a new baseline, as a reset
        assert loop.step() is None
        server.body = routed_text(1020, 2_070_000)         # 2,000-token prompts (the scrapes are ms apart)
        decision = loop.step()
        # sized on its rate (thousands of req/s over milliseconds): not on the bound
        assert decision is not None and decision.prefill.needed < MAX_WORKERS > decision.decode.needed
    finally:
        server.close()


# --- D4: intervals pooled by the traffic they stand for, not by their capped samples -------------

BUSY = RouterCounters(15.0, 1000, 4_000_000, 3_600_000, 1000, 4_000_000, 0)   # 1,000 x 4,000 tokens, 90 % cached
QUIET = RouterCounters(30.0, 1002, 4_200_000, 3_600_000, 1002, 4_200_000, 0)  # then 2 x 100,000 tokens, none


def test_the_pooled_hit_rate_is_cached_over_prompt_tokens_of_the_pooled_intervals(sizer):
    planner = LivePlanner(sizer, PlannerSettings(), prefill_workers=4, decode_workers=4)
    start = RouterCounters(0.0, 0, 0, 0, 0, 0, 0)
    planner.decide(observation_between(start, BUSY, 100))
    decision = planner.decide(observation_between(BUSY, QUIET, 100))
    assert decision.hit_rate == pytest.approx(3_600_000 / 4_200_000), "weighed by the 64-length samples"


def test_the_pooled_prompt_mix_weighs_each_interval_by_its_requests(sizer):
    """Sized as on the whole traffic: 1,002 prompts, 2 of them long, at the pooled token hit rate."""
    planner = LivePlanner(sizer, PlannerSettings(), prefill_workers=1, decode_workers=1)
    start = RouterCounters(0.0, 0, 0, 0, 0, 0, 0)
    planner.decide(observation_between(start, BUSY, 100))
    decision = planner.decide(observation_between(BUSY, QUIET, 100))
    whole = sizer.size(decision.sizing_rate, (4_000,) * 1000 + (100_000,) * 2, (100,) * 1002, 3.6 / 4.2, 1.0)
    assert (decision.prefill.needed, decision.decode.needed) == (whole.prefill_workers, whole.decode_workers)
    assert f"mean prefill {whole.mean_prefill_s:.3f} s" in decision.prefill.reason


def test_samples_of_one_length_per_request_pool_as_before(sizer):
    """The simulator's observations carry every request's length: joined as they are, and the hit
    rate weighed by the lengths' sums."""
    planner = LivePlanner(sizer, PlannerSettings(), prefill_workers=1, decode_workers=1)
    planner.decide(Observation(15.0, 2.0, (1_000,) * 30, (100,) * 30, 0.5))
    decision = planner.decide(Observation(30.0, 2.0, (3_000,) * 30, (100,) * 30, 0.0))
    assert decision.hit_rate == pytest.approx(0.5 * 30_000 / 120_000)
    whole = sizer.size(decision.sizing_rate, (1_000,) * 30 + (3_000,) * 30, (100,) * 60, 0.125, 1.0)
    assert decision.prefill.needed == whole.prefill_workers


# --- s32 r2 D2, D3: a garbled usage counter is no observation; real usage figures still are -----

def test_a_garbled_usage_prompt_counter_leaves_the_pooled_hit_rate_as_it_was(sizer):
    planner = LivePlanner(sizer, PlannerSettings(), prefill_workers=4, decode_workers=4)
    start = RouterCounters(0.0, 0, 0, 0, 0, 0, 0)
    before = planner.decide(observation_between(start, BUSY, 100))
    assert before.hit_rate == pytest.approx(0.9)
    # the router's lengths are sane (4,000-token prompts): only usage's prompt tokens are garbled
    garbled = RouterCounters(30.0, 2000, 1e300, 7_200_000, 2000, 8_000_000, 0)
    assert observation_between(BUSY, garbled, 100) is None
    after = RouterCounters(45.0, 3000, 12_000_000, 10_800_000, 3000, 12_000_000, 0)
    assert observation_between(garbled, after, 100) is None            # went back: a new baseline
    later = RouterCounters(60.0, 4000, 16_000_000, 14_400_000, 4000, 16_000_000, 0)
    decision = planner.decide(observation_between(after, later, 100))
    assert decision.hit_rate == pytest.approx(0.9)
    assert decision.prefill.needed == before.prefill.needed


def test_a_usage_mean_at_the_bound_is_an_observation_past_it_none():
    before = RouterCounters(0.0, 10, 0, 0, 0, 0, 0)
    at_bound = RouterCounters(15.0, 20, 10 * 1e8, 5e8, 10, 20_000, 0)    # router lengths: 2,000 tokens
    obs = observation_between(before, at_bound, 100)
    assert obs.input_tokens[0] == 2_000 and obs.hit_rate == 0.5 and obs.prompt_tokens == 1e9
    assert observation_between(before, at_bound._replace(prompt_tokens=10 * 2e8), 100) is None
    no_answers_counted = at_bound._replace(usage_answers=0.0)           # an older router: over requests
    assert observation_between(before, no_answers_counted, 100).hit_rate == 0.5


def usage_text(requests: float, prompt: float, cached: float, answers: float) -> str:
    """A router without the routed-length counters, counting the answers its usage sums over."""
    return (router_text(requests, prompt, cached)
            + "# TYPE kvtier_router_usage_answers counter\n"
            + f'kvtier_router_usage_answers_total{{worker="w"}} {answers}\n')


def test_a_garbled_usage_answers_counter_is_no_observation_and_sizes_nothing(sizer):
    server = MetricsServer(usage_text(10_000, 40_000_000, 0, 10_000))
    try:
        loop, launcher = _dry_run_loop(sizer, server.url, PlannerSettings())
        assert loop.step() is None                                        # the baseline
        server.body = usage_text(10_010, 40_040_000, 0, 1e300)            # sized 1-token prompts
        assert loop.step() is None
        assert launcher.out.getvalue() == "" and len(launcher.list("prefill")) == 2
        # answers went back, the rest did not: prompt tokens moved, so over the requests as uncounted
        server.body = usage_text(10_020, 40_080_000, 0, 10_020)
        decision = loop.step()
        assert decision is not None
        on_the_prompts = sizer.size(decision.sizing_rate, (4_000,) * 10, (200,) * 10, 0.0, 1.0)   # 4,000 tokens
        assert decision.prefill.needed == on_the_prompts.prefill_workers
    finally:
        server.close()


@pytest.mark.parametrize("answers, requests, prompt, mean", [
    (1_000, 1_000, 1_000, 1),            # prompts that really are 1 token
    (50, 1, 50 * 4_000, 4_000),          # a burst's tail: more answers than requests routed
    (0, 1_000, 3_000, 3),                # an older router, no answers counted: over requests
])
def test_real_usage_figures_stay_observations(answers, requests, prompt, mean):
    before = RouterCounters(0.0, 5_000, 9_000_000, 0, 5_000)
    after = RouterCounters(15.0, 5_000 + requests, 9_000_000 + prompt, prompt / 2, 5_000 + answers)
    if not answers:
        before, after = before._replace(usage_answers=0.0), after._replace(usage_answers=0.0)
    obs = observation_between(before, after, 100)
    assert obs.input_tokens[0] == mean and obs.hit_measured and obs.hit_rate == 0.5


def test_no_usage_in_an_interval_and_a_router_restart_are_as_before():
    before = RouterCounters(0.0, 5_000, 9_000_000, 0, 5_000)
    no_usage = RouterCounters(15.0, 6_000, 9_000_000, 0, 5_000)          # streams without usage
    obs = observation_between(before, no_usage, 100)
    assert obs.request_rate == pytest.approx(1_000 / 15) and obs.input_tokens == () and not obs.hit_measured
    restarted = RouterCounters(30.0, 100, 400_000, 0, 100)
    assert observation_between(no_usage, restarted, 100) is None
