"""The local launcher after a worker's life: a crash while serving, and the stop of a worker whose
connector still flushes its store (audit s34 a5 D1, D4).

D1: a worker that served and then died was charged as a failed *start*, so its replacement was
refused for ``failure_backoff_s`` (60 s) while the fleet ran one short. D4: a stopping worker was
SIGKILLed after a fixed 60 s, whatever ``--shutdown-timeout`` its vLLM ran with (a kvtier
connector's flush gets up to an hour). Real parts: a real Router on a real socket, stand-in worker
processes, the CLI's parser and the launcher ``plan live`` builds."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import sys
import textwrap
import time

import pytest

from kvtier.cli import plan as plan_cli
from kvtier.errors import ConfigError
from kvtier.planner.launchers import apply
from kvtier.planner.local_launcher import LaunchError, LocalLauncher, RouterAdmin, WorkerTemplate
from tests.planner.test_local_launcher import STANDIN, RouterThread
from tests.planner.test_planner_absurd_figures import _live_args
from tests.planner.test_planner_hostile import _decision, _kill_group
from tests.polling import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def router():
    r = RouterThread()
    yield r
    r.close()


def _kill_all(launcher: LocalLauncher) -> None:
    for record in list(launcher._procs.values()):
        if record.proc is not None:
            _kill_group(record.proc.pid)


# --- D1: a crash while serving is no failed start ------------------------------------------------

def _serving_worker(router, tmp_path, early_crash_s: float):
    """A launcher at its default failure backoff (60 s), and a worker of it that serves."""
    launcher = LocalLauncher(WorkerTemplate("tiny", program=STANDIN, kv_events=False),
                             RouterAdmin(router.url, timeout_s=1), tmp_path, poll_s=0.1, stop_timeout_s=5)
    launcher.early_crash_s = early_crash_s
    launcher.adopt(router.first.url)
    worker = launcher.start("prefill")
    assert wait_until(lambda: worker.state == "serving", 30)
    return launcher, worker


def _crash(launcher: LocalLauncher, worker) -> None:
    os.killpg(launcher._procs[worker.name].proc.pid, signal.SIGKILL)   # an OOM
    # its "failed" action is recorded once the launcher is done with it (the router told, the
    # backoff charged or not): its state says failed before that
    assert wait_until(lambda: ("failed", worker.name) in [(a, n) for _, a, n in launcher.actions], 10)
    assert worker.state == "failed"


def test_a_worker_that_crashes_after_serving_a_while_is_replaced_at_once(router, tmp_path):
    launcher, worker = _serving_worker(router, tmp_path, early_crash_s=0.5)
    try:
        time.sleep(1.0)                                    # it served past early_crash_s
        _crash(launcher, worker)
        assert worker not in launcher.list("prefill")
        # the planner's next interval sees the pool one short: the replacement starts now, not in 60 s
        started = apply(_decision((2, 2, 2, "hold"), (0, 0, 0, "hold")), launcher)
        assert len(started) == 1 and started[0] is not worker
        assert wait_until(lambda: started[0].state == "serving", 30)
    finally:
        launcher.close(timeout_s=10)
        _kill_all(launcher)


def test_control_a_worker_that_dies_on_joining_the_router_counts_as_a_failed_start(router, tmp_path):
    launcher, worker = _serving_worker(router, tmp_path, early_crash_s=30)
    try:
        _crash(launcher, worker)                           # on its first requests: a start that failed
        with pytest.raises(LaunchError, match="next try in"):
            apply(_decision((2, 2, 2, "hold"), (0, 0, 0, "hold")), launcher)
    finally:
        launcher.close(timeout_s=10)
        _kill_all(launcher)


# --- D4: the stop timeout follows the worker's shutdown timeout, and --stop-timeout --------------

#: a worker whose SIGTERM starts a flush of FLUSH_S seconds (a kvtier connector writing its DRAM
#: store out as vLLM shuts down), after which it writes MARKER and exits 0
FLUSHING_WORKER = textwrap.dedent("""
    import os, signal, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
        def log_message(self, *args):
            pass

    def flush():
        time.sleep(float(os.environ["FLUSH_S"]))
        open(os.environ["MARKER"], "w").write("flushed")
        os._exit(0)

    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=flush).start())
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
""")


def _plan_live_launcher(router, run_dir, *flags: str) -> LocalLauncher:
    """The launcher ``kvtier plan live --launcher local`` builds from ``flags`` (its SIGTERM handler
    put back afterwards)."""
    args = _live_args("--launcher", "local", "--model", "tiny", "--adopt", router.first.url, "--router", router.url,
                      "--no-kv-events", "--run-dir", str(run_dir), *flags)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        launcher, _, _ = plan_cli._live_launcher(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return launcher


def _stop_a_flushing_worker(launcher: LocalLauncher, tmp_path, flush_s: float) -> tuple[int, bool, float]:
    """Start a worker whose shutdown flushes for ``flush_s``, drain it (a scale-down): its exit
    status, whether it flushed, and how long after the drain it ended."""
    script, marker = tmp_path / "flushing_worker.py", tmp_path / "flushed"
    script.write_text(FLUSHING_WORKER)
    launcher.template = dataclasses.replace(launcher.template, program=(sys.executable, str(script)),
                                            env=(("FLUSH_S", str(flush_s)), ("MARKER", str(marker))))
    launcher.poll_s = 0.1
    worker = launcher.start("prefill")
    proc = launcher._procs[worker.name].proc
    try:
        assert wait_until(lambda: worker.state == "serving", 30)
        began = time.monotonic()
        launcher.drain(worker)
        assert wait_until(lambda: worker.state == "stopped", 30)
        return proc.returncode, marker.exists(), time.monotonic() - began
    finally:
        launcher.close(timeout_s=10)
        _kill_group(proc.pid)


def test_plan_live_stop_timeout_lets_a_flushing_worker_finish_and_bounds_one_that_does_not(router, tmp_path):
    long_enough = _plan_live_launcher(router, tmp_path / "a", "--stop-timeout", "8")
    assert long_enough.stop_timeout() == 8
    rc, flushed, _ = _stop_a_flushing_worker(long_enough, tmp_path / "a", flush_s=1.5)
    assert (rc, flushed) == (0, True)                      # SIGTERM, the flush done, a clean exit
    too_short = _plan_live_launcher(router, tmp_path / "b", "--stop-timeout", "0.5")
    rc, flushed, took = _stop_a_flushing_worker(too_short, tmp_path / "b", flush_s=20)
    assert (rc, flushed) == (-signal.SIGKILL, False) and took < 10   # the flag, not a fixed 60 s


def test_plan_live_refuses_a_stop_timeout_out_of_range():
    for bad in ("0", "-1", "1e300"):
        with pytest.raises(ConfigError, match="--stop-timeout"):
            plan_cli._refuse_waits_out_of_range(_live_args("--stop-timeout", bad))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="reads the arguments with vLLM's own parser")
def test_plan_live_gives_a_stopping_worker_the_shutdown_timeout_its_vllm_runs_with(router, tmp_path):
    flush_90 = json.dumps({"kv_connector": "KvtierConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"shutdown_flush_s": 90}})
    # kvtier's vLLM launcher gives this serve --shutdown-timeout 94 (the flush + 4): SIGKILL no sooner
    by_the_connector = _plan_live_launcher(router, tmp_path / "a", f"--worker-args=--kv-transfer-config '{flush_90}'")
    assert by_the_connector.stop_timeout() >= 94 + 10
    given = _plan_live_launcher(router, tmp_path / "b", "--worker-args=--shutdown-timeout=3600")
    assert given.stop_timeout() >= 3600 + 10
    plain = _plan_live_launcher(router, tmp_path / "c")    # control: vLLM's default (0) keeps the 60 s
    assert plain.stop_timeout() == 60
    chosen = _plan_live_launcher(router, tmp_path / "d", "--worker-args=--shutdown-timeout 3600",
                                 "--stop-timeout", "5")
    assert chosen.stop_timeout() == 5                      # the flag wins
    refused = json.loads(flush_90)
    refused["kv_connector_extra_config"]["shutdown_flush_s"] = -5   # the connector refuses it: no worker starts
    unstartable = _plan_live_launcher(router, tmp_path / "e",
                                      f"--worker-args=--kv-transfer-config '{json.dumps(refused)}'")
    assert unstartable.stop_timeout() == 60                # a timeout all the same, never the drain thread's end
    for launcher in (by_the_connector, given, plain, chosen, unstartable):
        launcher.close(timeout_s=1)
