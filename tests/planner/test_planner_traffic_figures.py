"""The live planner's figures from the router's counters, against the traffic they stand for
(audit s32 a6 D3, D4). Real parts: a real HTTP ``/metrics`` server and scrape, the real loop,
planner, cost models and dry-run launcher.

D3: a garbled ``kvtier_router_requests_total`` (a huge but finite value) gave a rate of 6.7e298
req/s and a mean prompt of under one token: both pools were sized to the bound (100,000 workers),
where a garbled prompt-token counter already gave no observation.
D4: intervals were pooled by their samples, which hold at most 64 prompt lengths: a quiet
interval of 2 long uncached prompts outweighed a busy one of 1,000 prompts 90 % cached (hit rate
0.505 sized on where the pooled tokens say 0.857), and its 2 prompts weighed 2/66 of the mix."""

from __future__ import annotations

import pytest

from kvtier.planner.hardware import cost_models
from kvtier.planner.live import FleetSizer, LivePlanner, Observation, PlannerSettings
from kvtier.planner.models import load_model
from kvtier.planner.observe import RouterCounters, observation_between
from kvtier.planner.workers import MAX_WORKERS, SLATargets
from tests.planner.test_planner_absurd_figures import _dry_run_loop, routed_text
from tests.planner.test_planner_hostile import MetricsServer

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
