"""Flags that ended in a traceback, ran on, or were taken silently (audit s33 a8 D1, D4, D6-D11): each
is now refused before any work, in one line on stderr, with exit status 2.

Where the old code ran on (a bound never checked, a flag taken as "not given"), the command runs
in a child process with a timeout, so that a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import kvtier
from kvtier.cli.main import build_parser, main
from kvtier.errors import ConfigError
from tests.tmpfs import mounted_tmpfs

#: the directory that holds this kvtier package, for the children's imports
SOURCE_ROOT = str(Path(kvtier.__file__).resolve().parent.parent)


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """``kvtier ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        rc = main(argv)
    except SystemExit as exc:   # argparse's own refusals
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _run_child(argv: list[str], timeout_s: float = 30.0) -> tuple[int, str]:
    """``kvtier ARGV`` in a child process: (exit status, stderr); a child still running after
    ``timeout_s`` fails the test (what the old code did with these flags)."""
    env = dict(os.environ, PYTHONPATH=SOURCE_ROOT, PYTHONWARNINGS="ignore")
    try:
        done = subprocess.run([sys.executable, "-m", "kvtier.cli.main", *argv], capture_output=True, text=True,
                              timeout=timeout_s, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvtier {' '.join(argv)} was not refused: still running after {timeout_s:g} s")
    return done.returncode, done.stderr


def _one_line(err: str) -> str:
    """The refusal: exactly one line, no traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def closed_port() -> int:
    """A local port nothing listens on."""
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# --- D1: a server URL with an unclosed IPv6 bracket ---

@pytest.mark.parametrize("url", ["tcp://[::1", "tcp://[::1:7070", "tls://[fd00::1:7070", "tcp://h\uff03st:7070"])
def test_a_url_that_does_not_split_is_a_config_error(url):
    from kvtier.tiers.remote_wire import parse_url

    with pytest.raises(ConfigError, match="is not a URL"):   # was a bare ValueError("Invalid IPv6 URL")
        parse_url(url)


def test_the_refusal_of_a_url_that_does_not_split_masks_its_token():
    from kvtier.tiers.remote_wire import parse_url

    with pytest.raises(ConfigError) as refused:
        parse_url("tcp://user:pw@[::1:7070?token=s3cret&namespace=ns")
    message = str(refused.value)
    assert "s3cret" not in message and "pw" not in message and "token=***" in message, message


def test_the_store_config_names_remote_url_for_a_url_that_does_not_split():
    from kvtier.store.config import StoreConfig

    with pytest.raises(ConfigError, match="^remote_url "):
        StoreConfig(remote_url="tcp://[::1:7070")


@pytest.mark.parametrize("url", ["tcp://[::1", "garbage"])
def test_admin_refuses_a_bad_url_in_one_line_with_exit_2(url, capsys, monkeypatch):
    monkeypatch.setenv("KVTIER_ADMIN_TOKEN", "x")
    rc, _, err = _run(["admin", "--url", url, "usage"], capsys)
    assert rc == 2 and url in _one_line(err)   # was a traceback (exit 1), and exit 1 for "garbage"


# --- D4: bench prefill's model, output and device flags, before the measurement ---

TINY = ["--tokens", "8,16,32", "--layers", "1", "--hidden", "64", "--heads", "2", "--kv-heads", "1",
        "--intermediate", "64", "--vocab", "100", "--repeat", "1"]


@pytest.mark.parametrize(("flags", "said"), [
    (["--heads", "0"], "--heads 0"),
    (["--vocab", "0"], "--vocab 0"),
    (["--layers", "-1"], "--layers -1"),
    (["--hidden", "63"], "multiple of --heads"),
    (["--kv-heads", "3"], "multiple of --kv-heads"),
    (["--device", "bogus"], "--device 'bogus'"),
    (["--output", "/nonexistent/dir/x.json"], "does not exist"),
], ids=["heads_0", "vocab_0", "layers_negative", "hidden_not_multiple", "kv_heads_not_divisor", "device", "output"])
def test_bench_prefill_refuses_a_bad_flag_before_measuring(flags, said, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # the default --output goes here
    rc, out, err = _run(["bench", "prefill", *TINY, *flags], capsys)
    assert rc == 2 and said in _one_line(err), err
    assert out == "" and not list(tmp_path.iterdir()), "nothing measured, no profile written"


def test_control_bench_prefill_with_good_flags_writes_its_profile(capsys, tmp_path):
    profile = tmp_path / "p.json"
    rc, _, err = _run(["bench", "prefill", *TINY, "--output", str(profile)], capsys)
    assert rc == 0 and profile.exists(), err


# --- D6: the seconds top and plan live sleep or wait, bounded by a day ---

def test_top_refuses_an_interval_past_a_day(capsys, closed_port):
    rc, _, err = _run(["top", "--router", f"127.0.0.1:{closed_port}", "--interval", "1e300"], capsys)
    assert rc == 2 and "--interval" in _one_line(err)   # was an OverflowError in time.sleep after a frame


LIVE = ["plan", "live", "--ttft", "2", "--itl", "0.05"]


@pytest.mark.parametrize("flag", ["--interval", "--startup", "--health-timeout", "--drain-timeout"])
@pytest.mark.parametrize("seconds", ["1e300", "-1"])
def test_plan_live_refuses_a_wait_out_of_range(flag, seconds, closed_port):
    rc, err = _run_child([*LIVE, "--router", f"127.0.0.1:{closed_port}", flag, seconds])
    assert rc == 2 and flag in _one_line(err), err


# --- D7: --ttft-percentile is in percent, and its refusal says so ---

WORKLOAD = ["--rate", "1", "--input-tokens", "1024", "--output-tokens", "50", "--hit-rate", "0.5"]


def test_plan_workers_refuses_a_percentile_out_of_range_in_its_own_unit(capsys):
    rc, _, err = _run(["plan", "workers", "--ttft", "2", "--itl", "0.05", *WORKLOAD, "--ttft-percentile", "150"],
                      capsys)
    assert rc == 2 and "90 for p90" in err and "0.9 for p90" not in err, err   # was the fraction's advice


def test_plan_workers_warns_of_a_percentile_below_1(capsys):
    rc, out, err = _run(["plan", "workers", "--ttft", "2", "--itl", "0.05", *WORKLOAD, "--ttft-percentile", "0.9"],
                        capsys)
    assert rc == 0 and "p0.9" in out
    assert "warning" in err and "90 for p90" in err, err


def test_simulate_planner_refuses_a_percentile_out_of_range_in_its_own_unit(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"timestamp": {i * 500}, "input_length": 1024, "output_length": 50, '
                             f'"hash_ids": [1, {i + 2}]}}\n' for i in range(20)))
    rc, _, err = _run(["simulate", "--planner", "--trace", str(trace), "--ttft-percentile", "150"], capsys)
    assert rc == 2 and "90 for p90" in err and "0.9 for p90" not in err, err


# --- D8: an unbalanced quote in --worker-args ---

def test_plan_live_refuses_an_unbalanced_quote_in_worker_args(capsys, tmp_path, closed_port):
    rc, _, err = _run([*LIVE, "--router", f"127.0.0.1:{closed_port}", "--launcher", "local",
                       "--adopt", f"http://127.0.0.1:{closed_port}", "--model", "m", "--run-dir", str(tmp_path),
                       "--worker-args", '--foo "bar'], capsys)
    assert rc == 2 and "--worker-args" in _one_line(err) and "closing quotation" in err, err   # was a ValueError


# --- D9: --max-workers 0 is a bound, not "not given" ---

@pytest.mark.parametrize("launcher", ["dry-run", "local"])
def test_max_workers_0_is_the_bound_given(launcher):
    from kvtier.cli.plan import live_max_workers

    args = build_parser().parse_args([*LIVE, "--router", "x:1", "--max-workers", "0", "--launcher", launcher,
                                      "--adopt", "http://w:1"])
    assert live_max_workers(args) == 0   # was 100,000 and 8


def test_plan_live_refuses_max_workers_0(closed_port):
    rc, err = _run_child([*LIVE, "--router", f"127.0.0.1:{closed_port}", "--max-workers", "0"])
    assert rc == 2 and "max_workers" in _one_line(err), err


# --- D10: admin --timeout-s <= 0 ---

@pytest.mark.parametrize("seconds", ["0", "-1"])
def test_admin_refuses_a_timeout_that_is_no_wait(seconds, capsys, monkeypatch, closed_port):
    monkeypatch.setenv("KVTIER_ADMIN_TOKEN", "x")
    rc, _, err = _run(["admin", "--url", f"tcp://127.0.0.1:{closed_port}", "--timeout-s", seconds, "usage"], capsys)
    assert rc == 2 and "--timeout-s" in _one_line(err)   # was "did not answer in time", exit 1


def test_control_admin_with_a_timeout_reports_the_refused_connection(capsys, monkeypatch, closed_port):
    monkeypatch.setenv("KVTIER_ADMIN_TOKEN", "x")
    rc, _, err = _run(["admin", "--url", f"tcp://127.0.0.1:{closed_port}", "--timeout-s", "5", "usage"], capsys)
    assert rc == 1 and "refused" in _one_line(err)


# --- D11: bench sizes beyond the host's memory or the disk's free space ---

@pytest.mark.parametrize("argv", [
    ["bench", "lookup", "--tokens", str(10**12), "--block-tokens", "16", "--runs", "1"],
    ["bench", "storage", "--tier", "host", "--block-mib", "1e9", "--blocks", "4", "--runs", "1"],
    ["bench", "restart", "--blocks", "1", "--block-kib", str(10**12), "--no-server"],
], ids=["lookup", "storage_host", "restart"])
def test_a_bench_size_beyond_the_hosts_memory_is_refused_before_allocating(argv, capsys):
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and "needs at least" in _one_line(err) and "this host has" in err, err   # was a MemoryError


@pytest.mark.parametrize("argv", [
    ["bench", "storage", "--tier", "disk", "--block-mib", "1", "--blocks", "16", "--runs", "1"],
    ["bench", "restart", "--blocks", "64", "--block-kib", "256", "--no-server"],
], ids=["storage_disk", "restart"])
def test_a_bench_size_beyond_the_disks_free_space_is_refused_before_writing(argv, capsys, tmp_path):
    with mounted_tmpfs(tmp_path / "small", "8m") as small:   # 32 and 16 MiB of files asked for
        rc, _, err = _run([*argv, "--dir", str(small)], capsys)
        left = list(small.iterdir())
    assert rc == 2 and "GiB free" in _one_line(err), err   # was ENOSPC halfway through the run
    assert left == []


def test_bench_prefill_output_may_be_an_existing_writable_file_in_a_directory_it_cannot_write(tmp_path, monkeypatch):
    """/dev/null for a user who cannot write /dev (audit s33 r3 D1): the file is written, the
    directory is not; a directory the user cannot write still refuses a file to be created."""
    from kvtier.bench import prefill

    existing = tmp_path / "profile.json"
    existing.write_text("{}")
    real_access = os.access
    monkeypatch.setattr(prefill.os, "access",
                        lambda p, mode: False if Path(p) == tmp_path else real_access(p, mode))
    assert prefill._output_problem(existing) is None
    assert "not writable" in prefill._output_problem(tmp_path / "new.json")
