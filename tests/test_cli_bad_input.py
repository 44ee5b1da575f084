"""Bad input on the command line gets a clear error naming what is wrong, never a traceback,
never a NaN carried into a plan, a price or a timeout (``float("nan")`` passes every range check
after it). Each case was found failing so: a traceback, or accepted and run with a NaN.

Commands run in this process through ``kvtier.cli.main.main`` (argparse's own errors exit 2 as
SystemExit); the two that start servers run as processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvtier.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def _run(argv, capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.fixture
def not_json(tmp_path) -> str:
    path = tmp_path / "hostname"
    path.write_text("not json\n")
    return str(path)


@pytest.mark.parametrize("argv, says", [
    (["simulate", "--cluster", "{not_json}"], "cluster config {not_json}: not a readable JSON file"),
    (["simulate", "--cluster", "{tmp}"], "not a readable JSON file"),
    (["simulate", "--calibration", "{not_json}", "--limit", "10"], "calibration table"),
    (["plan", "capacity", "--model", "{not_json}", "--users", "1", "--context-tokens", "10"], "model config"),
    (["plan", "capacity", "--users", "1", "--context-tokens", "10", "--replication", "nan"], "not a finite number"),
    (["plan", "capacity", "--users", "1", "--context-tokens", "10", "--overhead", "nan"], "not a finite number"),
    (["plan", "workers", "--ttft", "nan", "--itl", "0.05", "--rate", "2", "--input-tokens", "100",
      "--output-tokens", "10", "--hit-rate", "0.5"], "not a finite number"),
    (["plan", "workers", "--ttft", "1", "--itl", "0.05", "--rate", "2", "--input-tokens", "100",
      "--output-tokens", "-1", "--hit-rate", "0.5"], "output length"),
    (["plan", "live", "--router", "127.0.0.1:1", "--ttft", "1", "--itl", "0.05", "--metrics-port", "99999"],
     "--metrics-port must be 0-65535"),
    (["plan", "live", "--router", "127.0.0.1:1", "--ttft", "1", "--itl", "0.05", "--output-tokens", "-1"],
     "--output-tokens is the mean output tokens per request, > 0"),
    (["bench", "storage", "--block-mib", "nan"], "not a finite number"),
    (["bench", "storage", "--block-mib", "0"], "must be positive"),
    (["bench", "storage", "--tier", "disk", "--dir", "{not_json}"], "is not a directory"),
    (["bench", "remote", "--block-mib", "0"], "must be positive"),
    (["bench", "server-memory", "--capacity", "0"], "must hold at least one block"),
    (["bench", "server-memory", "--seed", "-1"], "--seed must be >= 0"),
    (["bench", "restart", "--dir", "{not_json}"], "is not a directory"),
    (["serve", "--config", "{tmp}"], "cannot be read"),
    (["serve", "--idle-timeout-s", "nan"], "not a finite number"),
    (["serve", "--log-level", "nope"], "invalid choice"),
    (["route", "--worker", "http://127.0.0.1:1", "--temperature", "nan"], "not a finite number"),
    (["route", "--worker", "http://:1"], "needs a host"),
    (["route", "--worker", "http://127.0.0.1:99999"], "out of range"),
    (["route", "--worker", "http://127.0.0.1:1,events=x"], "is not a ZMQ endpoint"),
    (["route", "--worker", "http://127.0.0.1:1,events=tcp://*:5557"], "give the worker's host"),
    (["route", "--worker", "http://127.0.0.1:1", "--shared-events", "x"], "is not a ZMQ endpoint"),
    (["route", "--worker", "http://127.0.0.1:1", "--health-interval-s", "0"], "health_interval_s must be > 0"),
])
def test_bad_input_is_a_clear_error_not_a_traceback(argv, says, not_json, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [a.format(not_json=not_json, tmp=tmp_path) for a in argv]
    rc, out = _run(argv, capsys)
    assert rc == 2 and "Traceback" not in out, out
    assert says.format(not_json=not_json) in out, out


def test_positive_controls_the_same_commands_run_with_good_input(tmp_path, capsys):
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"prefill_workers": 2}))
    assert _run(["simulate", "--cluster", str(cluster), "--limit", "50", "--json"], capsys)[0] == 0
    assert _run(["plan", "capacity", "--users", "1", "--context-tokens", "10", "--replication", "2"], capsys)[0] == 0
    rc, out = _run(["plan", "workers", "--ttft", "1", "--itl", "0.05", "--rate", "2", "--input-tokens", "100",
                    "--output-tokens", "0", "--hit-rate", "0.5"], capsys)
    assert rc == 0, out


SLICE = ROOT / "tests" / "data" / "mooncake_conversation_head500.jsonl"
ROUTE_SYNTHETIC = ["bench", "route", "--synthetic", "--workers", "2", "--indexed-blocks", "100", "--runs", "3",
                   "--tokens", "64"]


@pytest.fixture
def odd_files(tmp_path) -> dict:
    """A trace with a number json reads as infinity, one that is binary, and a plain file."""
    files = {"overflow": tmp_path / "overflow.jsonl", "binary": tmp_path / "t.bin", "file": tmp_path / "plots"}
    files["overflow"].write_text('{"timestamp": 0, "input_length": 1e999, "output_length": 10, "hash_ids": [1]}\n')
    files["binary"].write_bytes(b"\x1f\x8b\x08\x00garbage\xff\xfe\n")
    files["file"].write_text("I am a file")
    return {name: str(path) for name, path in files.items()}


@pytest.mark.parametrize("argv, says", [
    (["simulate", "--trace", "{overflow}", "--json"], "line 1: not a Mooncake request"),
    (["simulate", "--trace", "{binary}", "--json"], "not a UTF-8 JSONL"),
    (["plan", "workers", "--ttft", "1", "--itl", "0.05", "--trace", "{binary}"], "not a UTF-8 JSONL"),
    (["simulate", "--trace", "{slice}", "--limit", "5", "--policies", "round_robin", "--plot", "{file}"],
     "--plot DIR: {file} exists and is not a directory"),
    (["simulate", "--trace", "{slice}", "--planner", "--interval", "1e-7", "--json"], "--interval must be >= 0.864"),
    ([*ROUTE_SYNTHETIC, "--tokens", "0"], "--tokens >= --block-tokens"),
    ([*ROUTE_SYNTHETIC, "--runs", "0"], "--runs >= 1"),
    ([*ROUTE_SYNTHETIC, "--indexed-blocks", "-1"], "--indexed-blocks >= 0"),
])
def test_odd_files_and_degenerate_counts_are_a_clear_error(argv, says, odd_files, capsys):
    """Before: OverflowError, UnicodeDecodeError, FileExistsError after the whole run, numpy's
    MemoryError for 6 TiB of bins, numpy's ValueError and StatisticsError (audit s25 D1, D2, D7, D9, D12)."""
    names = {**odd_files, "slice": str(SLICE)}
    rc, out = _run([a.format(**names) for a in argv], capsys)
    assert rc == 2 and "Traceback" not in out, out
    assert says.format(**names) in out, out


