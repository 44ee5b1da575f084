"""The local launcher over a worker's whole life against a real ``Router`` on a real socket, with
real stand-in worker processes (tests/planner/standin_worker.py; tests/planner/zmq_standin.py binds
its KV-event sockets as vLLM does): a drain during registration, a run directory too long for
ipc sockets, a router that restarts and forgets, a worker that crashes at start in a loop.
s27 audit P5-P8."""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.cli.top import Samples
from kvtier.errors import ConfigError
from kvtier.planner.local_launcher import KEEP_FINISHED, LaunchError, LocalLauncher, RouterAdmin, WorkerTemplate
from tests.planner.test_local_launcher import STANDIN, RouterThread, _until

pytestmark = pytest.mark.timeout(120)
ZMQ_STANDIN = (sys.executable, "-m", "tests.planner.zmq_standin")
REPO = str(Path(__file__).resolve().parents[2])


@pytest.fixture
def router():
    r = RouterThread()
    yield r
    r.close()


# --- P5: a drain while the registration is under way ----------------------------------------

class SlowAddAdmin(RouterAdmin):
    """The real admin client whose POST /admin/workers reaches the router ``delay_s`` late (a
    router whose event loop is busy, a slow network)."""

    delay_s = 1.5

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.adding = threading.Event()

    def add(self, url, events=None):
        self.adding.set()
        time.sleep(self.delay_s)
        return super().add(url, events)


def test_a_worker_drained_while_its_registration_is_under_way_does_not_stay_in_the_router(router, tmp_path):
    """The drain arrives (a scale-down, close() on Ctrl-C) just after /health answered, while the
    start thread's POST /admin/workers is under way. The drain thread waited one poll, found the
    worker not in the router and stopped it; the add then landed, and the router kept a dead
    worker for good. Now the drain waits for the start thread, then takes out what landed."""
    launcher = LocalLauncher(WorkerTemplate("tiny", program=STANDIN, kv_events=False), SlowAddAdmin(router.url),
                             tmp_path, poll_s=0.1, stop_timeout_s=15)
    launcher.adopt(router.first.url)
    try:
        worker = launcher.start("prefill")
        assert launcher.admin.adding.wait(20), "the worker never became healthy"
        launcher.drain(worker)
        _until(lambda: worker.state == "stopped", 20)
        assert launcher._procs[worker.name].proc.poll() is not None
        time.sleep(0.5)
        assert router.urls() == [router.first.url], f"{worker.url} was stopped but is still in the router"
    finally:
        launcher.close()
    assert router.urls() == [router.first.url]


# --- P6: a run directory too long for the workers' ipc sockets ------------------------------

def _run_dir_of(longest_path: int) -> Path:
    """A run directory (not created) whose longest ipc path, ``…/prefill-999999.replay``, is
    ``longest_path`` bytes."""
    base = Path(tempfile.mkdtemp(prefix="kp")).resolve()
    return base / ("d" * (longest_path - len(str(base)) - len("/prefill-999999.replay") - 1))


def _zmq_template() -> WorkerTemplate:
    return WorkerTemplate("tiny", program=ZMQ_STANDIN, kv_events=True, env=(("PYTHONPATH", REPO),))


def test_a_run_dir_too_long_for_an_ipc_socket_is_refused_up_front(router):
    """A unix socket path holds 107 bytes; vLLM binds its KV-event publisher at start-up and dies
    with ZMQError on a longer one. Nothing checked it: every worker died at start, was failed,
    and the next one after the backoff did the same, for ever. Refused at construction, naming
    --run-dir, before anything is created."""
    too_long = _run_dir_of(108)
    try:
        with pytest.raises(ConfigError, match="--run-dir .*too long.*107"):
            LocalLauncher(_zmq_template(), RouterAdmin(router.url), too_long)
        assert not too_long.exists()
        # without KV events there is no socket: any run directory will do
        LocalLauncher(WorkerTemplate("tiny", program=STANDIN, kv_events=False), RouterAdmin(router.url), too_long)
    finally:
        shutil.rmtree(too_long.parent, ignore_errors=True)


def test_control_a_run_dir_at_the_ipc_limit_serves_workers_that_bind_their_sockets(router):
    """Control: at exactly 107 bytes the launcher accepts it and the stand-in, binding its sockets
    as vLLM does, serves."""
    run_dir = _run_dir_of(107)
    launcher = LocalLauncher(_zmq_template(), RouterAdmin(router.url), run_dir, poll_s=0.1, stop_timeout_s=15)
    launcher.adopt(router.first.url)
    try:
        worker = launcher.start("prefill")
        _until(lambda: worker.state != "starting", 30)
        assert worker.state == "serving", (run_dir / f"{worker.name}.log").read_text()[-400:]
    finally:
        launcher.close()
        shutil.rmtree(run_dir.parent, ignore_errors=True)


