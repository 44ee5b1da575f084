"""Scenarios are deterministic plain data, cut into phases at their restarts."""

from __future__ import annotations

import json

import pytest

from kvtier.demo.runner import phases_of
from kvtier.demo.workload import Scenario, default_scenario, quick_scenario


@pytest.mark.parametrize("build", [quick_scenario, default_scenario])
def test_scenarios_are_deterministic_and_survive_json(build):
    a, b = build(), build()
    assert a == b
    assert Scenario.from_json(json.loads(json.dumps(a.to_json()))) == a


@pytest.mark.parametrize("build", [quick_scenario, default_scenario])
def test_each_scenario_restarts_once_and_resumes_a_session_it_built(build):
    scenario = build()
    phases = phases_of(scenario)
    assert len(phases) == 2 and all(phases)
    assert sum(s.kind == "restart" for s in scenario.steps) == 1
    seen = set()
    for step in scenario.steps:
        if step.kind == "resume":
            assert step.session in seen, "a resume needs an earlier turn of its session"
            assert sum(m.max_tokens for m in step.messages) <= 64
        seen.add(step.session)
    # The resumed session reads a long file: its context exceeds 4 k tokens.
    budget = scenario.system_prompt.max_tokens + sum(
        m.max_tokens for s in scenario.steps if s.session == "alice" and s.kind == "turn" for m in s.messages
    )
    assert budget >= 4096
