"""The local launcher against a real ``Router`` on a real socket, with stand-in worker processes
(tests/planner/standin_worker.py: /health late, slow streams, SIGTERM). The same launcher with
real vLLM workers: tests/integrations/vllm/test_planner_live.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from aiohttp import web

from kvtier.errors import ConfigError
from kvtier.planner.launchers import aggregated, apply
from kvtier.planner.live import Decision, PoolDecision
from kvtier.planner.local_launcher import LaunchError, LocalLauncher, RouterAdmin, WorkerTemplate
from kvtier.router.app import Router
from kvtier.router.config import RouterConfig, WorkerSpec
from tests.router.test_http import StandIn, WordTokenizer, free_port

pytestmark = pytest.mark.timeout(120)
STANDIN = (sys.executable, "-m", "tests.planner.standin_worker")


class RouterThread:
    """A real Router (round-robin) on its own event loop thread, with one in-process stand-in worker."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.first = StandIn("first")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._call(self._start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _start(self):
        await self.first.start()
        config = RouterConfig(workers=[WorkerSpec(self.first.url)], policy="round-robin", block_tokens=4,
                              kv_bytes_per_token=4096, health_interval_s=0.2, port=self.port)
        self.router = Router(config, WordTokenizer())
        self.runner = self.router.runner()
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def _stop(self):
        await self.runner.cleanup()
        await self.first.stop()

    def close(self) -> None:
        self._call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    def urls(self) -> list[str]:
        return [w.url for w in self.router.workers]


@pytest.fixture
def router():
    r = RouterThread()
    yield r
    r.close()


def _stream(url: str, prompt: str) -> tuple[str, bool]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({"prompt": prompt, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.headers["X-Kvtier-Worker"], b"[DONE]" in resp.read()


def _until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_started_worker_joins_only_once_healthy_and_a_drained_one_finishes_its_stream_then_stops(
        router, tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_HEALTH_AFTER_S", "1.5")
    monkeypatch.setenv("STANDIN_CHUNK_S", "0.4")
    launcher = LocalLauncher(WorkerTemplate("tiny", ("--dtype", "float32"), program=STANDIN, kv_events=False),
                             RouterAdmin(router.url), tmp_path, poll_s=0.1, stop_timeout_s=15)
    launcher.adopt(router.first.url)
    worker = launcher.start("prefill")
    assert worker.state == "starting" and worker.url not in router.urls()
    time.sleep(1.0)                                  # running, /health still 503: not behind the router
    assert worker.state == "starting" and worker.url not in router.urls()
    _until(lambda: worker.state == "serving")
    assert worker.url in router.urls()
    assert '"--dtype", "float32"' in (tmp_path / f"{worker.name}.log").read_text()   # the template's flags
    # two streams at once, round-robin: one on each worker; drain the new one mid-stream
    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(_stream, router.url, f"p {i}") for i in range(2)]
        _until(lambda: any(w.inflight for w in router.router.workers if w.url == worker.url), 5)
        launcher.drain(worker)
        _until(lambda: any(w.draining for w in router.router.workers if w.url == worker.url), 5)
        assert launcher._procs[worker.name].proc.poll() is None     # not stopped while its stream runs
        answers = sorted(f.result() for f in streams)
    assert answers == sorted([(router.first.url, True), (worker.url, True)])
    _until(lambda: worker.state == "stopped")
    assert worker.url not in router.urls()
    assert launcher._procs[worker.name].proc.returncode == 0        # SIGTERM, a clean exit (not SIGKILL)
    assert [a for _, a, n in launcher.actions if n == worker.name] == ["start", "serving", "drain", "removed", "stop"]
    assert launcher.list("prefill") == [w for w in launcher.workers if w.url == router.first.url]


def test_a_worker_that_dies_before_healthy_is_failed_never_registered_and_backs_off(router, tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_EXIT_AT_ONCE", "1")
    launcher = LocalLauncher(WorkerTemplate("tiny", program=STANDIN, kv_events=False), RouterAdmin(router.url),
                             tmp_path, poll_s=0.1, failure_backoff_s=30)
    worker = launcher.start("prefill")
    _until(lambda: worker.state == "failed")
    assert router.urls() == [router.first.url]
    with pytest.raises(LaunchError, match="next try"):
        launcher.start("prefill")


def test_apply_drains_the_youngest_and_aggregated_holds_both_needs(router, tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_CHUNK_S", "0.05")
    launcher = LocalLauncher(WorkerTemplate("tiny", program=STANDIN, kv_events=False), RouterAdmin(router.url),
                             tmp_path, poll_s=0.1, stop_timeout_s=15)
    launcher.adopt(router.first.url)

    def decision(prefill: tuple, decode: tuple) -> Decision:
        return Decision(0.0, 1.0, 1.1, 0.0, 0.5, PoolDecision("prefill", *prefill, "x", "p"),
                        PoolDecision("decode", *decode, "x", "d"))

    up = aggregated(decision((1, 1, 1), (1, 2, 2)))             # decode needs two: two workers
    assert (up.prefill.target, up.prefill.action, up.decode.target) == (2, "scale_up", 0)
    apply(up, launcher)
    young = [w for w in launcher.workers if w.url != router.first.url][0]
    _until(lambda: young.state == "serving")
    apply(aggregated(decision((2, 1, 1), (2, 1, 1))), launcher)
    _until(lambda: young.state == "stopped")
    assert [w.url for w in launcher.list("prefill")] == [router.first.url] == router.urls()
    with pytest.raises(ConfigError, match="--port"):
        WorkerTemplate("tiny", ("--port", "9"))
    launcher.close()


KILLED_PLANNER = """
import sys, threading, time
from kvtier.planner.local_launcher import LocalLauncher, RouterAdmin, WorkerTemplate
launcher = LocalLauncher(WorkerTemplate("tiny", program=tuple(sys.argv[2:]), kv_events=False),
                         RouterAdmin("http://127.0.0.1:9"), sys.argv[1], poll_s=0.1)
started = []
t = threading.Thread(target=lambda: started.append(launcher.start("prefill")))   # any thread may start one
t.start()
t.join()
time.sleep(1.0)
print(launcher.pids()[started[0].name], flush=True)
sys.stdin.read()   # lives until killed, its close() never called
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:   # a zombie (dead, not yet reaped by init) is gone
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_planner_takes_the_workers_it_started_along(tmp_path, monkeypatch):
    """A planner SIGKILLed (OOM, a killed test run) before its close(): its vLLM workers used to run
    on (ppid 1), holding cores and memory. Now each gets SIGTERM from the kernel and stops in order."""
    monkeypatch.setenv("STANDIN_HEALTH_AFTER_S", "3600")    # stays "starting": no router needed
    planner = subprocess.Popen([sys.executable, "-c", KILLED_PLANNER, str(tmp_path), *STANDIN], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2])
    worker = None
    try:
        worker = int(planner.stdout.readline())
        assert _running(worker), "control: the worker runs while its planner does"
        planner.kill()
        planner.wait()
        _until(lambda: not _running(worker), 15)
        assert "standin args" in next(tmp_path.glob("*.log")).read_text()   # it was the stand-in that ran
    finally:
        planner.kill()
        planner.wait()
        if worker is not None and _running(worker):
            os.killpg(worker, signal.SIGKILL)
