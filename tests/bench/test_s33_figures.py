"""Figures of ``bench route``: the p99s are percentiles of the counted decisions only."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.bench import route, route_trace
from kvtier.router.metrics import RouterMetrics


def _row(worker="w0"):
    return {"ttft_s": 0.1, "cached_tokens": 0, "prompt_tokens": 100, "output_tokens": 10,
            "arrival_s": 0.0, "finish_s": 1.0, "worker": worker}


def test_trace_rounds_decision_p99_leaves_the_warm_up_out():
    # the round's router decides the warm-up (slow, 4 in flight on a live load), then the counted requests
    metrics = RouterMetrics()
    for _ in range(1000):
        metrics.decision.observe(0.04)
    before_counted = metrics.render().decode()
    for _ in range(100):
        metrics.decision.observe(0.0002)
    after_counted = metrics.render().decode()
    out = route_trace.summarise([_row()], after_counted, None, before_counted)
    assert out["decision_p99_ms"] <= 1.0    # every counted decision took 0.2 ms
    # with no earlier scrape the whole histogram counts, as before
    assert route_trace.summarise([_row()], after_counted)["decision_p99_ms"] > 10.0


def test_trace_decision_p99_is_none_when_no_decision_came_after_the_earlier_scrape():
    metrics = RouterMetrics()
    metrics.decision.observe(0.04)
    text = metrics.render().decode()
    assert route_trace.histogram_quantile(text, "kvtier_router_decision_seconds", 0.99, since=text) is None


@pytest.mark.parametrize("n", [100, 300])
def test_synthetic_p99_is_interpolated_not_one_rank_above(n):
    seconds = [i / 1e3 for i in range(1, n + 1)]     # 1, 2, ..., n ms
    assert route.p99_ms(seconds) == pytest.approx(np.percentile(range(1, n + 1), 99))
    assert route.p99_ms(seconds) < n                 # with 100 runs, not the maximum
