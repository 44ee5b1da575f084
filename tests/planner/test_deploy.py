"""deploy/: the Grafana dashboard parses and queries only metrics the code defines (kvtier's
Prometheus definitions, grepped from the source, and vLLM's from the installed package); the
plain scripts parse; the example cluster loads."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvtier.json"
_KINDS = {"Counter": "counter", "CounterMetricFamily": "counter", "Gauge": "gauge", "GaugeMetricFamily": "gauge",
          "Histogram": "histogram", "Summary": "summary", "counter": "counter", "gauge": "gauge",
          "histogram": "histogram"}
#: what each kind exposes beyond its name (prometheus_client's text format)
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
             "summary": ("_sum", "_count", "")}


def kvtier_metrics() -> dict[str, str]:
    """name → kind of every metric kvtier defines (prometheus_client constructors in kvtier/)."""
    pattern = re.compile(r'\b(Counter|Gauge|Histogram|Summary|GaugeMetricFamily|CounterMetricFamily)\(\s*"([a-z_:]+)"')
    found = {}
    for path in (ROOT / "kvtier").rglob("*.py"):
        for kind, name in pattern.findall(path.read_text()):
            found[name] = _KINDS[kind]
    return found


def vllm_metrics() -> dict[str, str]:
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        return {}
    text = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    return {name: _KINDS[kind] for kind, name in re.findall(r'_(counter|gauge|histogram)_cls\(\s*name="(vllm:[a-z_:]+)"',
                                                               text)}


def exposed(defined: dict[str, str]) -> set[str]:
    return {name + suffix for name, kind in defined.items() for suffix in _SUFFIXES[kind]}


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    return exprs


def referenced(expr: str) -> set[str]:
    return set(re.findall(r"\b(kvtier_[a-z0-9_]+|vllm:[a-z0-9_:]+)", expr))


def test_the_definitions_are_found():
    mine = kvtier_metrics()
    # one of each exporter: the server, the router, the planner
    assert mine["kvtier_tier_used_bytes"] == "gauge" and mine["kvtier_router_requests"] == "counter"
    assert mine["kvtier_router_decision_seconds"] == "histogram" and mine["kvtier_planner_workers"] == "gauge"
    assert "kvtier_router_requests_total" in exposed(mine) and "kvtier_router_requests" not in exposed(mine)


def test_every_dashboard_query_names_a_metric_the_code_exports():
    known = exposed(kvtier_metrics())
    vllm = vllm_metrics()
    queries = dashboard_queries()
    assert len(queries) >= 20
    names = set().union(*(referenced(q) for q in queries))
    assert any(n.startswith("kvtier_planner_") for n in names) and any(n.startswith("vllm:") for n in names)
    missing = sorted(n for n in names if n.startswith("kvtier_") and n not in known)
    assert not missing, f"the dashboard queries metrics no code defines: {missing}"
    if not vllm:
        pytest.skip("vllm is not installed: its metric names are not checked")
    missing = sorted(n for n in names if n.startswith("vllm:") and n not in exposed(vllm))
    assert not missing, f"the dashboard queries vLLM metrics the installed vLLM does not define: {missing}"


def test_the_check_catches_a_misspelt_metric():
    """Positive control: the same check on a wrong name (a counter queried without _total) fails."""
    known = exposed(kvtier_metrics())
    assert "kvtier_router_requests" not in known and "kvtier_planner_workers_total" not in known
    assert referenced('sum(rate(kvtier_router_requests{x="1"}[1m]))') == {"kvtier_router_requests"}


def test_scripts_parse_and_the_example_cluster_loads():
    from kvtier.sim.cluster import load_cluster

    for script in ("up.sh", "down.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "deploy" / "local" / script)], check=True)
    cluster = load_cluster(str(ROOT / "deploy" / "local" / "cluster.json"))
    assert cluster.model == "llama-3-8b"
    # every flag up.sh gives `kvtier plan live` exists (a renamed flag would break the example)
    from kvtier.cli.main import build_parser

    parser = build_parser()
    live = parser._subparsers._group_actions[0].choices["plan"]._subparsers._group_actions[0].choices["live"]
    flags = {o for a in live._actions for o in a.option_strings}
    used = set(re.findall(r"(--[a-z-]+)", (ROOT / "deploy" / "local" / "up.sh").read_text().split("plan live", 1)[1]
                          .split("\n\n", 1)[0]))
    assert used and used <= flags, sorted(used - flags)
