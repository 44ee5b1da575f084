"""The demo's replay end to end on a tiny model: two real engine processes, a restart between them.

The second process must serve the first one's contexts from the disk tier and
produce exactly the recompute's tokens.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.demo.report import Reporter  # noqa: E402
from kvtier.demo.runner import replay  # noqa: E402
from kvtier.demo.summary import summarize  # noqa: E402
from kvtier.demo.workload import Message, Scenario, Step  # noqa: E402
from kvtier.integrations.transformers.models import TINY_SPEC  # noqa: E402

TEXT = "def handler(request):\n    return respond(request.body, status=200)  # retry later\n" * 40


def tiny_scenario() -> Scenario:
    user = lambda text, n: Message("user", text, n)  # noqa: E731
    steps = [
        Step("turn", "ann", "first", [user(TEXT, 120)]),
        Step("turn", "ben", "first", [user("Why is the handler slow? " + TEXT, 40)]),
        Step("resume", "ann", "resume", [user("Root cause?", 8)]),
        Step("restart"),
        Step("turn", "ben", "after restart", [Message("tool", TEXT, 30)]),
        Step("resume", "ann", "resume after restart", [user("Which file?", 8)]),
    ]
    return Scenario("tiny", Message("system", TEXT, 100), steps, gen_tokens=5)


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> str:
    """A folder holding the tiny model, built once for the module: each test built its own
    (a tokenizer trained and weights written, seconds), which the replays find and load."""
    from kvtier.integrations.transformers.models import ensure_model

    root = tmp_path_factory.mktemp("models")
    ensure_model(TINY_SPEC, root)
    return str(root)


def test_replay_across_a_real_restart_serves_warm_from_disk(tmp_path, model_root):
    scenario = tiny_scenario()
    with Reporter(5, quiet_stdout=True) as reporter:
        turns, phases = replay(scenario, str(tmp_path / "store"), reporter, threads=1,
                               model_spec=asdict(TINY_SPEC), model_root=model_root)
    assert [t["index"] for t in turns] == [0, 1, 2, 4, 5]
    assert all(t["outputs_equal"] for t in turns)
    assert all(t["logits_max_abs_diff"] <= 1e-4 for t in turns)
    assert phases[0]["pid"] != phases[1]["pid"], "the restart is a new process"
    assert phases[1]["recovered_blocks"] > 0
    ann_resume, ben_after, ann_after = turns[2], turns[3], turns[4]
    assert ann_resume["tokens_by_tier"].keys() == {"host"}
    assert ann_resume["computed_tokens"] <= 16 + 8 + 1  # a partial block, the question, the marker
    # After the restart the host tier is empty: the shared system prompt and the
    # sessions come back from disk (ben's turn promotes the system prompt first).
    assert "disk" in ben_after["tokens_by_tier"]
    assert ann_after["cached_tokens"] >= ann_resume["context_tokens"] - 16
    assert "disk" in ann_after["tokens_by_tier"]
    summary = summarize(turns, phases, runtime_s=1.0, scenario=scenario.name)
    assert summary["outputs_equal"] and summary["resume_after_restart_tiers"]


def test_replay_through_a_kvtier_server_resumes_from_it(tmp_path, monkeypatch, model_root):
    """`kvtier demo --remote URL`: the restarted process resumes from the shared server."""
    from kvtier.server.launch import ServerProcess

    token = "demo-token-" + "7" * 20
    (tmp_path / "srv").mkdir()
    with ServerProcess.start({"demo": token}, workdir=str(tmp_path / "srv"),
                             server={"capacity": "256MiB", "max_block": "1MiB"}) as srv:
        monkeypatch.setenv("KVTIER_TOKEN", token)
        with Reporter(5, quiet_stdout=True) as reporter:
            turns, phases = replay(tiny_scenario(), str(tmp_path / "unused"), reporter, threads=1,
                                   model_spec=asdict(TINY_SPEC), model_root=model_root,
                                   remote_url=srv.tcp_url)
    assert all(t["outputs_equal"] for t in turns)
    ann_resume, ann_after = turns[2], turns[4]
    assert ann_resume["tokens_by_tier"].keys() == {"host"}
    assert "remote" in ann_after["tokens_by_tier"], ann_after["tokens_by_tier"]
    assert ann_after["cached_tokens"] >= ann_resume["context_tokens"] - 16
    assert not (tmp_path / "unused").exists(), "no local disk tier with --remote"
