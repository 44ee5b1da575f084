"""The router learns each worker's in-flight pressure from TTFTs it observes, apart from its
prefill speed, and the tier-aware policy prices it: a busy worker holding the prompt in HBM
loses to an idle one that can load it from the shared tier."""

from __future__ import annotations

import pytest

from kvtier.router.workers import Worker

from tests.router.test_policies import BS, SYSTEM, route, router, store


def test_speed_is_learnt_only_from_an_idle_worker_and_pressure_only_from_a_busy_one():
    w = Worker(0, "http://w0")
    w.start(1000, 4)
    w.first_byte(1000, 0.5, others=0, default_speed=100.0)
    assert w.prefill_tokens_per_s == pytest.approx(2000.0) and w.inflight_s is None
    # Busy: 3 requests ran beside it, 500 tokens queued ahead: predicted 0.5 s + 0.25 s
    # of prefill at the learnt speed, observed 2.25 s → 0.5 s per running request.
    w.start(500, 2)
    w.first_byte(500, 2.25, others=3, ahead_tokens=1000, default_speed=100.0)
    assert w.prefill_tokens_per_s == pytest.approx(2000.0), "a busy TTFT must not count as prefill speed"
    assert w.inflight_s == pytest.approx(0.5)
    # Faster than predicted: no negative pressure
    w.first_byte(0, 0.01, others=2, default_speed=100.0)
    assert w.inflight_s >= 0


def test_a_busy_worker_with_the_prefix_in_hbm_loses_to_an_idle_one_that_loads_it():
    r = router()
    store(r, 0, SYSTEM)                       # worker 0: the whole prompt in HBM
    store(r, 1, SYSTEM, shared=True)          # the shared tier has it: every worker can load it
    r.index.clear_worker(1)
    prompt = SYSTEM + [7] * 40
    # Positive control: with nothing measured, the HBM holder wins with a short request running
    r.workers[0].start(8, 2)
    assert route(r, prompt) == 0
    # Measured: each running request delays a new first token on worker 0 by 0.4 s
    r.workers[0].inflight_s = 0.4
    assert route(r, prompt) == 1
