"""The live planner's interval against slow workers, a launcher that runs fewer workers than asked,
and a long dry run (audit s34 a5 D3, D8, D9).

D3: the workers' ``/metrics`` were scraped one after another, each bounded only per read: silent
workers added 2 s each to an interval, and one that drips its answer held it as long as it
dripped. D8: the planner decided from the counts it had asked for, not from what the launcher
runs: with starts refused it reported 4 workers while 1 ran, and a "scale_down" started workers.
D9: a dry run's drained workers stayed ``draining`` forever, its records growing with every
scale-down. Real parts: real HTTP endpoints and sockets, the real scrape, loop, planner, cost
models, the local launcher with stand-in worker processes, the dry-run launcher."""

from __future__ import annotations

import io
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier.cli.top import scrape
from kvtier.planner.hardware import cost_models
from kvtier.planner.launchers import DryRunLauncher, apply
from kvtier.planner.live import FleetSizer, LivePlanner, PlannerSettings
from kvtier.planner.local_launcher import LocalLauncher, RouterAdmin, WorkerTemplate
from kvtier.planner.loop import PlannerLoop
from kvtier.planner.metrics import PlannerMetrics
from kvtier.planner.models import load_model
from kvtier.planner.workers import SLATargets
from tests.planner.test_local_launcher import STANDIN
from tests.planner.test_planner_hostile import VLLM_TEXT, MetricsServer, _decision, _kill_group, router_text
from tests.polling import wait_until

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def sizer():
    costs = cost_models(load_model("llama-3-70b"), "h100", 8)
    return FleetSizer(SLATargets(ttft_s=2.0, itl_s=0.05), costs.prefill, costs.decode, 22.5e9, 1_200_000)


@pytest.fixture
def router_metrics():
    server = MetricsServer(router_text(100, 400_000, 100_000))
    yield server
    server.close()


def _dry_run_loop(sizer, router_url: str, workers: list[str]) -> PlannerLoop:
    launcher = DryRunLauncher(out=io.StringIO())
    launcher.seed("prefill", 1)
    launcher.seed("decode", 1)
    return PlannerLoop(LivePlanner(sizer, PlannerSettings(interval_s=1, startup_s=1)), launcher, router_url, 256,
                       scrape, worker_urls=lambda: workers)


# --- D3: one deadline for an interval's scrapes ----------------------------------------------------

class SilentWorkers:
    """Listening sockets that never accept: a connection is made (the kernel's backlog), no answer
    ever comes (a stuck engine's API server)."""

    def __init__(self, count: int) -> None:
        self.sockets = [socket.create_server(("127.0.0.1", 0), backlog=8) for _ in range(count)]
        self.urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in self.sockets]

    def close(self) -> None:
        for s in self.sockets:
            s.close()


class DrippingWorker:
    """An HTTP server that answers its headers one byte every 0.5 s (a broken proxy in front of a
    worker), each read well within a scrape's timeout; it counts the scrapes it was sent."""

    def __init__(self, drip_s: float = 12.0) -> None:
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                outer.requests += 1
                header = b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * int(drip_s / 0.5) + b"\r\n"
                try:
                    for byte in header:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(0.5)
                except OSError:
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


#: what one interval's scrapes may take: the loop's deadline (3 s) and some slack for a busy host
INTERVAL_SCRAPES_S = 4.5


def _timed_step(loop: PlannerLoop) -> float:
    began = time.monotonic()
    loop.step()
    return time.monotonic() - began


def test_silent_workers_cost_an_interval_one_scrape_timeout_not_one_each(sizer, router_metrics):
    silent, good = SilentWorkers(4), MetricsServer(VLLM_TEXT)
    try:
        loop = _dry_run_loop(sizer, router_metrics.url, [*silent.urls, good.url])
        assert loop.step() is None                         # the baseline
        router_metrics.body = router_text(200, 800_000, 200_000)
        took = _timed_step(loop)
        assert took < INTERVAL_SCRAPES_S, took   # was 4 x 2 s, one after another
        assert loop.last is not None and loop.last_load.workers == 1     # the good one counted, the rest down
    finally:
        silent.close()
        good.close()


def test_a_worker_that_drips_its_answer_is_down_at_the_deadline_and_not_scraped_again_meanwhile(
        sizer, router_metrics):
    drip, good = DrippingWorker(), MetricsServer(VLLM_TEXT)
    try:
        loop = _dry_run_loop(sizer, router_metrics.url, [drip.url, good.url])
        took = _timed_step(loop)
        assert took < INTERVAL_SCRAPES_S, took   # was as long as it dripped
        router_metrics.body = router_text(200, 800_000, 200_000)
        took = _timed_step(loop)                           # its first scrape still drips
        assert took < INTERVAL_SCRAPES_S, took
        assert loop.last is not None and loop.last_load.workers == 1     # the good one, the dripping one down
        assert drip.requests == 1                          # one thread held by it, not one per interval
    finally:
        drip.close()
        good.close()


