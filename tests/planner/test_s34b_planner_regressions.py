"""Regressions of the planner fixes of s34 a5 (audit s34 r3 D1-D4).

D1: with workers that prefill and decode alike (``plan live --launcher local``), both pools were
reconciled to the running count before every decision, each kept its own hysteresis, and the
fleet came down only when both pools' scale-downs fell in the same interval: offset by one
interval, they never did, and the fleet never shrank. D2: the first stop worked out the stop
timeout by reading the worker arguments with vLLM's parser, which swaps the process-wide
``sys.stdout``: on a drain thread it swallowed the planner's decision lines, and two stops at once
left ``sys.stdout`` swapped for good. D3: the router's counters were stamped when the slowest
worker's scrape was done, not when the router answered: one slow worker bent the measured rate.
D4: the round count of failed starts was reset when a worker joined the router, so a worker that
crashed on joining (a failed start in effect) was retried at the first backoff forever.

Real parts: the planner's loop, planner and cost models, the dry-run and local launchers, real
HTTP endpoints, a real Router, stand-in worker processes, and for D2 a stand-in ``vllm`` package
whose ``serve`` parser takes a second to import (as vLLM's own takes seconds)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import kvtier
from kvtier.cli.top import scrape
from kvtier.planner.hardware import cost_models
from kvtier.planner.launchers import DryRunLauncher, apply
from kvtier.planner.live import FleetSizer, LivePlanner, Observation, PlannerSettings
from kvtier.planner.local_launcher import LaunchError, LocalLauncher, RouterAdmin, WorkerTemplate
from kvtier.planner.loop import PlannerLoop
from kvtier.planner.models import load_model
from kvtier.planner.workers import SLATargets
from tests.planner.test_local_launcher import STANDIN, RouterThread
from tests.planner.test_planner_hostile import VLLM_TEXT, _decision, _kill_group
from tests.polling import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def sizer():
    costs = cost_models(load_model("llama-3-70b"), "h100", 8)
    return FleetSizer(SLATargets(ttft_s=2.0, itl_s=0.05), costs.prefill, costs.decode, 22.5e9, 1_200_000)


# --- D1: an aggregated fleet shrinks once the load falls -----------------------------------------

INTERVAL_S = 15.0   # plan live's defaults: interval 15 s, scale down after 2 intervals, cooldown 60 s


def _running(launcher: DryRunLauncher) -> int:
    return sum(w.state in ("starting", "serving") for w in launcher.list("prefill"))


def _aggregated_fleet_after(sizer, high_intervals: int, low_intervals: int) -> tuple[int, list]:
    """Workers running after ``high_intervals`` of a load that needs about 10 and then
    ``low_intervals`` of one that one worker holds, decided by the loop's own step (reconcile,
    decide) and acted on by the dry-run launcher; and the decisions at the low load."""
    launcher = DryRunLauncher(out=io.StringIO())
    launcher.seed("prefill", 1)
    loop = PlannerLoop(LivePlanner(sizer, PlannerSettings(interval_s=INTERVAL_S, startup_s=60), 1, 1), launcher,
                       "http://unused", 256, scrape, aggregate=True)
    phases = ((high_intervals, 40.0, 4000, 2000), (low_intervals, 5.0, 500, 200))
    at, decisions = 0.0, []
    for intervals, rate, prompt, output in phases:
        decisions = []
        for _ in range(intervals):
            at += INTERVAL_S
            decision = loop._decide(Observation(at, rate, (prompt,) * 8, (output,) * 8, 0.0))
            apply(decision, launcher)
            decisions.append(decision)
    return _running(launcher), decisions


@pytest.mark.parametrize("high_intervals", [20, 21, 22, 23])   # every phase of the two needs' fall
def test_an_aggregated_fleet_shrinks_to_what_the_low_load_needs(sizer, high_intervals):
    low = sizer.size(5.0 * 1.1 * 1.1, [500] * 8, [200] * 8, 0.0, 1.0)
    assert max(low.prefill_workers, low.decode_workers) == 1          # the premise: one worker holds it
    running, decisions = _aggregated_fleet_after(sizer, high_intervals, low_intervals=60)
    assert running == 1, [(d.prefill.action, d.prefill.current, d.prefill.target) for d in decisions[-8:]]
    assert any(d.prefill.action == "scale_down" for d in decisions)   # was a hold of 11 for 20 minutes
    # one pool: the decode pool runs none of its own, and the count is what runs
    assert all((d.decode.current, d.decode.target) == (0, 0) for d in decisions)
    assert decisions[-1].prefill.current == 1


def test_an_aggregated_decision_holds_the_larger_need(sizer):
    """The one pool is sized for both: a load whose decode needs more workers than its prefill
    scales the fleet up to the decode need, and the reason says both."""
    launcher = DryRunLauncher(out=io.StringIO())
    launcher.seed("prefill", 1)
    loop = PlannerLoop(LivePlanner(sizer, PlannerSettings(interval_s=INTERVAL_S, startup_s=60), 1, 1), launcher,
                       "http://unused", 256, scrape, aggregate=True)
    need = sizer.size(40.0 * 1.1, [4000] * 8, [2000] * 8, 0.0, 1.0)
    assert need.decode_workers > need.prefill_workers                 # the premise
    up = loop._decide(Observation(INTERVAL_S, 40.0, (4000,) * 8, (2000,) * 8, 0.0))
    assert (up.prefill.action, up.prefill.target) == ("scale_up", need.decode_workers)
    assert f"prefill needs {need.prefill_workers}, decode {need.decode_workers}" in up.prefill.reason


# --- D2: working out the stop timeout never swaps the planner's stdout ---------------------------

#: the decision lines a planner prints while two of its workers stop (a scale-down by two)
STOPS_WHILE_PRINTING = textwrap.dedent("""
    import io, sys, tempfile, threading, time

    class Out(io.TextIOBase):        # plan live's stdout (the --json decision lines a tool reads)
        def __init__(self):
            self.lines = []
        def write(self, text):
            self.lines += [line for line in text.splitlines() if line]
            return len(text)
        def writable(self):
            return True

    out = Out()
    real, sys.stdout = sys.stdout, out
    from kvtier.planner.local_launcher import LocalLauncher, RouterAdmin, WorkerTemplate

    # what plan live builds for --worker-args "--dtype float32", without --stop-timeout
    launcher = LocalLauncher(WorkerTemplate("tiny", ("--dtype", "float32"), kv_events=False),
                             RouterAdmin("http://127.0.0.1:9"), tempfile.mkdtemp())
    stops = [threading.Thread(target=launcher.stop_timeout) for _ in range(2)]
    stops[0].start()
    time.sleep(0.2)
    stops[1].start()
    for i in range(20):              # the loop keeps deciding meanwhile
        print('{"at_s": %d, "action": "hold"}' % i, flush=True)
        time.sleep(0.05)
    for t in stops:
        t.join()
    print('{"after": "the stops"}', flush=True)
    print(len(out.lines), sys.stdout is out, launcher.stop_timeout(), file=real)