def test_plan_live_refuses_a_run_dir_too_long_for_ipc_sockets_with_exit_status_2(capsys, monkeypatch):
    # run_live's logging.basicConfig would leave a handler on capsys' stream for later tests
    monkeypatch.setattr(logging.root, "handlers", [])
    monkeypatch.setattr(logging.root, "level", logging.root.level)
    too_long = _run_dir_of(200)
    try:
        rc = main(["plan", "live", "--router", "127.0.0.1:9", "--ttft", "1", "--itl", "0.05", "--launcher", "local",
                   "--model", "tiny", "--adopt", "http://127.0.0.1:9", "--run-dir", str(too_long)])
        assert rc == 2
        assert "--run-dir" in capsys.readouterr().err and not too_long.exists()
    finally:
        shutil.rmtree(too_long.parent, ignore_errors=True)


# --- P7: a router that restarted and forgot the workers added at run time --------------------

def _restart_router(rt: RouterThread) -> None:
    """``kvtier route`` restarted on the same port with its configured workers only."""
    from aiohttp import web

    from kvtier.router.app import Router
    from kvtier.router.config import RouterConfig, WorkerSpec
    from tests.router.test_http import WordTokenizer

    async def restart():
        await rt.runner.cleanup()
        config = RouterConfig(workers=[WorkerSpec(rt.first.url)], policy="round-robin", block_tokens=4,
                              kv_bytes_per_token=4096, health_interval_s=0.2, port=rt.port)
        rt.router = Router(config, WordTokenizer())
        rt.runner = rt.router.runner()
        await rt.runner.setup()
        await web.TCPSite(rt.runner, "127.0.0.1", rt.port).start()

    rt._call(restart())


def test_a_serving_worker_the_router_forgot_after_a_restart_is_registered_again(router, tmp_path):
    """The router restarts knowing only its --worker list. The launcher watched only the process,
    so it counted the worker serving while the router sent it nothing, and the planner never
    replaced it. The watcher now looks for it in the router's list and adds it again."""
    launcher = LocalLauncher(WorkerTemplate("tiny", program=STANDIN, kv_events=False), RouterAdmin(router.url),
                             tmp_path, poll_s=0.1, stop_timeout_s=15, registration_check_s=0.3)
    launcher.adopt(router.first.url)
    try:
        worker = launcher.start("prefill")
        _until(lambda: worker.state == "serving", 20)
        _restart_router(router)
        assert worker.url not in router.urls()        # control: the restarted router does not know it
        _until(lambda: worker.url in router.urls(), 10)
        # (the launcher records the add once the router's answer is back: the router lists it first)
        _until(lambda: ("registered_again", worker.name) in [(a, n) for _, a, n in launcher.actions], 10)
        assert worker.state == "serving" and router.urls().count(worker.url) == 1
        launcher.drain(worker)                        # and it drains as any other
        _until(lambda: worker.state == "stopped", 20)
        assert router.urls() == [router.first.url]
    finally:
        launcher.close()