def test_positive_controls_for_the_odd_files_and_counts(tmp_path, capsys):
    rc, out = _run(ROUTE_SYNTHETIC + ["--json"], capsys)
    assert rc == 0 and json.loads(out)["runs"] == 3, out
    rc, out = _run(["simulate", "--trace", str(SLICE), "--planner", "--interval", "864", "--scale", "2", "--json"],
                   capsys)
    assert rc == 0 and json.loads(out)["planner"]["in_day_seconds"]["interval_s"] == 864, out


def test_router_config_refuses_nan_and_names_the_setting():
    from kvtier.errors import ConfigError
    from kvtier.router.config import RouterConfig, WorkerSpec

    good = RouterConfig(workers=[WorkerSpec.parse("http://127.0.0.1:1,events=ipc:///tmp/w.events")])
    assert good.check() is good                                          # control
    for name, value in [("host_read_bytes_per_s", float("nan")), ("decode_block_s", float("inf")),
                        ("drain_timeout_s", float("nan")), ("block_tokens", 32.0), ("port", 70000),
                        ("temperature", "0.5")]:
        config = RouterConfig(workers=list(good.workers), **{name: value})
        with pytest.raises(ConfigError, match=name):
            config.check()


def _tokenizer_dir(tmp_path: Path) -> Path:
    from kvtier.integrations.transformers.models import train_tokenizer

    model = tmp_path / "model"
    train_tokenizer(300, model)
    return model


