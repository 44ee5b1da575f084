"""``bench prefill`` fits three terms: it needs three distinct prompt lengths (audit s31 a5 D5)."""

from __future__ import annotations

import pytest

from kvtier.cli.main import main

#: a model small enough that the old code's measurement of the bad input took seconds, not minutes
TINY = ["--layers", "1", "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--intermediate", "64", "--vocab", "100",
        "--repeat", "1"]


@pytest.mark.parametrize("tokens", ["32,32,32", "32,64,64", "0,32,64"])
def test_fewer_than_three_distinct_lengths_are_refused_on_stderr(tmp_path, capsys, tokens):
    """``--tokens 32,32,32`` passed the "at least 3 lengths" gate, fitted overhead, linear and
    attention rates to one point and wrote a profile the planner reads as this machine's cost."""
    profile = tmp_path / "p.json"
    rc = main(["bench", "prefill", "--tokens", tokens, *TINY, "--output", str(profile)])
    out, err = capsys.readouterr()
    assert rc == 2 and not profile.exists()
    assert out == "" and "at least 3 distinct --tokens lengths" in err, (out, err)
