"""The live planner's Prometheus metrics (its own registry) and their ``/metrics`` endpoint.

What ``kvtier top`` and the Grafana dashboard (``deploy/grafana/kvtier.json``) show of the
planner: what it measured, what it forecast and sized for, each pool's current (what the
launcher runs) / needed / target count and last action (with its reason as a label of one
info series, replaced at every decision so the series count stays bounded), the launcher's
workers by state, and what the workers' own metrics said (engine queues, KV fill, TTFT).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, start_http_server

from kvtier.planner.launchers import POOLS
from kvtier.planner.live import Decision
from kvtier.planner.observe import FleetLoad, Observation

STATES = ("starting", "serving", "draining")
ACTIONS = ("scale_up", "scale_down", "hold")


class PlannerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.observed_rate = Gauge("kvtier_planner_observed_request_rate", "Requests/s measured over the last interval",
                                   registry=r)
        self.forecast_rate = Gauge("kvtier_planner_forecast_request_rate",
                                   "Requests/s forecast over a worker's start-up", registry=r)
        self.sizing_rate = Gauge("kvtier_planner_sizing_request_rate",
                                 "Requests/s the pools were sized for (headroom included)", registry=r)
        self.hit_rate = Gauge("kvtier_planner_hit_rate", "Share of prompt tokens loaded, not recomputed (pooled)",
                              registry=r)
        self.predicted_ttft = Gauge("kvtier_planner_predicted_ttft_seconds",
                                    "TTFT at the target percentile the queue model predicts for the sized pool",
                                    registry=r)
        self.workers = Gauge("kvtier_planner_workers",
                             "Workers per pool running (the launcher's starting and serving ones) when the planner "
                             "last decided: its current count", ["pool"], registry=r)
        self.needed = Gauge("kvtier_planner_needed_workers", "Workers per pool the sizing rate needs", ["pool"],
                            registry=r)
        self.target = Gauge("kvtier_planner_target_workers", "Workers per pool decided", ["pool"], registry=r)
        self.decisions = Counter("kvtier_planner_decisions", "Decisions per pool and action", ["pool", "action"],
                                 registry=r)
        self.last_decision = Gauge("kvtier_planner_last_decision_info",
                                   "1 for each pool's last decision; its action and reason as labels",
                                   ["pool", "action", "reason"], registry=r)
        self.launcher_workers = Gauge("kvtier_planner_launcher_workers", "The launcher's workers by pool and state",
                                      ["pool", "state"], registry=r)
        self.launcher_actions = Counter("kvtier_planner_launcher_actions",
                                        "Launcher transitions (start, serving, drain, removed, stop, failed)",
                                        ["action"], registry=r)
        self.engine_running = Gauge("kvtier_planner_engine_requests_running",
                                    "Requests running in the workers' engines (vLLM /metrics, summed)", registry=r)
        self.engine_waiting = Gauge("kvtier_planner_engine_requests_waiting",
                                    "Requests queued in the workers' engines (vLLM /metrics, summed)", registry=r)
        self.engine_kv_usage = Gauge("kvtier_planner_engine_kv_usage_max",
                                     "KV cache fill of the fullest worker (fraction)", registry=r)
        self.engine_ttft = Gauge("kvtier_planner_engine_ttft_seconds",
                                 "TTFT at the target percentile over the interval, from vLLM's histograms", registry=r)
        self.engine_itl = Gauge("kvtier_planner_engine_itl_seconds",
                                "Inter-token latency at the target percentile over the interval (vLLM)", registry=r)
        self.scrape_errors = Counter("kvtier_planner_scrape_errors",
                                     "Intervals without a decision: the router's metrics could not be read, or "
                                     "the planner could not decide on them (it holds, and tries again)",
                                     registry=r)
        self.status_write_errors = Counter("kvtier_planner_status_write_errors",
                                           "Status or targets file writes that failed (the planner goes on)",
                                           registry=r)
        for pool in POOLS:
            for action in ACTIONS:
                self.decisions.labels(pool, action)

    def record(self, obs: Observation, decision: Decision) -> None:
        self.observed_rate.set(obs.request_rate)
        self.forecast_rate.set(decision.forecast_rate)
        self.sizing_rate.set(decision.sizing_rate)
        self.hit_rate.set(decision.hit_rate)
        self.predicted_ttft.set(decision.predicted_ttft_s)   # +Inf when the target is out of reach
        self.last_decision.clear()
        for d in (decision.prefill, decision.decode):
            self.workers.labels(d.pool).set(d.current)
            self.needed.labels(d.pool).set(d.needed)
            self.target.labels(d.pool).set(d.target)
            self.decisions.labels(d.pool, d.action).inc()
            self.last_decision.labels(d.pool, d.action, d.reason[:400]).set(1)

    def record_launcher(self, launcher) -> None:
        for pool in POOLS:
            listed = launcher.list(pool)
            for state in STATES:
                self.launcher_workers.labels(pool, state).set(sum(w.state == state for w in listed))

    def record_fleet(self, load: FleetLoad) -> None:
        self.engine_running.set(load.running)
        self.engine_waiting.set(load.waiting)
        for gauge, value in ((self.engine_kv_usage, load.kv_usage_max), (self.engine_ttft, load.ttft_s),
                             (self.engine_itl, load.itl_s)):
            gauge.set(float("nan") if value is None else value)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "127.0.0.1"):
        """``/metrics`` on ``host:port`` (a daemon thread); returns the server (``shutdown()`` stops it)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