class RefusingAgainAdmin(RouterAdmin):
    """The real admin client, standing in for a router that takes a worker once and refuses it
    afterwards (its answer is a LaunchError as a real refusal's is)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.adds = 0

    def add(self, url, events=None):
        self.adds += 1
        if self.adds > 1:
            raise LaunchError("router POST /admin/workers: 403 refused")
        return super().add(url, events)


def test_a_forgotten_worker_the_router_will_not_take_again_is_failed_and_not_counted(router, tmp_path):
    launcher = LocalLauncher(WorkerTemplate("tiny", program=STANDIN, kv_events=False),
                             RefusingAgainAdmin(router.url), tmp_path, poll_s=0.1, stop_timeout_s=15,
                             registration_check_s=0.3, failure_backoff_s=30)
    launcher.adopt(router.first.url)
    try:
        worker = launcher.start("prefill")
        _until(lambda: worker.state == "serving", 20)
        _restart_router(router)
        # "failed" is recorded once it is stopped (the state is claimed before, against a drain)
        _until(lambda: ("failed", worker.name) in [(a, n) for _, a, n in launcher.actions], 20)
        assert worker.state == "failed" and launcher._procs[worker.name].proc.poll() is not None
        assert [w.url for w in launcher.list("prefill")] == [router.first.url]
    finally:
        launcher.close()


# --- P8: a worker that crashes at start, again and again ---------------------------------------

def _fail_once(launcher: LocalLauncher, count: int = 1) -> None:
    """Start ``count`` workers once the backoff allows it; wait until they all failed."""
    deadline = time.monotonic() + 20
    while True:
        try:
            workers = [launcher.start("prefill") for _ in range(count)]
            break
        except LaunchError:
            assert time.monotonic() < deadline, "the backoff never ended"
            time.sleep(0.02)
    for worker in workers:   # the failure recorded: its transition is over
        _until(lambda: ("failed", worker.name) in [(a, n) for _, a, n in launcher.actions], 20)


def test_a_worker_that_crashes_at_start_in_a_loop_keeps_the_run_dir_and_records_bounded(
        router, tmp_path, monkeypatch):
    """A worker command that always dies at start (bad --worker-args, a GPU another process
    holds): each try left a log file, a record, a Popen and action entries for the planner's
    whole life. The last few are kept; the planner's metrics still count every action."""
    from kvtier.planner.hardware import cost_models
    from kvtier.planner.live import FleetSizer, LivePlanner
    from kvtier.planner.loop import PlannerLoop
    from kvtier.planner.models import load_model
    from kvtier.planner.workers import SLATargets

    monkeypatch.setenv("STANDIN_EXIT_AT_ONCE", "1")
    launcher = LocalLauncher(WorkerTemplate("tiny", program=STANDIN, kv_events=False), RouterAdmin(router.url),
                             tmp_path, poll_s=0.05, failure_backoff_s=0.0, actions=deque(maxlen=4))
    launcher.adopt(router.first.url)
    costs = cost_models(load_model("llama-3-8b"), "h100", 1)
    loop = PlannerLoop(LivePlanner(FleetSizer(SLATargets(2.0, 0.05), costs.prefill, costs.decode, 1e10, 100_000)),
                       launcher, router.url, 256, scrape=lambda url: Samples(False, {}, "down"))
    failures = 3 * KEEP_FINISHED
    try:
        for _ in range(failures):
            _fail_once(launcher)
            loop.step()                      # the router "down": the loop only records the launcher
        logs = sorted(tmp_path.glob("*.log"))
        assert len(logs) == KEEP_FINISHED, [p.name for p in logs]
        assert logs[-1].name == f"prefill-{failures + 1}.log"               # the newest kept
        assert len(launcher.workers) <= 1 + KEEP_FINISHED + 1 and len(launcher._procs) == len(launcher.workers)
        assert launcher.workers[0].url == router.first.url                   # the adopted one stays
        counted = {a: loop.metrics.registry.get_sample_value("kvtier_planner_launcher_actions_total", {"action": a})
                   for a in ("start", "failed")}
        assert counted == {"start": failures, "failed": failures}
    finally:
        launcher.close()


def test_failed_starts_back_off_exponentially_up_to_a_cap_and_a_serving_worker_ends_it(
        router, tmp_path, monkeypatch):
    """The backoff was a fixed failure_backoff_s for ever. It doubles per round of failures (the
    starts of one apply that fail alike are one round), up to max_failure_backoff_s; a worker
    that serves past early_crash_s ends the round (one that dies sooner failed to start in effect:
    test_s34b_planner_regressions.py)."""
    monkeypatch.setenv("STANDIN_EXIT_AT_ONCE", "1")
    launcher = LocalLauncher(WorkerTemplate("tiny", program=STANDIN, kv_events=False), RouterAdmin(router.url),
                             tmp_path, poll_s=0.05, stop_timeout_s=15, failure_backoff_s=0.2,
                             max_failure_backoff_s=0.5, early_crash_s=0.5)
    launcher.adopt(router.first.url)
    try:
        backoffs = []
        for count in (2, 1, 1, 1):
            _fail_once(launcher, count)
            backoffs.append(launcher._backoff_s())
        assert backoffs == pytest.approx([0.2, 0.4, 0.5, 0.5])
        with pytest.raises(LaunchError, match="next try"):
            launcher.start("prefill")
        monkeypatch.delenv("STANDIN_EXIT_AT_ONCE")
        time.sleep(0.6)
        worker = launcher.start("prefill")
        _until(lambda: worker.state == "serving", 20)
        _until(lambda: launcher._backoff_s() == 0.0, 5)    # served past early_crash_s: the round is over
    finally:
        launcher.close()
