"""``kvtier bench vllm``'s own checks, through the real CLI and a real ``kvtier serve``, on engine
processes that answer from a table instead of running vLLM (s30 a13 D5, D6, D7; s31 a5 D2, D6):

* a kvtier system faster than vLLM's own prefix-cache hit (the floor) is posted with a warning;
* the logprob tolerance, measured from the floor, has a cap, and the floor is not judged by it;
* a kvtier store off the recompute is warned about, and one off the floor too fails the bench;
* ``--stores`` names only the systems the bench runs;
* ``--trace``'s flags are refused without ``--trace``.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvtier.bench import vllm as bench
from kvtier.cli.main import main

#: tokens each table engine answers as cached or loaded, short of the prompt (under one kvtier block)
SHORT_BY = 16


class TableEngines:
    """Stand-ins for vLLM's engine processes (``EngineProcess``' calls), answering each ``ttft``
    from a table: per engine, the TTFT of its n-th call of a prompt (cycled: the vllm engine runs
    the recompute then the floor, the host engine its cold run then its hit, the remote engine one
    hit) and the amount added to every logprob."""

    def __init__(self, ttft: dict[str, list[float]], logprob_delta: dict[tuple[str, int], float]) -> None:
        self.ttft, self.logprob_delta = ttft, logprob_delta
        self.started: list[str] = []
        outer = self

        class Engine:
            def __init__(self, settings, log_path, env=None):
                self.name, self.log_path, self.calls = log_path.stem.removeprefix("engine-"), log_path, 0
                outer.started.append(self.name)

            def wait_ready(self, timeout=0):
                pass

            def close(self):
                pass

            def call(self, op, timeout=0, **kw):
                if op == "reset":
                    return {"ok": True}
                if op == "stats":
                    return {"worker": {"load_seconds": 0.0, "store": {}}}
                if op != "ttft":
                    return {}
                return outer.answer(self, kw["prompt"], kw["max_tokens"])

        self.Engine = Engine

    def answer(self, engine, prompt: list[int], max_tokens: int) -> dict:
        times = self.ttft[engine.name]
        nth = engine.calls % len(times)
        engine.calls += 1
        delta = self.logprob_delta.get((engine.name, nth), 0.0)
        recompute = engine.name == "vllm" and nth == 0
        return {"ttft_s": times[nth], "num_cached_tokens": 0 if recompute else len(prompt) - SHORT_BY,
                "kv_transfer_params": {"kvtier_loaded_tokens": len(prompt) - SHORT_BY},
                "token_ids": list(range(max_tokens)),
                "logprobs": [[(k, -1.0 - 0.1 * k + delta) for k in range(5)] for _ in range(max_tokens)],
                "steps_s": [0.01, 0.02]}


@pytest.fixture
def engines(monkeypatch):
    """Install table engines (``engines.ttft`` / ``engines.logprob_delta`` to set) and a model path."""
    import kvtier.integrations.transformers.models as models
    import kvtier.integrations.vllm.engine_proc as engine_proc

    table = TableEngines({"vllm": [1.0, 0.1], "host": [1.2, 0.12], "remote": [0.15]}, {})
    monkeypatch.setattr(engine_proc, "EngineProcess", table.Engine)
    monkeypatch.setattr(models, "ensure_model", lambda spec: ("/no-model-is-loaded",))
    find_spec = importlib.util.find_spec   # the bench asks whether vLLM is installed before anything
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: find_spec("json") if name == "vllm" else find_spec(name, *a))
    return table


def _bench_json(capsys, *argv: str, rc: int = 0) -> tuple[dict, str]:
    """The bench's JSON and stderr; its exit code must be ``rc`` (the figures are posted either way)."""
    got = main(["bench", "vllm", "--no-lmcache", "--tokens", "512", "--gen-tokens", "2", "--json", *argv])
    out, err = capsys.readouterr()
    assert got == rc, err
    return json.loads(out), err


