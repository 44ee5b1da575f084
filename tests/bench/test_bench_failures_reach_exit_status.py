"""A bench that finds its own figures wrong says so on stderr and exits 1, after posting them
(audit s32 a7 D3, D4):

* ``bench restart``: a block read back OK with other bytes ("a cache may lose, never return a
  wrong block"), or a server section that did not run, exited 0;
* ``bench vllm --trace``: vLLM alone or kvtier caching more tokens than the exact reusable bound
  (hits on blocks never stored) was posted with no warning, exit 0.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvtier.bench import restart as bench_restart
from kvtier.bench import vllm_trace
from kvtier.cli.main import main

# -- D3: bench restart --------------------------------------------------------------------------------
RESTART = ["bench", "restart", "--blocks", "4", "--block-kib", "4", "--json"]


def test_a_clean_restart_exits_0(capsys):
    """Control: every block read back by a new process, with the right bytes."""
    assert main([*RESTART, "--no-server"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert (result["recovered_blocks"], result["wrong_blocks"]) == (4, 0) and err == ""


def test_a_block_read_back_with_other_bytes_fails_the_bench_after_its_figures(monkeypatch, capsys):
    """The reading process's answer for block 0 is another block's digest: what a tier returning
    OK with other bytes gives (the disk tier verifies its reads, so a fault is injected here)."""
    read = bench_restart._read_in_new_process

    def read_one_wrong(*args, **kwargs):
        answer = read(*args, **kwargs)
        answer["digests"][0] = answer["digests"][1]
        return answer

    monkeypatch.setattr(bench_restart, "_read_in_new_process", read_one_wrong)
    assert main([*RESTART, "--no-server"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["wrong_blocks"] == 1  # the figures are posted all the same
    assert "kvtier bench restart: 1 of 4 blocks read by a new process came back with other bytes" in err


def test_a_server_section_that_did_not_run_fails_the_bench_unless_skipped(monkeypatch, capsys):
    def no_server(*args, **kwargs):
        raise ImportError("No module named 'uvloop'")  # the server extras not installed

    monkeypatch.setattr(bench_restart, "run_server", no_server)
    assert main(RESTART) == 1
    out, err = capsys.readouterr()
    assert "uvloop" in json.loads(out)["server_error"]
    assert "the server section did not run (ImportError: No module named 'uvloop'); --no-server skips it" in err
    assert main([*RESTART, "--no-server"]) == 0  # control: not asked for, not missed


def test_wrong_blocks_from_the_restarted_server_are_a_failure():
    result = {"blocks": 8, "wrong_blocks": 0, "server_wrong_blocks": 2}
    assert bench_restart.failures(result, server=True) == [
        "2 of 8 blocks read from the restarted server came back with other bytes than were put"]
    assert bench_restart.failures({**result, "server_wrong_blocks": 0}, server=True) == []


# -- D4: bench vllm --trace ---------------------------------------------------------------------------
SLICE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head500.jsonl"
TRACE = ["bench", "vllm", "--trace", str(SLICE), "--trace-model", "tiny", "--warmup-requests", "30",
         "--requests", "12", "--no-lmcache", "--json"]


class ReplayEngines:
    """Stand-ins for the engine processes of the trace replay: each replay answered request by
    request, with the cached tokens ``cached(engine name, prompt tokens)`` says."""

    def __init__(self, cached) -> None:
        outer = self
        self.cached = cached

        class Engine:
            def __init__(self, settings, log_path, env=None):
                self.name = log_path.stem.removeprefix("engine-")

            def wait_ready(self, timeout=0):
                pass

            def close(self):
                pass

            def call(self, op, timeout=0, **kw):
                return outer.replay(self.name, kw["requests"]) if op == "replay" else {}

        self.Engine = Engine

    def replay(self, name: str, requests: list[dict]) -> dict:
        rows = [{"arrival_s": r["arrival_s"], "first_token_s": r["arrival_s"] + 0.05,
                 "finish_s": r["arrival_s"] + 0.2, "output_tokens": r["max_tokens"],
                 "prompt_tokens": len(r["prompt"]), "cached_tokens": self.cached(name, len(r["prompt"]))}
                for r in requests]
        return {"requests": rows, "idle_s": 0.0, "cpu_s": 1.0, "seconds": 1.0}


@pytest.fixture
def replay_with(monkeypatch):
    """Install replay engines answering with ``cached`` (and no model to build, no vLLM to find)."""
    import kvtier.integrations.transformers.models as models
    import kvtier.integrations.vllm.engine_proc as engine_proc

    monkeypatch.setattr(models, "ensure_model", lambda spec: ("/no-model-is-loaded",))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: find_spec("json") if name == "vllm" else find_spec(name, *a))

    def install(cached) -> None:
        monkeypatch.setattr(engine_proc, "EngineProcess", ReplayEngines(cached).Engine)

    return install


def _every_cacheable_page(name: str, prompt_tokens: int) -> int:
    """kvtier "hits" every whole page of every prompt, reusable or not: KV that is not the prompt's."""
    return vllm_trace.cacheable_blocks(prompt_tokens) * vllm_trace.HASH_TOKENS if name == "kvtier" else 0


def test_kvtier_above_the_reusable_bound_is_warned_about_and_fails_the_bench(replay_with, capsys):
    replay_with(_every_cacheable_page)
    assert main(TRACE) == 1
    out, err = capsys.readouterr()
    result = json.loads(out)  # the figures are posted all the same
    above = result["systems"]["kvtier"]["cached_vs_reusable"]["requests_above"]
    assert above > 0 and result["systems"]["vllm"]["cached_vs_reusable"]["requests_above"] == 0
    assert len(result["warnings"]) == 1 and result["warnings"][0].startswith(f"kvtier: {above} requests cached ")
    assert f"WARNING: {result['warnings'][0]}" in err and "vllm:" not in err


def test_a_replay_within_the_bound_exits_0(replay_with, capsys):
    """Control: below the bound is a cache too small or a miss, not a bug."""
    replay_with(lambda name, prompt_tokens: 0)
    assert main(TRACE) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["warnings"] == [] and "WARNING" not in err


def test_lmcache_above_the_bound_is_no_bug():
    """LMCache also loads a prompt's last partial chunk: it may pass the whole-page bound."""
    over = {"cached_vs_reusable": {"requests_above": 3, "tokens_above": 40}}
    within = {"cached_vs_reusable": {"requests_above": 0, "tokens_above": 0}}
    assert vllm_trace.above_bound({"vllm": within, "kvtier": within, "lmcache": over}) == []
    assert vllm_trace.above_bound({"vllm": over, "kvtier": within, "lmcache": None})[0].startswith(
        "vllm: 3 requests cached 40 tokens more")
