"""``kvtier demo`` stopped by a signal leaves nothing behind and says so in one line (audit s26
D1, D2, D6), and what a run killed too hard to clean up left is swept by the next one.

The three real-demo tests start ``kvtier demo --quick`` and signal it within seconds (the
first run's model build in D2's); each costs about 10-20 s of both cores."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.integrations.transformers.models import TINY_SPEC

ROOT = Path(__file__).resolve().parents[2]
REAL_MODELS = Path.home() / ".cache" / "kvtier" / "models"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --- the sweeps (cheap) ---

def test_a_dead_runs_store_directory_is_swept_and_a_live_ones_is_kept(tmp_path):
    from kvtier.demo.preflight import make_store_dir, sweep_stale

    from kvtier.child_process import host_tag

    dead_pid = _dead_pid()
    dead = tmp_path / f"demo-store-{dead_pid}-h{host_tag()}-abc_12"
    dead_untagged = tmp_path / f"demo-store-{dead_pid}-ghi_56"     # a name from before the host tag
    elsewhere = tmp_path / f"demo-store-{dead_pid}-h00000000-jkl_78"   # another host's: its pid means nothing here
    live = tmp_path / f"demo-store-{os.getpid()}-h{host_tag()}-def_34"
    old_style = tmp_path / "demo-store-x1y2z3"            # an older kvtier's: no pid, owner unknown
    other = tmp_path / "models"
    for d in (dead, dead_untagged, elsewhere, live, old_style, other):
        (d / "sub").mkdir(parents=True)
    fresh = Path(make_store_dir(tmp_path))
    assert not dead.exists() and not dead_untagged.exists()
    assert elsewhere.exists() or host_tag() == "00000000"
    assert live.exists() and old_style.exists() and other.exists()   # controls
    assert fresh.name.startswith(f"demo-store-{os.getpid()}-h{host_tag()}-")
    assert fresh.name.startswith(f"demo-store-{os.getpid()}-") and fresh.is_dir()
    assert sweep_stale(tmp_path, "demo-store-") == []


def test_a_dead_builders_half_built_model_is_swept_and_a_live_ones_is_kept(tmp_path):
    from kvtier.integrations.transformers.models import remove_dead_builds

    name = TINY_SPEC.name
    dead = tmp_path / f".{name}-{_dead_pid()}-abc_12"
    live = tmp_path / f".{name}-{os.getpid()}-def_34"
    other_spec = tmp_path / f".llama-h1-l1-float32-000000000000-{_dead_pid()}-ghi_56"
    published = tmp_path / name
    for d in (dead, live, other_spec, published):
        (d / "model.safetensors").parent.mkdir(parents=True, exist_ok=True)
        (d / "model.safetensors").write_bytes(b"x" * 1000)
    assert remove_dead_builds(tmp_path, TINY_SPEC) == [dead]
    assert live.exists() and other_spec.exists() and published.exists()   # controls
    assert remove_dead_builds(tmp_path) == [other_spec]                    # any spec's
    assert live.exists() and published.exists()


def test_sigterm_within_exit_on_termination_unwinds_and_the_handler_is_put_back():
    from kvtier.demo.preflight import exit_on_termination

    before = signal.getsignal(signal.SIGTERM)
    ran = []
    with pytest.raises(SystemExit) as exc:
        with exit_on_termination():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            finally:
                ran.append(1)
    assert exc.value.code == 128 + signal.SIGTERM and ran == [1]
    assert signal.getsignal(signal.SIGTERM) is before


# --- the real demo, signalled ---

def _cache(tmp_path: Path, *, with_models: bool = True) -> Path:
    """An XDG_CACHE_HOME of the test's own; the demo model linked in so it is not rebuilt."""
    xdg = tmp_path / "xdg"
    (xdg / "kvtier").mkdir(parents=True)
    if with_models and REAL_MODELS.is_dir():
        (xdg / "kvtier" / "models").symlink_to(REAL_MODELS)
    return xdg


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _start_demo(xdg: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "XDG_CACHE_HOME": str(xdg), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "kvtier.cli.main", "demo", "--quick"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("timed out waiting for the demo to get there")


def _finish(proc: subprocess.Popen, workers: list[int]) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _wait_for(lambda: not any(_alive(w) for w in workers), 15)
    return proc.returncode, err


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the real demo needs torch")


@needs_torch
def test_sigterm_during_the_demo_leaves_no_store_directory_and_no_worker(tmp_path):
    xdg = _cache(tmp_path)
    proc = _start_demo(xdg)
    stores = lambda: sorted((xdg / "kvtier").glob("demo-store-*"))  # noqa: E731
    _wait_for(lambda: stores() and _children(proc.pid), 60)
    workers = _children(proc.pid)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    rc, err = _finish(proc, workers)
    # old code: rc -15 and the demo-store-* directory left in the cache for good
    assert rc == 128 + signal.SIGTERM, (rc, err[-2000:])
    assert not stores(), f"SIGTERM left {stores()}"
    assert not any(_alive(w) for w in workers)
    assert time.monotonic() - started < 15


@needs_torch
def test_ctrl_c_is_a_clean_exit_130_without_a_traceback(tmp_path):
    xdg = _cache(tmp_path)
    proc = _start_demo(xdg)
    _wait_for(lambda: _children(proc.pid), 60)
    workers = _children(proc.pid)
    time.sleep(2.0)
    os.killpg(proc.pid, signal.SIGINT)            # what a terminal's Ctrl-C does: the whole foreground group
    rc, err = _finish(proc, workers)
    assert not list((xdg / "kvtier").glob("demo-store-*"))   # control: SIGINT cleaned up on the old code too
    assert rc == 130, (rc, err[-2000:])                      # old code: 1, with a KeyboardInterrupt traceback
    assert "Traceback" not in err and "kvtier demo: interrupted" in err, err[-2000:]


@needs_torch
def test_sigterm_during_the_first_runs_model_build_leaves_no_half_built_model(tmp_path):
    xdg = _cache(tmp_path, with_models=False)      # a first run: the demo model is built now
    models = xdg / "kvtier" / "models"
    proc = _start_demo(xdg)
    building = lambda: [d for d in models.glob(".llama-*") if any(d.iterdir())] if models.is_dir() else []  # noqa: E731
    _wait_for(lambda: building() and _children(proc.pid), 90)
    assert all(f"-{_children(proc.pid)[0]}-" in d.name for d in building())   # the builder's pid in the name
    workers = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _finish(proc, workers)
    left = [d for d in models.glob(".*") if d.is_dir()]
    assert not left, f"a half-built model stays in the cache for good: {left}"   # old code: ~276 MiB left