def test_a_kvtier_ttft_below_the_floor_is_posted_with_a_warning(engines, capsys):
    """The floor is vLLM's own hit of the same prompt: no store can do better. host_vs_floor 0.5
    was posted with no warning (the command had no ``warnings`` at all)."""
    engines.ttft.update({"vllm": [1.0, 0.1], "host": [1.2, 0.05], "remote": [0.04]})
    r, err = _bench_json(capsys, "--runs", "3")
    assert r["host_vs_floor"] == 0.5 and r["remote_vs_floor"] == 0.4
    for name in ("floor_vs_host", "floor_vs_host_paired", "floor_vs_remote", "floor_vs_remote_paired"):
        assert any(w.startswith(f"{name} = ") and "floor" in w for w in r["warnings"]), (name, r["warnings"])
        assert f"WARNING: {name} = " in err
    # control: kvtier slower than the floor, as it must be: no warning
    engines.ttft.update({"vllm": [1.0, 0.1], "host": [1.2, 0.12], "remote": [0.15]})
    r, err = _bench_json(capsys, "--runs", "1")
    assert r["warnings"] == [] and "WARNING" not in err


def test_the_logprob_tolerance_is_capped_and_the_floor_is_not_judged_by_itself(engines, capsys):
    """The tolerance was 4x the floor's own difference with no bound: a floor 0.25 off the
    recompute let loads 0.9 off every logprob pass as equal, and logprobs_equal.prefix_cache
    compared the floor with a tolerance made from it. (Loads 0.9 off the recompute and 0.65 off
    the floor are wrong KV: since s31 a5 D2 the bench exits 1 on them, after its figures.)"""
    engines.logprob_delta.update({("vllm", 1): 0.25, ("host", 1): 0.9, ("remote", 0): 0.9})
    r, err = _bench_json(capsys, "--runs", "1", rc=1)
    assert r["logprobs_max_abs_diff"]["prefix_cache"] == pytest.approx(0.25)
    assert r["logprobs_equal"] == {"host": False, "remote": False}
    assert r["logprob_tolerance"] == bench.LOGPROB_ATOL_MAX
    assert [w for w in r["warnings"] if "floor is off the recompute (|Δ| 0.25" in w], r["warnings"]
    assert "WARNING: vLLM's prefix-cache floor is off the recompute" in err
    # control: the floor a rounding off the recompute, the loads bit-equal to it: equal, no warning
    engines.logprob_delta.clear()
    engines.logprob_delta.update({("vllm", 1): 3e-6, ("host", 1): 3e-6, ("remote", 0): 3e-6})
    r, err = _bench_json(capsys, "--runs", "1")
    assert r["logprob_tolerance"] == pytest.approx(bench.LOGPROB_TOL_FACTOR * 3e-6, rel=0.05)
    assert r["logprobs_equal"] == {"host": True, "remote": True} and r["warnings"] == []


def test_a_store_off_the_recompute_and_the_floor_is_warned_about_and_fails_the_bench(engines, capsys):
    """s31 a5 D2: the host hit 0.9 nats off every logprob (wrong KV) was posted with its TTFT and
    speedup, no warning and exit 0; only a False in one column said so."""
    engines.logprob_delta.update({("vllm", 1): 3e-6, ("host", 1): 0.9, ("remote", 0): 3e-6})
    r, err = _bench_json(capsys, "--runs", "1", rc=1)
    assert r["logprobs_equal"] == {"host": False, "remote": True}
    assert r["logprobs_equal_to_floor"] == {"host": False, "remote": True}
    [warning] = r["warnings"]
    assert warning.startswith("kvtier host's logprobs are off the recompute's (|Δ| 0.9") and "wrong KV" in warning
    assert "WARNING: kvtier host's logprobs" in err
    assert "kvtier bench vllm: kvtier host loaded KV that changes the outputs" in err
    assert "kvtier remote loaded" not in err   # within the tolerance of the recompute: equal


