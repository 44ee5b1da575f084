"""``kvtier simulate`` and ``kvtier plan workers`` end to end on a small trace file."""

from __future__ import annotations

import argparse
import json

import pytest

from kvtier.cli import plan as plan_cli
from kvtier.cli import simulate as simulate_cli


def _parse(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    simulate_cli.register(sub)
    plan_cli.register(sub)
    return parser.parse_args(argv)


@pytest.fixture
def small_trace_file(tmp_path):
    lines = []
    for i in range(120):
        ids = [0, 1 + i % 5, 100 + i]  # a system prompt, five conversations, one new block each
        lines.append(json.dumps({"timestamp": i * 200, "input_length": 3 * 512 - 7, "output_length": 20,
                                 "hash_ids": ids}))
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_simulate_json_reports_every_policy_and_writes_plots(small_trace_file, tmp_path, capsys):
    plot_dir = tmp_path / "plots"
    args = _parse(["simulate", "--trace", str(small_trace_file), "--json", "--plot", str(plot_dir)])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == {"round_robin", "least_loaded", "prefix_overlap", "tier_aware"}
    for report in out["policies"].values():
        assert 0 < report["ttft_p50_s"] <= report["ttft_p90_s"] <= report["ttft_p99_s"]
        assert 0 < report["hit_rate"] < 1 and report["imbalance"] >= 1
        assert sum(report["hit_rate_by_tier"].values()) == pytest.approx(report["hit_rate"], abs=1e-5)
    for name in ("ttft_cdf.png", "hit_rate_vs_capacity.png"):
        assert (plot_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_without_a_trace_says_where_to_get_it(tmp_path, capsys):
    args = _parse(["simulate", "--trace", str(tmp_path / "none.jsonl")])
    assert args.func(args) == 2
    assert "Mooncake" in capsys.readouterr().err


def test_plan_workers_from_a_rate_states_its_hit_rate(capsys):
    args = _parse(["plan", "workers", "--ttft", "2", "--itl", "0.05", "--rate", "5", "--input-tokens", "12000",
                   "--output-tokens", "300", "--hit-rate", "0.4", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hit_rate_assumed"] == 0.4 and out["hit_rate_source"] == "given"
    assert out["prefill_workers"] >= 1 and out["predicted_ttft_s"] <= 2
    assert out["tiers"]["shared_bytes"] > 0


def test_plan_workers_from_a_trace_is_confirmed_by_simulation(small_trace_file, capsys):
    args = _parse(["plan", "workers", "--ttft", "1", "--itl", "0.05", "--trace", str(small_trace_file),
                   "--verify", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hit_rate_source"].startswith("replay")
    assert out["simulated"]["ttft_s"] <= 1.0


@pytest.mark.parametrize("limit", ["0", "-5"])
def test_a_limit_that_is_not_a_positive_count_is_refused(small_trace_file, capsys, limit):
    """``[:0]`` would simulate nothing and ``[:-5]`` all but five requests; control: 7 simulates 7."""
    args = _parse(["simulate", "--trace", str(small_trace_file), "--json", "--limit", "7"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["policies"]["round_robin"]["requests"] == 7
    args = _parse(["simulate", "--trace", str(small_trace_file), "--json", "--limit", limit])
    assert args.func(args) == 2
    assert "--limit must be a positive number" in capsys.readouterr().err
