"""``kvtier demo`` on bad input, a small or unwritable store file system and an unwritable
``--plot`` (audit s26 D3, D4, D5, D13): one clear line and exit 2 before a model is loaded,
or the run goes on without the demo-only measurement; never a traceback that loses the run."""

from __future__ import annotations

import argparse
import errno
import io
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.tmpfs import mounted_tmpfs

ROOT = Path(__file__).resolve().parents[2]
REAL_MODELS = Path.home() / ".cache" / "kvtier" / "models"


def _cache(tmp_path: Path) -> Path:
    xdg = tmp_path / "xdg"
    (xdg / "kvtier").mkdir(parents=True)
    if REAL_MODELS.is_dir():
        (xdg / "kvtier" / "models").symlink_to(REAL_MODELS)
    return xdg


def _demo(argv: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "demo", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# --- D4: bad input is one line and exit 2, before any model is loaded ---

BAD = {
    "threads": (["--quick", "--threads", "-1"], "--threads"),
    "threads_zero": (["--quick", "--threads", "0"], "--threads"),
    "store_dir_file": (["--quick", "--store-dir", "{afile}"], "--store-dir"),
    "store_dir_proc": (["--quick", "--store-dir", "/proc/self"], "--store-dir"),
    "remote_url": (["--quick", "--remote", "bogus://x"], "bogus://x"),
    "remote_no_token": (["--quick", "--remote", "tcp://127.0.0.1:1"], "KVTIER_TOKEN"),
    "plot_in_a_file": (["--quick", "--plot", "{afile}/ttft.png"], "--plot"),
    "synthetic_store_dir_file": (["--synthetic", "--store-dir", "{afile}"], "--store-dir"),
    "synthetic_store_dir_unwritable": (["--synthetic", "--store-dir", "/proc/self"], "--store-dir"),
    "cache_unwritable": (["--quick"], "XDG_CACHE_HOME"),
    # s30 a15 D4: --synthetic ran without these and exited 0 (no server asked, no plot drawn)
    "synthetic_remote": (["--synthetic", "--remote", "tcp://127.0.0.1:1?token=t"], "--remote"),
    "synthetic_plot": (["--synthetic", "--plot", "{tmp}/syn.png"], "--plot"),
    "synthetic_quick": (["--synthetic", "--quick"], "--quick"),
    "synthetic_threads": (["--synthetic", "--threads", "2"], "--threads"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_demo_input_is_one_clear_line_and_exit_2(case, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv, says = BAD[case]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "XDG_CACHE_HOME": str(_cache(tmp_path)), "PYTHONPATH": str(ROOT)}
    env.pop("KVTIER_TOKEN", None)
    if case == "cache_unwritable":
        env["XDG_CACHE_HOME"] = "/proc/self/nope"   # a read-only home, as in a locked-down container
    r = _demo([a.format(afile=afile, tmp=tmp_path) for a in argv], env, timeout=60)
    # old code: a traceback (the worker's inside the parent's), exit 1, after loading the model
    assert "Traceback" not in r.stderr, r.stderr[-1500:]
    assert r.returncode == 2, (r.returncode, r.stderr[-800:])
    assert says in r.stderr, r.stderr
    assert not list((tmp_path / "xdg" / "kvtier").glob("demo-store-*"))
    assert not (tmp_path / "syn.png").exists()


def test_control_synthetic_with_a_good_store_dir_runs(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "XDG_CACHE_HOME": str(_cache(tmp_path)), "PYTHONPATH": str(ROOT)}
    r = _demo(["--synthetic", "--store-dir", str(tmp_path / "new" / "store")], env)
    assert r.returncode == 0, r.stderr[-1500:]
    assert "bytes equal" in r.stdout


def test_a_tier_error_in_the_worker_is_that_error_in_the_parent_not_a_runtime_error(tmp_path):
    pytest.importorskip("torch")
    from kvtier.demo.report import Reporter
    from kvtier.demo.runner import replay
    from kvtier.errors import KvtierError
    from kvtier.integrations.transformers.models import TINY_SPEC
    from tests.demo.test_replay import tiny_scenario

    afile = tmp_path / "afile"
    afile.write_text("x")   # replay() itself does no preflight: the worker finds the bad disk path
    with Reporter(5, quiet_stdout=True) as reporter:
        with pytest.raises(KvtierError) as exc:   # old code: RuntimeError with the worker's traceback
            replay(tiny_scenario(), str(afile), reporter, threads=1, model_spec=asdict(TINY_SPEC),
                   model_root=str(tmp_path / "models"))
    assert "Traceback" not in str(exc.value) and str(afile) in str(exc.value)


# --- D3: the disk limit's probe failing (ENOSPC) is a limit left out, not the run's end ---

def test_a_failing_disk_probe_leaves_the_disk_limit_out(monkeypatch):
    from kvtier.demo import limits
    from kvtier.demo.worker import LimitMeter

    class Layout:
        block_nbytes = 1 << 20

    class Disk:
        path = "/nowhere"

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(limits, "disk_limit_gib_s", full)
    monkeypatch.setattr(limits, "host_copy_gib_s", lambda nbytes: 9.0)
    notes = []
    meter = LimitMeter(Layout(), storage=None, disk=Disk())
    meter.note = notes.append
    assert meter.measure() == {"host_memcpy": 9.0}            # old code: OSError out of measure()
    assert meter.measure({"disk": 1 << 20}) == {}
    assert len(notes) == 1 and "No space left" in notes[0] and "No space left" in meter.disk_error
    monkeypatch.setattr(limits, "disk_limit_gib_s", lambda *a, **k: 1.5)   # control: a probe that works
    assert meter.measure({"disk": 1 << 20}) == {"disk": 1.5}


def test_synthetic_runs_without_the_disk_limit_when_its_probe_fails(monkeypatch, tmp_path, capsys):
    from kvtier.demo import synthetic

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(synthetic, "disk_limit_gib_s", full)
    rc = synthetic.run_synthetic(argparse.Namespace(store_dir=str(tmp_path / "s")))   # old code: OSError
    out = capsys.readouterr().out
    assert rc == 0 and "disk limit not measured" in out and "NO" not in out


@pytest.fixture
def small_fs(tmp_path):
    with mounted_tmpfs(tmp_path / "small", "40m") as mnt:
        yield mnt


def test_a_store_on_a_small_file_system_does_not_kill_the_demo(tmp_path, small_fs):
    """The real replay (tiny model, two engine processes) with the store on a 40 MiB tmpfs: the
    blocks fit, the limit probe's 64 MiB scratch file does not."""
    pytest.importorskip("torch")
    from kvtier.demo.report import Reporter
    from kvtier.demo.runner import replay
    from kvtier.integrations.transformers.models import TINY_SPEC
    from tests.demo.test_replay import tiny_scenario

    with Reporter(5, quiet_stdout=True) as reporter:   # old code: RuntimeError ... OSError: [Errno 28]
        turns, infos = replay(tiny_scenario(), str(small_fs / "store"), reporter, threads=1,
                              model_spec=asdict(TINY_SPEC), model_root=str(tmp_path / "models"))
    assert len(turns) == 5 and all(t["outputs_equal"] for t in turns)
    assert all("disk" not in info["limits_gib_s"] for info in infos)   # left out, not made up
    assert any("disk" in t["tokens_by_tier"] for t in turns)            # control: the disk tier was used


# --- D5: an unwritable --plot ---

def _canned_turns():
    from tests.demo.test_summary import record

    turns = [record(0, cold=2.0, warm=2.0, cached=0), record(1, cold=2.0, warm=0.2),
             record(2, cold=10.0, warm=0.1, kind="resume", ctx=5000, cached=4990)]
    infos = [{"phase": 1, "limits_gib_s": {"host": 9.0}, "store_stats": {}, "pid": 1}]
    return turns, infos


def _args(**kw):
    return argparse.Namespace(**{**dict(quick=True, json=True, plot=None, synthetic=False, store_dir=None, remote=None,
                                        threads=None), **kw})


@pytest.fixture
def canned(tmp_path, monkeypatch):
    """run_demo with the engine runs replaced by canned turn records; the list of replay calls."""
    from kvtier.demo import runner

    monkeypatch.setenv("XDG_CACHE_HOME", str(_cache(tmp_path)))
    called = []

    def fake_replay(*a, **k):
        called.append(1)
        return _canned_turns()

    monkeypatch.setattr(runner, "replay", fake_replay)
    return called


def test_a_plot_path_in_a_missing_directory_is_refused_before_the_runs(tmp_path, canned, capsys):
    from kvtier.demo import runner

    afile = tmp_path / "afile"
    afile.write_text("x")
    rc = runner.run_demo(_args(plot=str(afile / "ttft.png")))   # old code: NotADirectoryError after the runs
    assert rc == 2 and not canned and "--plot" in capsys.readouterr().err


def test_a_plot_that_fails_to_save_after_the_runs_keeps_the_results(tmp_path, canned, capsys, monkeypatch):
    from kvtier.demo import runner

    def disk_full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runner, "plot", disk_full)
    rc = runner.run_demo(_args(plot=str(tmp_path / "ttft.png")))
    out, err = capsys.readouterr()
    assert canned and rc == 1
    assert '"turns": 3' in out and '"plot_error"' in out and "No space left" in err


def test_control_a_writable_plot_path_is_drawn(tmp_path, canned, capsys):
    pytest.importorskip("matplotlib")
    from kvtier.demo import runner

    rc = runner.run_demo(_args(plot=str(tmp_path / "ttft.png")))
    assert rc == 0 and (tmp_path / "ttft.png").stat().st_size > 0 and '"plot":' in capsys.readouterr().out


# --- D13: the printed resume line ---

def test_the_resume_line_calls_the_context_a_context_not_cached_tokens():
    from rich.console import Console

    from kvtier.demo.report import print_summary
    from kvtier.demo.summary import summarize
    from tests.demo.test_summary import record

    turns = [record(0, cold=2.0, warm=2.0, cached=0),
             record(1, cold=10.0, warm=0.1, kind="resume", ctx=4556, cached=4544)]
    summary = summarize(turns, [{"phase": 1, "limits_gib_s": {"host": 9.0}}], runtime_s=1.0, scenario="t")
    buf = io.StringIO()
    print_summary(Console(file=buf, width=300), summary)
    line = next(l for l in buf.getvalue().splitlines() if l.startswith("resume"))  # noqa: E741
    assert "4556 cached" not in line, line   # 4544 of the 4556 context tokens were cached, 12 new
    assert "4556-token context, 12 new" in line, line


# --- s30 a15 D3: a --remote server that does not answer is refused before the runs ---

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real kvtier server and its tenant's token."""
    from kvtier.server.launch import ServerProcess

    token = "demo-token-" + "5" * 20
    with ServerProcess.start({"demo": token}, workdir=str(tmp_path_factory.mktemp("srv"))) as srv:
        yield srv, token


def _refused_remote(url: str, canned, capsys) -> str:
    from kvtier.demo import runner

    started = time.monotonic()
    rc = runner.run_demo(_args(remote=url))   # old code: the canned runs, exit 0, nothing said
    err = capsys.readouterr().err
    assert rc == 2 and not canned, (rc, err)
    assert "cannot reach the kvtier server" in err and "token=" not in err, err
    assert time.monotonic() - started < 15   # a short timeout, not the store's 30 s per call
    return err


def test_a_remote_url_where_nothing_listens_is_refused(canned, capsys, monkeypatch):
    monkeypatch.setenv("KVTIER_TOKEN", "some-token")
    with socket.socket() as s:   # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        err = _refused_remote(f"tcp://127.0.0.1:{port}", canned, capsys)
    assert f"127.0.0.1:{port}" in err and "refused" in err


def test_a_remote_url_whose_listener_never_answers_is_refused(canned, capsys, monkeypatch):
    monkeypatch.setenv("KVTIER_TOKEN", "some-token")
    with socket.socket() as s:   # connections queue in the backlog, no HELLO reply ever comes
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        _refused_remote(f"tcp://127.0.0.1:{s.getsockname()[1]}", canned, capsys)


def test_a_remote_server_that_refuses_the_token_is_refused(server, canned, capsys):
    srv, _ = server
    err = _refused_remote(srv.tcp_url + "?token=not-the-tenants-token", canned, capsys)
    assert "AUTH" in err, err


def test_control_a_remote_server_that_answers_passes_the_preflight(server, canned, capsys, monkeypatch):
    from kvtier.demo import runner

    srv, token = server
    monkeypatch.setenv("KVTIER_TOKEN", token)
    assert runner.run_demo(_args(remote=srv.tcp_url)) == 0 and canned
