"""What ``kvtier demo`` concludes from its runs (s30 a15 D1, D2, D3): a run whose outputs differ
exits 1, a turn's NaN logits are reported as such in strict JSON, and a ``--remote`` server that
failed or took nothing during a phase is a warning in the output and the JSON."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
from rich.console import Console

from kvtier.demo.summary import summarize
from tests.demo.test_demo_input import _args, _cache
from tests.demo.test_summary import record

NAN = float("nan")


def _turns(diffs: list[float], equal: list[bool]) -> list[dict]:
    turns = [record(i, cold=2.0, warm=0.2, equal=same) for i, same in enumerate(equal)]
    for t, diff in zip(turns, diffs):
        t["logits_max_abs_diff"] = diff
    return turns


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def replay_returns(tmp_path, monkeypatch):
    """run_demo with the engine runs replaced by the turn records given to the returned setter."""
    from kvtier.demo import runner

    monkeypatch.setenv("XDG_CACHE_HOME", str(_cache(tmp_path)))
    infos = [{"phase": 1, "limits_gib_s": {"host": 9.0}, "store_stats": {}, "pid": 1}]

    def returning(turns: list[dict]) -> None:
        monkeypatch.setattr(runner, "replay", lambda *a, **k: (turns, infos))

    return returning


@pytest.mark.parametrize("as_json", [True, False])
def test_outputs_that_differ_exit_1_after_the_figures(replay_returns, capsys, as_json):
    from kvtier.demo import runner

    replay_returns(_turns([0.0, 3.0], equal=[True, False]))
    rc = runner.run_demo(_args(json=as_json))   # old code: 0
    out, err = capsys.readouterr()
    assert rc == 1
    assert "kvtier demo: outputs differ" in err and len([l for l in err.splitlines() if "kvtier demo:" in l]) == 1
    if as_json:
        assert _strict(out)["outputs_equal"] is False
    else:
        assert "outputs equal (greedy tokens, kvtier vs recompute): NO" in out


def test_control_equal_outputs_exit_0(replay_returns, capsys):
    from kvtier.demo import runner

    replay_returns(_turns([0.0, 1e-6], equal=[True, True]))
    assert runner.run_demo(_args()) == 0
    out, err = capsys.readouterr()
    assert _strict(out)["logits_max_abs_diff"] == 1e-6 and "kvtier demo:" not in err


@pytest.mark.parametrize("diffs", [[0.0, NAN], [NAN, 0.0]], ids=["nan_last", "nan_first"])
def test_a_turn_with_nan_logits_is_reported_in_strict_json(replay_returns, capsys, diffs):
    """max() over [0.0, nan] is 0.0 (the NaN turn hidden); over [nan, 0.0] nan, printed bare."""
    from kvtier.demo import runner

    replay_returns(_turns(diffs, equal=[d == 0.0 for d in diffs]))
    assert runner.run_demo(_args()) == 1
    summary = _strict(capsys.readouterr().out)   # old code: NaN (not JSON), or 0.0
    assert summary["logits_max_abs_diff"] is None and summary["logits_nan"] is True


def test_the_printed_summary_says_nan():
    from kvtier.demo.report import print_summary

    turns = _turns([0.0, NAN], equal=[True, False])
    summary = summarize(turns, [{"phase": 1}], runtime_s=1.0, scenario="t")
    buf = io.StringIO()
    print_summary(Console(file=buf, width=300), summary)
    line = next(l for l in buf.getvalue().splitlines() if l.startswith("outputs equal"))  # noqa: E741
    assert "NaN" in line and "0.00e+00" not in line, line


def test_phase_warnings_reach_the_summary_warnings():
    turns = _turns([0.0], equal=[True])
    summary = summarize(turns, [{"phase": 1, "warnings": ["the kvtier server tcp://h:1 failed 3 calls"]}],
                        runtime_s=1.0, scenario="t")
    assert summary["warnings"] == ["phase 1: the kvtier server tcp://h:1 failed 3 calls"]
    assert summary["logits_nan"] is False and not math.isnan(summary["logits_max_abs_diff"])


# --- the worker's report on its kvtier server ---

def _store_saving_through(url: str, token: str):
    """The demo's store settings over ``url`` (write-through: every save goes to the server), a
    context of 4 blocks saved."""
    from kvtier.core.layout import KVLayout
    from kvtier.demo.runner import store_settings
    from kvtier.store.config import StoreConfig, build_store

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", block_tokens=4)
    settings = {**store_settings("unused", url), "remote_token": token, "remote_timeout_s": 2.0}
    store = build_store(StoreConfig(**settings), layout)
    keys = [bytes([i]) * 32 for i in range(1, 5)]
    store.put(keys, [np.ones(layout.block_shape, np.float32)] * len(keys))
    return store


def test_the_worker_warns_when_its_kvtier_server_failed_and_took_nothing():
    import socket

    from kvtier.demo.worker import shared_tier_warnings

    with socket.socket() as s:   # nothing listens: the store takes the failures as misses
        s.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        store = _store_saving_through(url, "some-token")
        try:
            warnings = shared_tier_warnings(store.tiers, blocks_saved=store.stats()["store"]["puts"])
        finally:
            store.close()
    assert len(warnings) == 2, warnings
    assert "failed" in warnings[0] and url in warnings[0] and "refused" in warnings[0].lower()
    assert "took 0 bytes of the 4 blocks" in warnings[1]


def test_control_no_warning_from_a_kvtier_server_that_stored_the_blocks(tmp_path):
    from kvtier.demo.worker import shared_tier_warnings
    from kvtier.server.launch import ServerProcess

    token = "demo-token-" + "6" * 20
    with ServerProcess.start({"demo": token}, workdir=str(tmp_path)) as srv:
        store = _store_saving_through(srv.tcp_url, token)
        try:
            assert shared_tier_warnings(store.tiers, blocks_saved=store.stats()["store"]["puts"]) == []
        finally:
            store.close()
    assert shared_tier_warnings([], blocks_saved=4) == []   # no server, nothing to say
