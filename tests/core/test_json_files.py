"""read_json_object: a user's JSON file is read, or refused with a ConfigError naming the file and
what it was meant to be, never a traceback (audit s26, D3: 100,000 '[' raised RecursionError), and
never a NaN carried into a plan."""

from __future__ import annotations

import argparse
import math

import pytest

from kvtier.errors import ConfigError
from kvtier.json_files import read_json_object


def test_a_deeply_nested_file_is_a_config_error(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text("[" * 100_000)
    with pytest.raises(ConfigError, match=f"cluster config {path}: .*nested too deeply"):
        read_json_object(path, "cluster config")
    path.write_text('{"a": ' * 50 + "1" + "}" * 50)      # control: nesting JSON's parser takes
    assert read_json_object(path, "cluster config")["a"]["a"]["a"]


@pytest.mark.parametrize("text", ['{"x": NaN}', '{"x": [1, {"y": NaN}]}'])
def test_nan_is_refused_naming_the_file(tmp_path, text):
    path = tmp_path / "model.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"model config {path}: NaN"):
        read_json_object(path, "model config")


def test_infinity_is_read_as_json_reads_1e999(tmp_path):
    """Ordered, so the range checks after refuse it where it does not belong; written by kvtier
    itself in a calibration profile's fit (see the round trip below)."""
    path = tmp_path / "t.json"
    path.write_text('{"a": Infinity, "b": -Infinity, "c": 1e999, "d": 1.5}')
    assert read_json_object(path, "t") == {"a": math.inf, "b": -math.inf, "c": math.inf, "d": 1.5}


def test_a_profile_whose_fit_is_infinite_reads_back_as_a_calibration(tmp_path, monkeypatch, capsys):
    """``kvtier bench prefill`` writes ``Infinity`` for the attention rate of a fit that drops the
    attention term; the planner must still read the file it wrote."""
    from kvtier.bench import prefill as bench_prefill
    from kvtier.planner.costmodel import PrefillCostModel
    from kvtier.planner.hardware import cost_models
    from kvtier.planner.models import geometry_from_hf_config, load_model

    def linear_machine(model_config, tokens, repeat, device):
        # a little under linear in the tokens: the best fit with an attention term has a negative one
        truth = PrefillCostModel(geometry_from_hf_config(model_config), 5e10, math.inf, overhead_s=0.01)
        return [(n, truth.seconds(n) * (1 - 0.01 * n / max(tokens))) for n in tokens], {"torch": "test"}

    monkeypatch.setattr(bench_prefill, "measure", linear_machine)
    monkeypatch.setattr(bench_prefill, "_memory_bandwidth", lambda: 2e10)
    parser = argparse.ArgumentParser()
    bench_prefill.register(parser.add_subparsers())
    path = tmp_path / "prefill_testcpu.json"
    args = parser.parse_args(["prefill", "--output", str(path), "--accelerator", "testcpu"])
    assert args.func(args) == 0
    capsys.readouterr()
    assert '"attention_flops_per_s": Infinity' in path.read_text()   # control: the case is the one meant
    costs = cost_models(load_model("llama-3-8b"), "cpu", 1, calibration_path=path)
    assert costs.prefill.seconds(1000) > 0.01


def test_other_failures_are_still_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        read_json_object(tmp_path / "absent.json", "cluster config")
    with pytest.raises(ConfigError, match="not a readable JSON file"):
        read_json_object(tmp_path, "cluster config")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ConfigError, match="expected a JSON object, got list"):
        read_json_object(tmp_path / "list.json", "cluster config")


def test_printed_json_is_strict_a_figure_that_is_not_finite_is_null():
    """A bench's --json line is read by jq, Go, JavaScript: none takes NaN or Infinity, which
    ``json.dumps`` writes by default (bench lookup, route, vllm, server-memory, restart and
    prefill did)."""
    import json

    from kvtier.json_files import strict_json

    value = {"ratio": float("nan"), "p99": [1.5, float("inf"), -float("inf")], "n": 3, "ok": (True, None)}
    text = strict_json(value)
    assert json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c))) == {
        "ratio": None, "p99": [1.5, None, None], "n": 3, "ok": [True, None]}
