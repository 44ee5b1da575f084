"""A softmax temperature > 0 spreads an exact tie too (audit s34 a9 D4). Costs are divided by their
spread, and a spread of 0 took the first minimum whatever the temperature, while costs 1e-12 apart
were drawn among all: identical idle workers with nothing cached sent every request to worker 0."""

from __future__ import annotations

import random

from kvtier.policy.routing import softmax_pick
from kvtier.router.app import Router
from kvtier.router.config import RouterConfig, WorkerSpec


def _counts(picks, n):
    return [picks.count(i) for i in range(n)]


def test_an_exact_tie_is_drawn_uniformly():
    rng = random.Random(1)
    picks = [softmax_pick([2.0, 2.0, 2.0], 1.0, rng) for _ in range(600)]
    assert all(150 < c < 250 for c in _counts(picks, 3)), _counts(picks, 3)


def test_temperature_zero_still_takes_the_first_minimum():
    """The control: 0 (the default) is deterministic, ties to the first worker."""
    assert {softmax_pick([2.0, 2.0, 2.0], 0.0, random.Random(s)) for s in range(50)} == {0}


def test_identical_idle_workers_share_requests_under_a_temperature():
    """A real router, tier-aware with temperature 1, four identical idle workers, nothing cached:
    every worker gets requests (before: all went to worker 0)."""
    config = RouterConfig(workers=[WorkerSpec(f"http://w{i}") for i in range(4)], policy="tier-aware",
                          block_tokens=16, kv_bytes_per_token=4096, prefill_tokens_per_s=2000.0,
                          temperature=1.0)
    router = Router(config, tokenizer=None)
    for w in router.workers:
        w.events_up = True             # events connected: tier-aware decides, not the approximate fallback
    picks = [router.decide(list(range(64)), set())[0].id for _ in range(200)]
    assert all(c > 20 for c in _counts(picks, 4)), _counts(picks, 4)