# --- D8: the planner decides from the workers the launcher runs ----------------------------------

def test_the_planner_counts_the_workers_the_launcher_runs_not_those_it_asked_for(sizer, router_metrics, tmp_path):
    """Every start fails (the workers die at once), so the launcher backs off: the pool asked to
    grow from 1 to 4 still runs 1. The next decision starts from that 1 (and asks again for the
    3 missing), and exports it."""
    launcher = LocalLauncher(WorkerTemplate("tiny", program=STANDIN, kv_events=False,
                                            env=(("STANDIN_EXIT_AT_ONCE", "1"),)),
                             RouterAdmin(router_metrics.url, timeout_s=1), tmp_path, poll_s=0.1, stop_timeout_s=5)
    adopted = launcher.adopt("http://127.0.0.1:9")
    settings = PlannerSettings(interval_s=1, startup_s=1, max_workers=4)
    loop = PlannerLoop(LivePlanner(sizer, settings, 1, 1), launcher, router_metrics.url, 256, scrape,
                       metrics=PlannerMetrics(), aggregate=True)
    try:
        assert loop.step() is None                         # the baseline
        router_metrics.body = router_text(200, 800_000, 200_000)
        up = loop.step()
        assert (up.prefill.action, up.prefill.current, up.prefill.target) == ("scale_up", 1, 4)
        assert wait_until(lambda: launcher.list("prefill") == [adopted], 30)   # the 3 started died
        router_metrics.body = router_text(300, 1_200_000, 300_000)
        again = loop.step()
        # was "hold 4 -> 4": the planner's own last target, as if the 3 ran
        assert (again.prefill.action, again.prefill.current, again.prefill.target) == ("scale_up", 1, 4)
        assert loop.metrics.registry.get_sample_value("kvtier_planner_workers", {"pool": "prefill"}) == 1
    finally:
        launcher.close(timeout_s=5)
        for record in list(launcher._procs.values()):
            if record.proc is not None:
                _kill_group(record.proc.pid)


def test_a_scale_down_never_starts_a_worker_whatever_the_launcher_runs():
    launcher = DryRunLauncher(out=io.StringIO())
    launcher.seed("prefill", 1)
    launcher.seed("decode", 1)
    # decided on 4 running while the launcher runs 1 (a decision made before the launcher's failures)
    touched = apply(_decision((4, 3, 3, "scale_down"), (1, 1, 1, "hold")), launcher)
    assert touched == [] and [w.name for w in launcher.list("prefill")] == ["prefill-1"]


# --- D9: a dry run's drains end ------------------------------------------------------------------

def test_a_dry_run_drained_worker_is_stopped_at_the_next_apply_and_its_records_stay_few():
    out = io.StringIO()
    launcher = DryRunLauncher(out=out)
    launcher.seed("prefill", 2)
    launcher.seed("decode", 1)
    metrics = PlannerMetrics()
    apply(_decision((2, 6, 6, "scale_up"), (1, 1, 1, "hold")), launcher)
    apply(_decision((6, 2, 2, "scale_down"), (1, 1, 1, "hold")), launcher)
    drained = [w for w in launcher.workers if w.state == "draining"]
    assert len(drained) == 4                               # pretended drains, as before
    apply(_decision((2, 2, 2, "hold"), (1, 1, 1, "hold")), launcher)
    assert all(w.state == "stopped" for w in drained) and f"would stop {drained[0].name}" in out.getvalue()
    for _ in range(50):                                    # a load that swings up and down every day
        apply(_decision((2, 6, 6, "scale_up"), (1, 1, 1, "hold")), launcher)
        apply(_decision((6, 2, 2, "scale_down"), (1, 1, 1, "hold")), launcher)
    apply(_decision((2, 2, 2, "hold"), (1, 1, 1, "hold")), launcher)
    metrics.record_launcher(launcher)
    draining = metrics.registry.get_sample_value("kvtier_planner_launcher_workers",
                                                 {"pool": "prefill", "state": "draining"})
    assert draining == 0 and len(launcher.list("prefill")) == 2          # was 200 draining
    assert len(launcher.workers) <= 10                     # a few stopped kept; was 203 records
