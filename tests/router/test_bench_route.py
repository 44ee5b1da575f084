"""``kvtier bench route --synthetic``: a small run of the real decision path and its report."""

from __future__ import annotations

import argparse

from kvtier.bench.route import register, synthetic


def test_synthetic_bench_times_real_decisions_over_a_filled_index():
    result = synthetic(tokens=2048, workers=4, indexed_blocks=5000, runs=20)
    assert result["blocks"] == 64 and result["indexed_blocks"] == 5000 and result["workers"] == 4
    for name in ("decision_p50_ms", "decision_p99_ms", "decision_cpu_p99_ms", "keys_p50_ms", "view_p50_ms"):
        assert result[name] > 0
    assert result["decision_p50_ms"] <= result["decision_p99_ms"] <= result["decision_max_ms"]


def test_bench_route_needs_a_mode():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["route", "--synthetic", "--json"]).synthetic
    try:
        parser.parse_args(["route", "--json"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("a mode (--synthetic or --trace) is required")
