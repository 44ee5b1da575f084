"""``kvtier bench prefill``: the profile it writes is a calibration table the planner reads."""

from __future__ import annotations

import argparse
import json

import pytest

from kvtier.bench import prefill as bench_prefill
from kvtier.planner.costmodel import PrefillCostModel
from kvtier.planner.hardware import cost_models
from kvtier.planner.models import geometry_from_hf_config, load_model


def _parse(argv):
    parser = argparse.ArgumentParser()
    bench_prefill.register(parser.add_subparsers())
    return parser.parse_args(argv)


def test_profile_round_trips_into_the_cost_model(tmp_path, monkeypatch, capsys):
    """With the measurement replaced by a known machine, the written profile predicts it."""

    def fake_measure(model_config, tokens, repeat, device):
        truth = PrefillCostModel(geometry_from_hf_config(model_config), 5e10, 2e11, overhead_s=0.01)
        return [(n, truth.seconds(n)) for n in tokens], {"torch": "test", "threads": 1}

    monkeypatch.setattr(bench_prefill, "measure", fake_measure)
    monkeypatch.setattr(bench_prefill, "_memory_bandwidth", lambda: 2e10)
    path = tmp_path / "prefill_testcpu.json"
    args = _parse(["prefill", "--output", str(path), "--accelerator", "testcpu"])
    assert args.func(args) == 0
    assert "wrote" in capsys.readouterr().out
    profile = json.loads(path.read_text())
    assert profile["fit"]["linear_flops_per_s"] == pytest.approx(5e10, rel=1e-6)
    assert profile["memory_bytes_per_s"] == 2e10 and profile["memory_bytes"] > 0
    costs = cost_models(load_model("llama-3-8b"), "cpu", 1, calibration_path=path)
    model = load_model("llama-3-8b")
    assert costs.prefill.seconds(1000) == pytest.approx(PrefillCostModel(model, 5e10, 2e11, 0.01).seconds(1000))


@pytest.mark.slow
def test_measures_a_random_weight_llama_on_this_cpu(tmp_path, request):
    # Importing transformers alone takes seconds: opt in with `pytest -m slow`.
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("builds a real (tiny) Llama with transformers; run with -m slow")
    pytest.importorskip("transformers")
    args = _parse(["prefill", "--tokens", "32,64,128", "--layers", "1", "--hidden", "64", "--heads", "4",
                   "--kv-heads", "2", "--intermediate", "128", "--vocab", "256", "--repeat", "1",
                   "--output", str(tmp_path / "p.json")])
    assert args.func(args) == 0
    profile = json.loads((tmp_path / "p.json").read_text())
    assert [p[0] for p in profile["points"]] == [32, 64, 128]
    assert all(p[1] > 0 for p in profile["points"])