def test_route_with_port_0_announces_the_port_it_listens_on_and_a_taken_port_is_a_clear_error(tmp_path):
    model = _tokenizer_dir(tmp_path)
    base = [sys.executable, "-m", "kvtier.cli.main", "route", "--model-path", str(model), "--kv-bytes-per-token",
            "4096", "--worker", "http://127.0.0.1:1"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([*base, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)
    try:
        ready = json.loads(proc.stdout.readline())
        port = int(ready["listen"].rsplit(":", 1)[1])
        assert port != 0, ready      # the old line said :0, which nobody can connect to
        try:   # the router answers there (its one worker is down: a 503, in the OpenAI error format)
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        except urllib.error.HTTPError as err:
            assert err.code == 503 and "error" in json.loads(err.read())
        taken = subprocess.run([*base, "--port", str(port)], capture_output=True, text=True, cwd=ROOT, env=env,
                               timeout=60)
        assert taken.returncode == 1 and "Traceback" not in taken.stderr, taken.stderr
        assert "cannot listen" in taken.stderr and "in use" in taken.stderr, taken.stderr
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_start_failures_name_their_cause_and_only_a_taken_port_gets_the_port_advice(tmp_path):
    from kvtier.server.auth import hash_token

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        base = [sys.executable, "-m", "kvtier.cli.main", "serve", "--tenant", f"a={hash_token('tok')}"]
        taken = subprocess.run([*base, "--listen", f"tcp://127.0.0.1:{port}"], capture_output=True, text=True,
                               cwd=ROOT, env=env, timeout=60)
        audit = subprocess.run([*base, "--listen", "tcp://127.0.0.1:0", "--audit-log", str(tmp_path / "no" / "x")],
                               capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    for run in (taken, audit):
        assert run.returncode == 1 and "Traceback" not in run.stderr and "cannot start" in run.stderr, run.stderr
    assert "pick a free port" in taken.stderr
    assert "pick a free port" not in audit.stderr and "No such file" in audit.stderr


@pytest.mark.parametrize("argv, says", [
    (["simulate", "--cluster", "{deep}"], "cluster config {deep}: not a readable JSON file"),
    (["simulate", "--calibration", "{deep}", "--limit", "10"], "calibration table {deep}: not a readable JSON file"),
    (["plan", "capacity", "--model", "{deep}", "--users", "1", "--context-tokens", "10"], "model config {deep}"),
    (["plan", "capacity", "--model", "{nan}", "--users", "1", "--context-tokens", "10"], "model config {nan}: NaN"),
])
def test_a_deeply_nested_or_nan_json_file_is_a_clear_error(argv, says, tmp_path, capsys):
    """Before: RecursionError out of main() for 100,000 '[' (audit s26, D3)."""
    names = {"deep": tmp_path / "deep.json", "nan": tmp_path / "nan.json"}
    names["deep"].write_text("[" * 100_000)
    names["nan"].write_text('{"num_hidden_layers": 2, "hidden_size": NaN, "num_attention_heads": 4, '
                            '"intermediate_size": 128}')
    rc, out = _run([a.format(**names) for a in argv], capsys)
    assert rc == 2 and "Traceback" not in out, out
    assert says.format(**names) in out, out


# --- audit s26: `kvtier mooncake up --segment` below Mooncake's minimum (D11), Ctrl-C (D6),
#     `kvtier demo --threads` (D4) ---

@pytest.mark.parametrize("argv, says", [
    (["mooncake", "up", "--holders", "1", "--segment", "1MiB"], "--segment must be at least 16MiB"),
    (["mooncake", "up", "--holders", "1", "--segment", "16777215"], "--segment must be at least 16MiB"),
    (["demo", "--threads", "-1"], "--threads"),
    (["demo", "--threads", "x"], "--threads"),
])
def test_s26_bad_input_is_refused_before_anything_starts(argv, says, capsys):
    rc, out = _run(argv, capsys)   # old code: mooncake's holder died (traceback); demo's worker raised
    assert rc == 2 and "Traceback" not in out and says in out, out


def test_mooncake_up_with_a_too_small_segment_is_a_clear_error_with_mooncake_installed(tmp_path):
    import importlib.util

    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("Mooncake not installed")
    r = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "mooncake", "up", "--holders", "1",
                        "--segment", "1MiB", "--workdir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert "Traceback" not in r.stderr, r.stderr[-1500:]
    assert r.returncode == 2, (r.returncode, r.stderr[-500:])


def test_mooncake_up_that_fails_to_start_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    from kvtier.tiers import mooncake_launch

    def holder_died(**_kw):
        raise RuntimeError("mooncake holder 0 exited with 1: E0101 glog line 1\nglog line 2\nglog line 3")

    monkeypatch.setattr(mooncake_launch.MooncakeCluster, "start", staticmethod(holder_died))
    rc, out = _run(["mooncake", "up", "--holders", "1", "--workdir", str(tmp_path)], capsys)
    assert rc == 1 and "Traceback" not in out and "glog line 2" not in out, out
    assert "mooncake holder 0 exited with 1" in out and str(tmp_path) in out, out


def test_ctrl_c_in_any_command_is_exit_130_with_one_line(capsys, monkeypatch):
    from kvtier.cli import simulate

    def interrupted(args):
        raise KeyboardInterrupt

    real_register = simulate.register

    def register(sub):   # the command's func replaced by one that is interrupted
        real_register(sub)
        sub.choices["simulate"].set_defaults(func=interrupted)

    monkeypatch.setattr(simulate, "register", register)
    try:
        rc, out = _run(["simulate"], capsys)
    except KeyboardInterrupt:   # caught here: let out, it would stop the whole test session
        pytest.fail("KeyboardInterrupt came out of main (a traceback at the terminal)")
    assert rc == 130 and out.strip() == "kvtier simulate: interrupted", out
