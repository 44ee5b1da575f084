"""Trace-driven simulation of a serving cluster with tiered KV caches and routing policies.

``trace`` (Mooncake requests) → ``cluster`` (config) → ``simulator`` (mechanism, with
``service`` deciding load vs recompute, ``cache`` LRU tiers, ``decode`` batches) driven
by a policy from ``policies``; ``metrics`` and ``plots`` report. :func:`run_simulation`
ties them together for the CLI and the planner.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from kvtier.planner.hardware import CostModels, cost_models
from kvtier.planner.models import ModelGeometry, load_model
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.metrics import PolicyReport, summarize
from kvtier.sim.policies import POLICIES, make_policy
from kvtier.sim.simulator import ClusterSimulator, SimResult
from kvtier.sim.trace import Trace


class SimulationRun(NamedTuple):
    model: ModelGeometry
    costs: CostModels
    results: dict[str, SimResult]
    reports: dict[str, PolicyReport]


def run_simulation(trace: Trace, cluster: ClusterConfig, policies: Iterable[str] = tuple(POLICIES),
                   calibration: str | None = None) -> SimulationRun:
    model = load_model(cluster.model)
    costs = cost_models(model, cluster.accelerator, cluster.devices_per_worker, calibration or cluster.calibration)
    results, reports = {}, {}
    for name in policies:
        sim = ClusterSimulator(cluster, model, costs.prefill, costs.decode, make_policy(name))
        results[name] = sim.run(trace)
        reports[name] = summarize(results[name])
    return SimulationRun(model, costs, results, reports)
