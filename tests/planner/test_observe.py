"""Router counters → planner observations (rate, prompt mean, hit rate), resets refused."""

from __future__ import annotations

import pytest

from kvtier.planner.observe import RouterCounters, observation_between


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