def test_a_store_bit_equal_to_a_floor_off_the_recompute_passes_with_warnings(engines, capsys):
    """--model deepseek: vLLM's own hit takes another kernel path on CPU and is off the recompute
    past the cap; a store bit-equal to that hit loaded exactly what vLLM caches. Warned about
    (the floor, and each store not equal to the recompute), but no failure."""
    engines.logprob_delta.update({("vllm", 1): 0.25, ("host", 1): 0.25, ("remote", 0): 0.25})
    r, err = _bench_json(capsys, "--runs", "1")
    assert r["logprobs_equal"] == {"host": False, "remote": False}
    assert r["logprobs_equal_to_floor"] == {"host": True, "remote": True}
    assert [w for w in r["warnings"] if "floor is off the recompute" in w]
    for name in ("host", "remote"):
        assert [w for w in r["warnings"] if w.startswith(f"kvtier {name}'s logprobs are off the recompute's")
                and "bit-equal to vLLM's own prefix-cache hit" in w and "wrong KV" not in w], r["warnings"]
    assert "loaded KV that changes the outputs" not in err


def test_the_mooncake_store_is_judged_as_host_and_remote_are():
    """The Mooncake system posts its own keys (``mooncake_logprobs_equal``, ``…_max_abs_diff``):
    off the recompute and the floor, it is wrong KV as well; bit-equal to the floor, it passes."""
    result = {"stores": ["host", "remote", "mooncake"], "logprob_tolerance": 1e-5,
              "logprobs_equal": {"host": True, "remote": True}, "logprobs_max_abs_diff": {"host": 0.0, "remote": 0.0},
              "mooncake_logprobs_equal": False, "mooncake_logprobs_max_abs_diff": None,
              "logprobs_equal_to_floor": {"host": True, "remote": True, "mooncake": False}}
    assert bench.wrong_stores(result) == ["mooncake"]
    [warning] = bench._exactness_warnings(result)
    assert warning.startswith("kvtier mooncake's logprobs are off the recompute's (other top-5 ids")
    assert "wrong KV" in warning
    result["logprobs_equal_to_floor"]["mooncake"] = True
    assert bench.wrong_stores(result) == [] and "wrong KV" not in bench._exactness_warnings(result)[0]


TRACE_FLAGS = [["--requests", "99"], ["--trace-model", "tiny"], ["--trace-block-tokens", "16"], ["--start", "3"],
               ["--warmup-requests", "5"], ["--span-s", "10"], ["--kv-fraction", "0.5"], ["--full-warmup"]]


@pytest.mark.parametrize("flag", TRACE_FLAGS, ids=[f[0] for f in TRACE_FLAGS])
def test_trace_flags_without_trace_are_refused_before_any_engine_starts(engines, capsys, flag):
    """s31 a5 D6: each was accepted and ignored: the TTFT bench ran and exited 0."""
    rc = main(["bench", "vllm", "--no-lmcache", "--tokens", "512", "--runs", "1", "--json", *flag])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and engines.started == [], err
    assert f"{flag[0]} is --trace's" in err, err


def test_trace_flags_with_trace_are_read(engines, capsys, tmp_path):
    """Control: with --trace they are the replay's; the empty trace is refused by the replay
    itself, after the flags were taken (and the defaults filled in where none was given)."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for flags in ([], [f for flag in TRACE_FLAGS for f in flag]):
        assert main(["bench", "vllm", "--trace", str(empty), "--json", *flags]) == 2
        err = capsys.readouterr().err
        assert "holds no request" in err and "--trace's" not in err, err
    assert engines.started == []


@pytest.mark.parametrize("stores, says", [
    ("disk", "no system 'disk'"), ("nonsense", "no system 'nonsense'"), ("host,remote,disk", "no system 'disk'"),
    ("host", "lacks remote"), ("mooncake", "lacks host and remote"),
])
def test_stores_names_only_the_systems_the_bench_runs(engines, capsys, stores, says):
    """--stores read only "mooncake": disk, a typo or host alone ran host and remote, and README
    promised a disk figure the bench never had."""
    rc = main(["bench", "vllm", "--no-lmcache", "--tokens", "512", "--runs", "1", "--stores", stores, "--json"])
    err = capsys.readouterr().err
    assert rc == 2 and says in err, err
    assert engines.started == []     # refused before any engine starts


def test_stores_in_any_order_run_host_and_remote(engines, capsys):
    r, _ = _bench_json(capsys, "--runs", "1", "--stores", "remote, host")
    assert r["stores"] == ["host", "remote"] and sorted(set(engines.started)) == ["host", "remote", "vllm"]
