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


def test_paired_differences_resolve_a_shift_and_not_noise():
    """Tier-aware's quantiles against another round's, request by request: a round slower by
    0.2 s on every request is resolved (the interval excludes 0) however widely the requests
    themselves vary; two rounds that differ only by per-request noise are not (control), and
    neither is a round against itself."""
    import numpy as np

    from kvtier.bench.route_trace import paired_difference, tier_aware_paired

    rng = np.random.default_rng(7)
    own = rng.lognormal(-0.5, 0.8, 64)                        # requests' own costs: 0.1 s .. 3 s
    shifted = paired_difference(list(own), list(own + 0.2), 0.5)
    assert shifted["diff_s"] == -0.2 and shifted["ci95_s"] == [-0.2, -0.2] and shifted["resolved"] == "lower"
    assert paired_difference(list(own + 0.2), list(own), 0.9)["resolved"] == "higher"
    itself = paired_difference(list(own), list(own), 0.5)
    assert itself == {"diff_s": 0.0, "ci95_s": [0.0, 0.0], "resolved": "no"}
    noisy = own * rng.lognormal(0, 0.3, 64)                   # the same requests, the machine's noise
    for q in (0.5, 0.9):
        result = paired_difference(list(own), list(noisy), q)
        assert result["resolved"] == "no" and result["ci95_s"][0] < 0 < result["ci95_s"][1], result
    rounds = {"tier-aware": list(own), "baseline": list(own + 0.5), "round-robin": list(noisy), "short": [1.0]}
    paired = tier_aware_paired(rounds)
    assert set(paired) == {"baseline", "round-robin"}          # a round of other requests is not paired
    assert paired["baseline"]["p50"]["resolved"] == "lower" and paired["round-robin"]["p90"]["resolved"] == "no"
    assert tier_aware_paired({"baseline": [1.0]}) == {}