""")


def _slow_vllm_standin(root: Path) -> Path:
    """A ``vllm`` package (with its distribution metadata) whose ``serve`` subcommand takes a
    second to import and then is not there: vLLM's parser of ``serve`` is slow to load, and
    kvtier's launcher then reads no arguments (vLLM's default shutdown timeout)."""
    serve = root / "vllm" / "entrypoints" / "cli"
    serve.mkdir(parents=True)
    for package in (root / "vllm", root / "vllm" / "entrypoints", serve):
        (package / "__init__.py").write_text("")
    (serve / "serve.py").write_text("import time\ntime.sleep(1.0)\nraise ImportError('stand-in: no serve here')\n")
    (root / "vllm-0.0.0.dist-info").mkdir()
    (root / "vllm-0.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.0.0\n")
    return root


def test_stopping_workers_never_swallow_or_keep_the_planners_stdout(tmp_path):
    standin = _slow_vllm_standin(tmp_path / "standin")
    kvtier_root = Path(kvtier.__file__).resolve().parents[1]     # this checkout's kvtier
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(standin), str(kvtier_root)])}
    done = subprocess.run([sys.executable, "-c", STOPS_WHILE_PRINTING], env=env, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines, still_ours, stop_timeout = done.stdout.split()
    # every decision line reached stdout (was 0 of 21), and stdout is the planner's own after
    # the stops (was a StringIO for good)
    assert (int(lines), still_ours) == (21, "True"), done.stdout
    assert float(stop_timeout) == 60                                  # vLLM's default: the least timeout


# --- D3: the router's counters are stamped when the router answered ------------------------------

RATE = 20.0   # requests/s the router's counters grow by


class ClockedRouter:
    """A router ``/metrics`` whose counters are, at the moment it answers, exactly ``RATE`` req/s
    since it started."""

    def __init__(self) -> None:
        began = time.monotonic()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                n = RATE * (time.monotonic() - began)
                body = ("# TYPE kvtier_router_requests counter\n"
                        f'kvtier_router_requests_total{{worker="w"}} {n}\n'
                        "# TYPE kvtier_router_prompt_tokens counter\n"
                        f'kvtier_router_prompt_tokens_total{{worker="w"}} {n * 1000}\n'
                        "# TYPE kvtier_router_actual_cached_tokens counter\n"
                        'kvtier_router_actual_cached_tokens_total{worker="w"} 0\n').encode()
                _answer(self, body)

            def log_message(self, *args):
                pass

        self.httpd, self.url = _serve(Handler)


class SometimesSlowWorker:
    """A worker's ``/metrics`` that answers every other scrape ``late_s`` late (a busy engine),
    within the scrape's timeout and the interval's deadline."""

    def __init__(self, late_s: float) -> None:
        scrapes = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                scrapes.append(1)
                if len(scrapes) % 2 == 0:
                    time.sleep(late_s)
                _answer(self, VLLM_TEXT.encode())

            def log_message(self, *args):
                pass

        self.httpd, self.url = _serve(Handler)


def _answer(handler: BaseHTTPRequestHandler, body: bytes) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _serve(handler) -> tuple[ThreadingHTTPServer, str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_port}"


def test_a_slow_worker_scrape_leaves_the_measured_rate_alone(sizer):
    router, worker = ClockedRouter(), SometimesSlowWorker(late_s=1.2)
    launcher = DryRunLauncher(out=io.StringIO())
    launcher.seed("prefill", 1)
    launcher.seed("decode", 1)
    loop = PlannerLoop(LivePlanner(sizer, PlannerSettings(interval_s=2, startup_s=2)), launcher, router.url, 256,
                       scrape, worker_urls=lambda: [worker.url])
    measured = []
    try:
        for _ in range(4):                                 # plan live: a step, then the interval's sleep
            if loop.step() is not None:
                measured.append(loop.metrics.registry.get_sample_value("kvtier_planner_observed_request_rate"))
            time.sleep(2.0)
    finally:
        for server in (router, worker):
            server.httpd.shutdown()
            server.httpd.server_close()
    assert len(measured) == 3
    # was 20 x 2/3.2 and 20 x 3.2/2 in turn (12.5 and 32): the stamp moved by the slow worker
    assert all(abs(rate / RATE - 1) < 0.15 for rate in measured), measured


# --- D4: a crash loop on joining doubles the backoff -----------------------------------------------

@pytest.fixture
def router():
    r = RouterThread()
    yield r
    r.close()


def _start_when_allowed(launcher: LocalLauncher):
    """The planner's next intervals: a start is asked for until the backoff lets one through."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return apply(_decision((2, 2, 2, "hold"), (0, 0, 0, "hold")), launcher)[0]
        except LaunchError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def _serve_then_crash(launcher: LocalLauncher, served_s: float = 0.0):
    worker = _start_when_allowed(launcher)
    assert wait_until(lambda: worker.state == "serving", 30)
    time.sleep(served_s)
    os.killpg(launcher._procs[worker.name].proc.pid, signal.SIGKILL)
    assert wait_until(lambda: ("failed", worker.name) in [(a, n) for _, a, n in launcher.actions], 10)
    return worker


