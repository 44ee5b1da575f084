"""Fleet scale: the diurnal day, the pool recursion, and ``kvtier simulate --planner`` end to end."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.cli import simulate as simulate_cli
from kvtier.errors import ConfigError
from kvtier.planner.live import PlannerSettings
from kvtier.sim import fleet
from kvtier.sim.fleet import DayLoad, DiurnalProfile, ServicePass, day_load, run_pool
from kvtier.sim.trace import Trace, TraceRequest

REPO = Path(__file__).resolve().parents[2]
SLICE = REPO / "tests" / "data" / "mooncake_conversation_head500.jsonl"


def test_profile_peak_is_k_times_trough_and_the_warp_realises_it():
    profile = DiurnalProfile(3.0, 1000.0)
    assert profile.factor(500.0) / profile.factor(0.0) == pytest.approx(3.0)
    # Uniform arrivals warped onto the profile: the counts near the peak are ~3x those near the trough.
    times = profile.warp(np.linspace(0, 1, 300_001))
    counts = np.histogram(times, np.linspace(0, 1000, 21))[0]
    assert counts.max() / counts.min() == pytest.approx(3.0, rel=0.05)
    assert np.all(np.diff(times) >= 0)
    with pytest.raises(ConfigError):
        DiurnalProfile(0.5, 1000.0)


def test_day_load_keeps_every_request_of_every_copy():
    reqs = tuple(TraceRequest(float(t), 10, 5, (t,)) for t in range(100))
    day = day_load(Trace(reqs, 16), 7, DiurnalProfile(3.0, 99.0))
    assert len(day.arrivals_s) == 700
    assert np.bincount(day.source).tolist() == [7] * 100
    assert np.all(np.diff(day.arrivals_s) >= 0)


def _svc(n, service):
    return ServicePass(np.full(n, service), np.zeros(n, dtype=np.int64), np.full(n, 8000), np.full(n, 300),
                       np.zeros(n))


def test_pool_recursion_is_fifo_over_c_servers():
    # Four requests at t=0 of 1 s each on two workers: TTFTs 1, 1, 2, 2.
    day = DayLoad(np.zeros(4), np.arange(4))
    run = run_pool(day, _svc(4, 1.0), 1.0, PlannerSettings(), static=(2, 1))
    assert sorted(run.ttft_s.tolist()) == [1.0, 1.0, 2.0, 2.0]
    assert run.prefill_worker_s == pytest.approx(2 * 2.0)  # two workers until the last finish


def test_a_pool_that_is_too_small_misses_for_queueing():
    day = DayLoad(np.linspace(0, 10, 200), np.arange(200))
    run = run_pool(day, _svc(200, 0.5), 10.0, PlannerSettings(), static=(1, 1))
    assert run.queueing_misses(np.full(200, 0.5), 2.0) > 0.5


def _parse(argv):
    parser = argparse.ArgumentParser()
    simulate_cli.register(parser.add_subparsers())
    return parser.parse_args(argv)


def test_simulate_planner_json_reports_the_done_when_figures(capsys):
    args = _parse(["simulate", "--planner", "--diurnal", "3", "--scale", "40", "--trace", str(SLICE), "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["day"]["peak_to_trough"] == 3.0 and out["day"]["shape"] == "sinusoid"
    assert out["day"]["requests"] == 40 * 500
    for key in ("static_worker_hours", "planned_worker_hours", "sla_attainment_static", "sla_attainment_planned",
                "prefill_worker_hours_without_tier", "prefill_worker_hours_with_tier"):
        assert isinstance(out[key], float), key
    # The planner follows the load: fewer worker-hours than a fleet sized for the peak, no worse SLA.
    assert out["planned_worker_hours"] <= 0.75 * out["static_worker_hours"]
    assert out["sla_attainment_planned"] >= out["sla_attainment_static"] - 1e-9
    # Without the context tier the prompts are recomputed: more prefill worker-hours.
    assert out["prefill_worker_hours_without_tier"] > out["prefill_worker_hours_with_tier"]
    planned = out["with_tier"]["planned"]
    assert planned["prefill_scale_ups"] > 0 and planned["prefill_scale_downs"] > 0
    assert planned["min_prefill_workers"] < out["with_tier"]["static"]["prefill_workers"]


def test_simulate_planner_refuses_a_bad_ratio(capsys):
    args = _parse(["simulate", "--planner", "--diurnal", "0.5", "--trace", str(SLICE)])
    assert args.func(args) == 2
    assert "--diurnal" in capsys.readouterr().err


# -- audit s27/audit_sim2 D6: --scale has a bound ------------------------------------------------
def _address_space_3gb():
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def test_a_scale_too_large_for_memory_is_a_clear_error_not_an_oom():
    """--scale 100000000 on the 500-request slice ran 72 s and was killed for memory (rc 137, no
    message). The CLI runs here under a 3 GB address-space limit, so that it can never take the
    machine's memory: before the fix, a MemoryError traceback (rc 1)."""
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "simulate", "--trace", str(SLICE), "--planner",
                           "--scale", "100000000"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          preexec_fn=_address_space_3gb, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-600:])
    assert "Traceback" not in proc.stderr
    assert "--scale 100,000,000 copies x 500 requests" in proc.stderr and "--limit" in proc.stderr


