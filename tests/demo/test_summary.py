"""The demo's figures are computed from its turn records as documented."""

from __future__ import annotations

import pytest

from kvtier.demo.summary import percentile, summarize


def record(index, *, cold, warm, kind="turn", phase=1, ctx=1000, cached=900, tier="host", equal=True,
           load_s=0.01, lookup_s=0.001, loaded=None):
    return {
        "index": index, "phase": phase, "session": "s", "label": "l", "kind": kind,
        "context_tokens": ctx, "cached_tokens": cached, "computed_tokens": ctx - cached,
        "tokens_by_tier": {tier: cached} if cached else {},
        "loaded_bytes": loaded if loaded is not None else ({tier: cached * 10} if cached else {}),
        "ttft_cold_s": cold, "ttft_warm_s": warm, "cpu_cold_s": 2 * cold, "cpu_warm_s": 2 * warm,
        "speedup": cold / warm, "outputs_equal": equal, "logits_max_abs_diff": 0.0,
        "lookup_s": lookup_s if cached else 0.0005, "load_s": load_s if cached else 0.0,
        "prefill_s": warm - (load_s + lookup_s if cached else 0.0),
    }


def test_percentile_interpolates_and_ignores_missing_values():
    assert percentile([3, 1, 2], 50) == 2
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([0, 10], 90) == pytest.approx(9)
    assert percentile([None, 5], 50) == 5
    assert percentile([], 50) is None


def test_summary_figures():
    turns = [
        record(0, cold=2.0, warm=2.0, cached=0),
        record(1, cold=2.0, warm=0.2),
        record(2, cold=10.0, warm=0.1, kind="resume", ctx=5000, cached=4990),
        record(3, cold=3.0, warm=0.5, phase=2, tier="disk", equal=True),
    ]
    phases = [
        {"phase": 1, "limits_gib_s": {"host": 9.0}, "store_stats": {"host": {"bytes_written": 100, "used_bytes": 50}}},
        {"phase": 2, "spawn_to_ready_s": 4.0, "model_load_s": 0.2, "store_open_s": 0.1, "recovered_blocks": 7,
         "store_stats": {"host": {"bytes_written": 10, "used_bytes": 10}, "disk": {"bytes_written": 0, "used_bytes": 99}}},
    ]
    s = summarize(turns, phases, runtime_s=42.0, scenario="t")
    assert s["outputs_equal"] is True
    assert s["speedup_p50"] == pytest.approx((6.0 + 10.0) / 2)
    assert s["resume_speedup"] == pytest.approx(100.0)
    assert s["resume_new_tokens"] == 10 and s["resume_tiers"] == ["host"]
    assert s["hit_rate"] == pytest.approx((900 + 4990 + 900) / 8000)
    assert s["cpu_seconds_saved"] == pytest.approx(2 * (17.0 - 2.8))
    assert s["bytes_loaded_by_tier"] == {"host": 58900, "disk": 9000}
    assert s["bytes_written_by_tier"] == {"host": 110, "disk": 0}
    assert s["bytes_used_by_tier"] == {"host": 10, "disk": 99}
    assert s["restart"]["disk_blocks_recovered"] == 7
    # phase 1 has a host limit only; phase 2 no limits at all: only phase 1's loads are judged
    assert s["load_efficiency_turns"] == {"host": 2}
    assert s["lookup_s_p50"] == pytest.approx(0.001)
    turns[3]["outputs_equal"] = False
    assert summarize(turns, phases, runtime_s=1.0, scenario="t")["outputs_equal"] is False


GIB = 1 << 30


def test_load_efficiency_per_tier_is_bytes_at_the_limit_over_the_load_time():
    turns = [
        # host at 10 GiB/s: 1 GiB in 0.125 s is 0.8 of the limit; 2 GiB in 0.4 s is 0.5
        record(0, cold=5.0, warm=1.0, loaded={"host": GIB}, load_s=0.125),
        record(1, cold=5.0, warm=1.0, loaded={"host": 2 * GIB}, load_s=0.4),
        record(2, cold=5.0, warm=1.0, loaded={"host": GIB}, load_s=0.1),
        # disk at 2 GiB/s: 1 GiB in 1.0 s is 0.5
        record(3, cold=5.0, warm=2.0, loaded={"disk": GIB}, load_s=1.0, phase=2),
        # host and disk at once: ideal = the longer of 0.5 s (disk) and 0.01 s (host) over 0.6 s,
        # counted under "host+disk", apart from both single-tier figures
        record(4, cold=5.0, warm=2.0, loaded={"disk": GIB, "host": GIB // 10}, load_s=0.6, phase=2, lookup_s=0.09),
        record(5, cold=1.0, warm=1.0, cached=0),  # nothing loaded: not judged
    ]
    phases = [{"phase": 1, "limits_gib_s": {"host": 10.0}},
              {"phase": 2, "limits_gib_s": {"host": 10.0, "disk": 2.0}}]
    s = summarize(turns, phases, runtime_s=1.0, scenario="t")
    assert s["load_efficiency_p50"]["host"] == pytest.approx(0.8)
    assert s["load_efficiency_p50"]["disk"] == pytest.approx(0.5)
    assert s["load_efficiency_p50"]["host+disk"] == pytest.approx(0.5 / 0.6)
    assert s["load_efficiency_turns"] == {"disk": 1, "host": 3, "host+disk": 1}
    # kvtier's own time (lookup + load) over the ideal, prefill left out:
    # 1.26, 2.005, 1.01, 2.002 and (0.09 + 0.6) / 0.5 = 1.38 (the median) for turn 4
    assert s["overhead_ratio_p50"] == pytest.approx((0.09 + 0.6) / 0.5)
    assert s["lookup_s_p50"] == pytest.approx(0.001)
    assert s["prefill_s_p50"] == pytest.approx(1.0 - 0.101)  # turn 2: warm TTFT less its lookup and load


def test_a_tier_without_a_measured_limit_gets_no_efficiency():
    turns = [record(0, cold=5.0, warm=1.0, loaded={"remote": GIB}, load_s=0.5)]
    s = summarize(turns, [{"phase": 1, "limits_gib_s": {"host": 10.0}}], runtime_s=1.0, scenario="t")
    assert s["load_efficiency_p50"] == {} and s["overhead_ratio_p50"] is None


def test_a_load_faster_than_its_limit_is_warned_about_and_a_turns_own_limits_win():
    fast = record(0, cold=5.0, warm=1.0, loaded={"host": GIB}, load_s=0.05)  # 20 GiB/s against 10
    fair = record(1, cold=5.0, warm=1.0, loaded={"host": GIB}, load_s=0.05)
    fair["limits_gib_s"] = {"host": 25.0}  # measured again right after its load
    s = summarize([fast, fair], [{"phase": 1, "limits_gib_s": {"host": 10.0}}], runtime_s=1.0, scenario="t")
    assert len(s["warnings"]) == 1 and s["warnings"][0].startswith("turn 0: host load_efficiency = 2.000 > 1.05")
    assert s["load_efficiency_p50"]["host"] == pytest.approx((2.0 + 0.8) / 2)