def test_a_worker_that_crashes_on_joining_again_and_again_backs_off_longer_each_time(router, tmp_path):
    launcher = LocalLauncher(WorkerTemplate("tiny", program=STANDIN, kv_events=False),
                             RouterAdmin(router.url, timeout_s=1), tmp_path, poll_s=0.1, stop_timeout_s=5,
                             failure_backoff_s=0.5, max_failure_backoff_s=2.0, early_crash_s=3.0)
    launcher.adopt(router.first.url)
    try:
        backoffs = []
        for _ in range(4):                                 # each dies on its first requests
            _serve_then_crash(launcher)
            backoffs.append(launcher._backoff_s())
        assert backoffs == [0.5, 1.0, 2.0, 2.0]            # was 0.5 each time
        # control: a worker that serves past early_crash_s started well, and its crash is no
        # failed start: the round of failures is over, the replacement starts at once
        _serve_then_crash(launcher, served_s=3.5)
        assert launcher._backoff_s() == 0
        replacement = apply(_decision((2, 2, 2, "hold"), (0, 0, 0, "hold")), launcher)
        assert len(replacement) == 1
    finally:
        launcher.close(timeout_s=10)
        for record in list(launcher._procs.values()):
            if record.proc is not None:
                _kill_group(record.proc.pid)