def test_the_day_size_cap_is_inclusive(monkeypatch):
    reqs = tuple(TraceRequest(float(t), 10, 5, (t,)) for t in range(100))
    monkeypatch.setattr(fleet, "MAX_DAY_REQUESTS", 700)
    assert len(day_load(Trace(reqs, 16), 7, DiurnalProfile(3.0, 99.0)).arrivals_s) == 700
    with pytest.raises(ConfigError, match=r"--scale 8 copies x 100 requests = 800 .*at most 7 for this trace"):
        day_load(Trace(reqs, 16), 8, DiurnalProfile(3.0, 99.0))


def test_day_load_builds_the_copies_as_the_concatenation_did():
    """One array for every copy (no Python list of copies), the same day as copy by copy."""
    times = np.sort(np.random.default_rng(3).uniform(0, 50, 200))
    reqs = tuple(TraceRequest(float(t), 10, 5, (i,)) for i, t in enumerate(times))
    profile = DiurnalProfile(3.0, 50.0)
    for copies in (1, 3, 13):
        day = day_load(Trace(reqs, 16), copies, profile)
        base = (times - times[0]) / (times[-1] - times[0])
        fractions = np.concatenate([(base + k / copies) % 1.0 for k in range(copies)])
        order = np.argsort(fractions, kind="stable")
        assert np.array_equal(day.arrivals_s, profile.warp(fractions[order]))
        assert np.array_equal(day.source, np.tile(np.arange(len(times)), copies)[order])


# -- audit s28 D6: a trace of one instant is named, not a period the user never gave ------------------
@pytest.mark.parametrize("rows", [10, 1], ids=["ten_at_one_instant", "one_request"])
def test_planner_on_a_trace_without_spread_names_the_trace(tmp_path, capsys, rows):
    """Every request at one timestamp (or one request): the day's profile was built on the trace's
    span of 0 first, and the command said "the day's period must be positive seconds", a setting
    the user never gave."""
    lines = SLICE.read_text().splitlines()[:rows]
    path = tmp_path / "one_instant.jsonl"
    path.write_text("".join(json.dumps(dict(json.loads(line), timestamp=5)) + "\n" for line in lines))
    args = _parse(["simulate", "--planner", "--scale", "2", "--trace", str(path)])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "the trace needs requests spread over time" in err and "period" not in err, err


def test_s29_d4_a_trace_of_seconds_keeps_the_figures_of_its_worker_hours():
    """Worker-hours are in the timeline's hours: a 20 s trace's day has hundredths of them, and
    at 0.01 h the static fleet's 16 prefill and 1 decode workers read 0.09 and 0.01 h, and
    planned_over_static, a ratio of such rounded hours, read 0.7 for a run's 0.7298."""
    from kvtier.planner.workers import SLATargets
    from kvtier.sim.cluster import load_cluster
    from kvtier.sim.trace import parse_trace_lines

    lines = [json.dumps({"timestamp": 50 * i, "input_length": 8192, "output_length": 100,
                         "hash_ids": list(range(100 * i, 100 * i + 16))}) for i in range(400)]
    out = fleet.simulate_planned_day(parse_trace_lines(lines), load_cluster(), SLATargets(2.0, 0.05, 0.9), copies=1)
    static = out["with_tier"]["static"]
    assert out["static_worker_hours"] < 0.2   # the case: hundredths of an hour
    # both static pools run the whole timeline: their hours are in the ratio of their workers
    assert static["prefill_worker_hours"] / static["decode_worker_hours"] == pytest.approx(
        static["prefill_workers"] / static["decode_workers"], rel=1e-3)
    assert out["static_worker_hours"] == pytest.approx(
        static["prefill_worker_hours"] + static["decode_worker_hours"], rel=1e-3)
    assert out["planned_over_static"] == pytest.approx(
        out["planned_worker_hours"] / out["static_worker_hours"], rel=1e-3)
    assert 0 < out["planned_over_static"] < 1
