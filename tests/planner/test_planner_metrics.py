"""The planner's view of the workers' own metrics (vLLM histograms → interval quantiles) and its
/metrics endpoint, read back by ``kvtier top`` alone."""

from __future__ import annotations

import urllib.request

import pytest

from kvtier.cli.top import Samples, planner_from_metrics, scrape
from kvtier.planner.launchers import DryRunLauncher
from kvtier.planner.live import Decision, Observation, PoolDecision
from kvtier.planner.metrics import PlannerMetrics
from kvtier.planner.observe import FleetLoad, fleet_load, histogram_quantile

INF = float("inf")


def test_histogram_quantile_matches_prometheus():
    # 10 observations: 5 in (0, 0.1], 4 in (0.1, 0.5], 1 in (0.5, +Inf)
    buckets = {0.1: 5, 0.5: 9, INF: 10}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.7, buckets) == pytest.approx(0.1 + 0.4 * 2 / 4)
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.5)     # in +Inf: the largest finite bound
    assert histogram_quantile(0.9, {0.1: 0, INF: 0}) is None


def _vllm(running, waiting, usage, ttft_buckets) -> Samples:
    values = {("vllm:num_requests_running", frozenset({("engine", "0")})): running,
              ("vllm:num_requests_waiting", frozenset({("engine", "0")})): waiting,
              ("vllm:kv_cache_usage_perc", frozenset({("engine", "0")})): usage}
    for le, count in ttft_buckets.items():
        values[("vllm:time_to_first_token_seconds_bucket", frozenset({("le", "+Inf" if le == INF else str(le))}))] = count
    return Samples(True, values)


def test_fleet_load_sums_queues_and_takes_ttft_over_the_interval_only():
    before = {"a": _vllm(0, 0, 0.1, {0.1: 100, 1.0: 100, INF: 100}), "b": _vllm(0, 0, 0.2, {0.1: 0, 1.0: 0, INF: 0})}
    # since then: a got 10 slow requests (0.1-1 s), b 10 fast ones; a's 100 old fast ones must not count
    now = {"a": _vllm(3, 2, 0.5, {0.1: 100, 1.0: 110, INF: 110}), "b": _vllm(1, 0, 0.3, {0.1: 10, 1.0: 10, INF: 10}),
           "down": Samples(False, {}, "refused")}
    load = fleet_load(now, before, 0.9)
    assert (load.workers, load.running, load.waiting, load.kv_usage_max) == (2, 4, 2, 0.5)
    assert load.ttft_s == pytest.approx(0.1 + 0.9 * (18 - 10) / 10)    # rank 18 of 20, in a's (0.1, 1] bucket
    assert fleet_load(now, None, 0.5).ttft_s == pytest.approx(0.1 * 60 / 110)   # no baseline: since start
    assert fleet_load({}, None, 0.9) == FleetLoad(0, 0, 0, None, None, None)


def test_planner_metrics_endpoint_gives_kvtier_top_the_decision():
    metrics = PlannerMetrics()
    launcher = DryRunLauncher(out=open("/dev/null", "w"))
    launcher.seed("prefill", 2)
    decision = Decision(10.0, 3.0, 3.3, 0.4, 0.8,
                        PoolDecision("prefill", 2, 3, 3, "scale_up", "need 3 > 2: 3.00 req/s measured"),
                        PoolDecision("decode", 1, 1, 1, "hold", "need 1, holds 1"))
    for reason in ("first", "second"):            # the info series is replaced, not accumulated
        metrics.record(Observation(10.0, 3.0, (100,), (10,), 0.4), decision._replace(
            prefill=decision.prefill._replace(reason=reason)))
    metrics.record_launcher(launcher)
    server = metrics.serve(0)
    try:
        address = f"127.0.0.1:{server.server_port}"
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
        assert text.count("kvtier_planner_last_decision_info{") == 2
        assert 'kvtier_planner_decisions_total{action="scale_up",pool="prefill"} 2.0' in text
        assert 'kvtier_planner_launcher_workers{pool="prefill",state="serving"} 2.0' in text
        shown = planner_from_metrics(scrape(address))
        assert shown["prefill"] == {"action": "scale_up", "reason": "second", "current": 2, "target": 3}
        assert shown["decode"]["action"] == "hold" and shown["sizing_rate"] == pytest.approx(3.3)
    finally:
        server.shutdown()
    assert planner_from_metrics(Samples(False, {}, "down")) is None
