"""``kvtier bench route``: each mode refuses the other mode's flags, by name, rather than run
without them (s30 a13 D3): ``--trace --workers 4 --runs 10`` replayed on two workers,
``--synthetic --policies round-robin --model demo`` timed tier-aware with no model."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli.main import main

SLICE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head500.jsonl"
SYNTHETIC = ["bench", "route", "--synthetic", "--tokens", "64", "--workers", "2", "--runs", "1",
             "--indexed-blocks", "10", "--json"]
TRACE = ["bench", "route", "--trace", str(SLICE), "--requests", "4", "--warmup-requests", "2", "--json"]


class _ModelBuilt(Exception):
    """The trace replay got past its flags and the window to the model build: no engine starts."""


@pytest.fixture
def stop_at_the_model(monkeypatch):
    import kvtier.integrations.transformers.models as models

    def stop(*_a, **_k):
        raise _ModelBuilt

    monkeypatch.setattr(models, "ensure_model", stop)


@pytest.mark.parametrize("extra, says", [
    (["--workers", "4", "--runs", "10"], "--workers and --runs are --synthetic's"),
    (["--tokens", "1024"], "--tokens is --synthetic's"),
    (["--indexed-blocks", "5"], "--indexed-blocks is --synthetic's"),
    (["--workers", "16"], "--workers is --synthetic's"),     # its default, given: still refused
])
def test_trace_refuses_the_synthetic_flags(stop_at_the_model, capsys, extra, says):
    assert main([*TRACE, *extra]) == 2
    err = capsys.readouterr().err
    assert says in err and "--trace-block-tokens" in err, err


@pytest.mark.parametrize("extra, says", [
    (["--policies", "round-robin", "--model", "demo", "--requests", "5"],
     "--model, --requests and --policies are --trace's"),
    (["--model", "mid"], "--model is --trace's"),           # its default, given: still refused
    (["--trace-block-tokens", "16"], "--trace-block-tokens is --trace's"),
    (["--no-priming"], "--no-priming is --trace's"),
    (["--span-s", "20", "--workdir", "/tmp/x"], "--span-s and --workdir are --trace's"),
])
def test_synthetic_refuses_the_trace_flags(capsys, extra, says):
    assert main([*SYNTHETIC, *extra]) == 2
    err = capsys.readouterr().err
    assert says in err and "--synthetic times the router's decision" in err, err


def test_each_mode_runs_with_its_own_flags(stop_at_the_model, capsys):
    """Controls: the flags a mode reads are taken, and the ones left out have their defaults."""
    assert main(SYNTHETIC) == 0
    out = capsys.readouterr().out
    assert '"workers": 2' in out and '"block_tokens": 32' in out     # --block-tokens left out: the default
    with pytest.raises(_ModelBuilt):   # past the flag checks and the trace window, to the model
        main([*TRACE, "--policies", "round-robin", "--model", "tiny", "--no-priming"])
