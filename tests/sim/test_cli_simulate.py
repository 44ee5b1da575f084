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


@pytest.mark.parametrize("extra, named", [(["--plot", "PLOTS"], "--plot"),
                                         (["--policies", "no_such_policy"], "--policies"),
                                         (["--plot", "PLOTS", "--policies", "round_robin"], "--plot and --policies")])
def test_s29_d3_planner_refuses_the_flags_it_would_ignore(small_trace_file, tmp_path, capsys, extra, named):
    """`simulate --planner` took --plot DIR and --policies and ignored both, exit 0: no plot was
    written, and a policy name that does not exist was not even refused."""
    plots = tmp_path / "plots"
    argv = ["simulate", "--planner", "--scale", "2", "--trace", str(small_trace_file), "--json"]
    args = _parse(argv + [str(plots) if a == "PLOTS" else a for a in extra])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert f"kvtier simulate: {named} " in err and "without --planner" in err
    assert not plots.exists()
    # control: the same day without them runs
    args = _parse(argv)
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["day"]["requests"] == 2 * 120


def test_s29_d6_verify_reports_the_token_hit_rate_it_assumed(tmp_path, capsys):
    """--verify set the simulator's BLOCK hit rate beside the assumed TOKEN hit rate, both "hit
    rate": prompts of one shared block and one token of their own read 47.5 % against 94.8 %, a
    failed assumption, while the simulation reused exactly the tokens assumed."""
    path = tmp_path / "tail1.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 513, "output_length": 16,
                                        "hash_ids": [0, 100 + i]}) + "\n" for i in range(20)))
    argv = ["plan", "workers", "--trace", str(path), "--ttft", "2", "--itl", "0.05", "--verify"]
    args = _parse(argv + ["--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    reused = 19 * 512 / (20 * 513)   # every request after the first reuses the shared block
    sim = out["simulated"]
    assert out["hit_rate_assumed"] == pytest.approx(reused)
    assert sim["token_hit_rate"] == pytest.approx(reused) and sim["hit_rate"] == sim["token_hit_rate"]
    assert sim["block_hit_rate"] == pytest.approx(19 / 40)
    args = _parse(argv)
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert f"token hit rate assumed {reused:.1%}" in text
    assert f"token hit rate {reused:.1%} (block hit rate 47.5%)" in text
