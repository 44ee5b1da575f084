"""The live planner's decision core on synthetic metrics: steps up and down, noise, cooldowns."""

from __future__ import annotations

import random

import pytest

from kvtier.errors import ConfigError
from kvtier.planner.hardware import cost_models
from kvtier.planner.live import FleetSizer, LivePlanner, Observation, PlannerSettings, RateForecaster
from kvtier.planner.models import load_model
from kvtier.planner.workers import SLATargets

PROMPTS = tuple([4_000] * 6 + [12_000] * 3 + [30_000])
OUTPUTS = (300,) * len(PROMPTS)


@pytest.fixture(scope="module")
def sizer():
    costs = cost_models(load_model("llama-3-70b"), "h100", 8)
    return FleetSizer(SLATargets(ttft_s=2.0, itl_s=0.05), costs.prefill, costs.decode, 22.5e9, 1_200_000)


def _obs(t, rate, hit=0.4):
    return Observation(t, rate, PROMPTS, OUTPUTS, hit)


def _drive(planner, rates, start=0.0, interval=15.0, hit=0.4):
    decisions = []
    for k, rate in enumerate(rates):
        decisions.append(planner.decide(_obs(start + k * interval, rate, hit)))
    return decisions


def test_step_up_scales_up_at_once_and_step_down_scales_down_after_hysteresis(sizer):
    settings = PlannerSettings(interval_s=15, startup_s=20, down_cooldown_s=60, scale_down_after=2)
    planner = LivePlanner(sizer, settings, prefill_workers=1, decode_workers=1)
    low = _drive(planner, [2.0] * 8)
    low_count = planner.prefill.count
    high = _drive(planner, [20.0] * 8, start=8 * 15)
    # The first interval at the new rate already asks for more workers: no lag behind a step up.
    assert high[0].prefill.action == "scale_up" and high[0].prefill.target > low_count
    high_count = planner.prefill.count
    assert high_count >= 5 * low_count
    down = _drive(planner, [2.0] * 40, start=16 * 15)  # one worker per cooldown at this size
    # Not on the first low interval (hysteresis), but within a few; then back near the low count.
    assert down[0].prefill.action == "hold"
    first_down = next(i for i, d in enumerate(down) if d.prefill.action == "scale_down")
    assert first_down >= settings.scale_down_after - 1
    assert planner.prefill.count <= low_count + 1
    # Scale-downs shed at most max_down_fraction of the pool each and respect the cooldown.
    downs = [d for d in down if d.prefill.action == "scale_down"]
    for d in downs:
        assert d.prefill.current - d.prefill.target <= max(1, int(d.prefill.current * settings.max_down_fraction))
    times = [d.at_s for d in low + high + down if d.prefill.action != "hold"]
    for d in downs:
        previous = max(t for t in times if t < d.at_s)
        assert d.at_s - previous >= settings.down_cooldown_s


def test_noise_around_a_level_does_not_make_the_pool_flap(sizer):
    rng = random.Random(7)
    planner = LivePlanner(sizer, PlannerSettings(), prefill_workers=1, decode_workers=1)
    _drive(planner, [10.0] * 6)  # settle on the level
    settled = planner.prefill.count
    # ±4 %: the whole range (8 %) is narrower than the 10 % band between the two thresholds.
    noisy = _drive(planner, [10.0 * (1 + rng.uniform(-0.04, 0.04)) for _ in range(60)], start=6 * 15)
    changes = [d for d in noisy if d.prefill.action != "hold"]
    downs = [d for d in changes if d.prefill.action == "scale_down"]
    # A few upward nudges while the forecast settles may happen; never an up-down-up dance.
    assert len(downs) == 0, [d.prefill.reason for d in downs]
    assert planner.prefill.count <= settled * 1.3


def test_down_cooldown_blocks_a_scale_down_right_after_a_scale_up(sizer):
    settings = PlannerSettings(interval_s=15, down_cooldown_s=300, scale_down_after=1)
    planner = LivePlanner(sizer, settings, prefill_workers=1, decode_workers=1)
    up = planner.decide(_obs(0, 20.0))
    assert up.prefill.action == "scale_up"
    held = _drive(planner, [1.0] * 5, start=15)
    assert all(d.prefill.action == "hold" for d in held)
    assert "cooldown" in held[-1].prefill.reason
    later = planner.decide(_obs(15 + 300, 1.0))
    assert later.prefill.action == "scale_down"


def test_up_cooldown_delays_a_second_scale_up(sizer):
    planner = LivePlanner(sizer, PlannerSettings(up_cooldown_s=60), prefill_workers=1, decode_workers=1)
    assert planner.decide(_obs(0, 5.0)).prefill.action == "scale_up"
    second = planner.decide(_obs(15, 40.0))
    assert second.prefill.action == "hold" and "scale-up cooldown" in second.prefill.reason
    assert planner.decide(_obs(60, 40.0)).prefill.action == "scale_up"


def test_a_higher_measured_hit_rate_needs_fewer_prefill_workers(sizer):
    counts = {}
    for hit in (0.0, 0.6):
        planner = LivePlanner(sizer, PlannerSettings(), prefill_workers=1, decode_workers=1)
        _drive(planner, [30.0] * 4, hit=hit)
        counts[hit] = planner.prefill.count
    assert counts[0.6] < counts[0.0]


def test_reasons_name_the_figures_and_decisions_serialise(sizer):
    planner = LivePlanner(sizer, PlannerSettings(), prefill_workers=1, decode_workers=1)
    d = planner.decide(_obs(0, 12.0))
    assert "req/s measured" in d.prefill.reason and "hit rate 40.0%" in d.prefill.reason
    out = d.to_json()
    assert out["prefill"]["action"] == "scale_up" and out["prefill"]["target"] == d.prefill.target


def test_forecaster_follows_a_ramp_and_never_goes_negative():
    f = RateForecaster(0.5)
    for k in range(20):
        f.update(k * 10.0, 1.0 + k)
    assert f.forecast(30) > 20  # extrapolates the trend past the last measurement (20)
    g = RateForecaster(0.5)
    for k in range(20):
        g.update(k * 10.0, max(0.0, 20.0 - 2 * k))
    assert g.forecast(1000) == 0.0


def test_bad_settings_and_observations_are_refused():
    with pytest.raises(ConfigError):
        PlannerSettings(interval_s=0)
    with pytest.raises(ConfigError):
        PlannerSettings(min_workers=5, max_workers=2)
    with pytest.raises(ConfigError):
        Observation(0, -1.0, (), (), 0.0)
    with pytest.raises(ConfigError):
        Observation(0, 1.0, (), (), 1.5)
