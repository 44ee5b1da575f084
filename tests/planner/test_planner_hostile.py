"""The planner against what goes wrong around it: a router that is down or answers garbage,
workers that die, metrics that are not metrics, side files that cannot be written, targets out
of reach, hostile config files. Real components, as test_local_launcher.py uses them: a real
Router on a real socket, stand-in worker processes, real HTTP /metrics endpoints, the CLI."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import signal
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier.cli.main import main
from kvtier.cli.top import scrape
from kvtier.planner.hardware import cost_models
from kvtier.planner.launchers import DryRunLauncher, aggregated, apply
from kvtier.planner.live import Decision, FleetSizer, LivePlanner, Observation, PlannerSettings, PoolDecision
from kvtier.planner.local_launcher import LaunchError, LocalLauncher, RouterAdmin, WorkerTemplate
from kvtier.planner.loop import PlannerLoop
from kvtier.planner.models import load_model
from kvtier.planner.observe import RouterCounters, fleet_load, observation_between
from kvtier.planner.workers import SLATargets
from tests.planner.test_local_launcher import STANDIN, RouterThread, _running, _until
from tests.router.test_http import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def costs():
    return cost_models(load_model("llama-3-70b"), "h100", 8)


@pytest.fixture(scope="module")
def sizer(costs):
    return FleetSizer(SLATargets(ttft_s=2.0, itl_s=0.05), costs.prefill, costs.decode, 22.5e9, 1_200_000)


def _decision(prefill, decode) -> Decision:
    return Decision(0.0, 1.0, 1.1, 0.0, 0.5, PoolDecision("prefill", *prefill, "p"),
                    PoolDecision("decode", *decode, "d"))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --- the local launcher: the router down, a worker dead (D1, D2, D6) -------------------------

def _launcher(router_url: str, run_dir, **kw) -> LocalLauncher:
    return LocalLauncher(WorkerTemplate("tiny", program=kw.pop("program", STANDIN), kv_events=False),
                         RouterAdmin(router_url, timeout_s=1), run_dir, poll_s=0.1, stop_timeout_s=5, **kw)


def test_router_admin_turns_no_answer_into_a_launch_error():
    """A refused connection and a 200 whose body is not JSON are LaunchErrors, which every
    transition handles, not exceptions that end its thread with the worker stuck mid-state."""
    with pytest.raises(LaunchError, match="GET /admin/workers"):
        RouterAdmin(f"http://127.0.0.1:{free_port()}", timeout_s=1).workers()
    html = MetricsServer("<html>502 Bad Gateway</html>")
    try:
        with pytest.raises(LaunchError, match="GET /admin/workers"):
            RouterAdmin(html.url, timeout_s=1).workers()
    finally:
        html.close()


def test_a_worker_healthy_while_the_router_is_unreachable_is_stopped_and_failed(tmp_path):
    launcher = _launcher(f"http://127.0.0.1:{free_port()}", tmp_path)      # nothing listens there
    worker = launcher.start("prefill")
    proc = launcher._procs[worker.name].proc
    try:
        _until(lambda: worker.state != "starting", 15)
        assert worker.state == "failed"
        _until(lambda: proc.poll() is not None, 10)
        assert "standin args" in (tmp_path / f"{worker.name}.log").read_text()   # it did run (and got healthy)
        with pytest.raises(LaunchError, match="next try"):                     # the failure backoff
            launcher.start("prefill")
    finally:
        _kill_group(proc.pid)


def test_close_with_the_router_down_still_stops_the_workers_it_started(tmp_path):
    router = RouterThread()
    launcher = _launcher(router.url, tmp_path)
    adopted = launcher.adopt(router.first.url)
    worker = launcher.start("prefill")
    proc = launcher._procs[worker.name].proc
    try:
        _until(lambda: worker.state == "serving")
        router.close()                                 # the router goes away (a crash, a restart)
        launcher.close(timeout_s=10)
        assert proc.poll() is not None and worker.state == "stopped"
        assert adopted.state == "serving"              # not started here: never signalled
    finally:
        _kill_group(proc.pid)


def test_a_serving_worker_that_dies_is_failed_forgotten_by_the_router_and_replaced(tmp_path):
    router = RouterThread()
    launcher = _launcher(router.url, tmp_path, failure_backoff_s=0)
    launcher.adopt(router.first.url)
    worker = launcher.start("prefill")
    procs = [launcher._procs[worker.name].proc]
    try:
        _until(lambda: worker.state == "serving")
        assert worker.url in router.urls()             # control: it joined the router
        os.killpg(procs[0].pid, signal.SIGKILL)        # OOM, a crash
        _until(lambda: worker.state == "failed", 10)
        assert worker not in launcher.list("prefill")
        _until(lambda: worker.url not in router.urls(), 10)
        assert procs[0].poll() is not None             # reaped
        # the planner's next interval sees the pool one short and starts a replacement
        started = apply(_decision((2, 2, 2, "hold"), (0, 0, 0, "hold")), launcher)
        assert len(started) == 1 and started[0] is not worker
        procs.append(launcher._procs[started[0].name].proc)
        _until(lambda: started[0].state == "serving")
    finally:
        launcher.close(timeout_s=10)
        router.close()
        for proc in procs:
            _kill_group(proc.pid)


CHILD_THEN_EXIT = textwrap.dedent("""
    import os, subprocess, sys, time
    # what vLLM's API server does: an engine-core child in its process group; then the
    # parent dies before /health ever answered (a crash in start-up)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(os.environ["CHILD_PID_FILE"], "w") as f:
        f.write(str(child.pid))
    time.sleep(0.3)
    os._exit(3)
""")


def test_a_worker_that_exits_before_healthy_has_its_process_group_killed(tmp_path, monkeypatch):
    script = tmp_path / "worker.py"
    script.write_text(CHILD_THEN_EXIT)
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("CHILD_PID_FILE", str(pid_file))
    launcher = _launcher(f"http://127.0.0.1:{free_port()}", tmp_path / "run", program=(sys.executable, str(script)),
                         failure_backoff_s=30)
    worker = launcher.start("prefill")
    try:
        _until(lambda: worker.state == "failed", 15)
        child = int(pid_file.read_text())               # control: the child was started
        _until(lambda: not _running(child), 5)
    finally:
        _kill_group(launcher._procs[worker.name].proc.pid)
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


# --- the loop: metrics that are not metrics, side files that cannot be written (D4, D5) -------

class MetricsServer:
    """A real HTTP server answering every GET with whatever ``body`` holds now."""

    def __init__(self, body: str) -> None:
        self.body = body
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                data = outer.body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def router_text(requests: float, prompt: float, cached: float) -> str:
    return ("# TYPE kvtier_router_requests counter\n"
            f'kvtier_router_requests_total{{worker="w"}} {requests}\n'
            "# TYPE kvtier_router_prompt_tokens counter\n"
            f'kvtier_router_prompt_tokens_total{{worker="w"}} {prompt}\n'
            "# TYPE kvtier_router_actual_cached_tokens counter\n"
            f'kvtier_router_actual_cached_tokens_total{{worker="w"}} {cached}\n')


VLLM_TEXT = ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n"
             "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 1\n")


@pytest.fixture
def router_metrics():
    server = MetricsServer(router_text(100, 400_000, 100_000))
    yield server
    server.close()


def _loop(sizer, router_url, **kw) -> PlannerLoop:
    launcher = DryRunLauncher(out=io.StringIO())
    launcher.seed("prefill", 1)
    launcher.seed("decode", 1)
    planner = LivePlanner(sizer, PlannerSettings(interval_s=1, startup_s=1), 1, 1)
    return PlannerLoop(planner, launcher, router_url, 256, kw.pop("scrape", scrape), **kw)


def test_a_worker_serving_something_else_than_metrics_is_down_not_the_planners_end(sizer, router_metrics):
    garbage, good = MetricsServer("<html><body>502 Bad Gateway</body></html>\n"), MetricsServer(VLLM_TEXT)
    try:
        loop = _loop(sizer, router_metrics.url, worker_urls=lambda: [garbage.url, good.url])
        assert loop.step() is None                              # first scrape: the baseline
        router_metrics.body = router_text(200, 800_000, 200_000)
        assert loop.step() is not None
        assert (loop.last_load.workers, loop.last_load.running) == (1, 3)   # the good one counted, alone
    finally:
        garbage.close()
        good.close()


def test_a_scrape_that_raises_counts_as_down(sizer, router_metrics):
    """Whatever the injected scraper does (another one than kvtier.cli.top's): the worker is
    left out, the router counted as a scrape error, and the loop goes on."""
    broken = "http://worker.invalid"

    def scraper(url):
        if url in (broken, "http://router.invalid"):
            raise RuntimeError("boom")
        return scrape(url)

    loop = _loop(sizer, router_metrics.url, worker_urls=lambda: [broken], scrape=scraper)
    loop.step()
    router_metrics.body = router_text(200, 800_000, 200_000)
    assert loop.step() is not None and loop.last_load.workers == 0
    loop.router = "http://router.invalid"
    assert loop.step() is None and loop.metrics.scrape_errors._value.get() == 1


def test_a_router_serving_something_else_than_metrics_is_a_scrape_error(sizer, router_metrics):
    loop = _loop(sizer, router_metrics.url)
    router_metrics.body = 'kvtier_router_requests_total{worker="w"} not-a-number\n'
    assert loop.step() is None
    assert loop.metrics.scrape_errors._value.get() == 1
    router_metrics.body = router_text(100, 400_000, 100_000)   # control: good text again is read
    loop.step()
    router_metrics.body = router_text(200, 800_000, 200_000)
    assert loop.step() is not None and loop.metrics.scrape_errors._value.get() == 1


def test_router_counters_that_are_nan_or_inf_give_no_observation():
    """A router exporting NaN or Inf (valid Prometheus text) used to raise out of step(): round(nan)."""
    before = RouterCounters(0.0, 100.0, 400_000.0, 100_000.0)
    assert observation_between(before, RouterCounters(1.0, 200.0, 800_000.0, 200_000.0), 256) is not None  # control
    for bad in (float("nan"), float("inf")):
        assert observation_between(before, RouterCounters(1.0, bad, 800_000.0, 200_000.0), 256) is None
        assert observation_between(before, RouterCounters(1.0, 200.0, bad, 200_000.0), 256) is None
        assert observation_between(before, RouterCounters(1.0, 200.0, 800_000.0, bad), 256) is None


def test_a_histogram_bucket_whose_bound_is_not_a_number_is_skipped():
    text = ("# TYPE vllm:time_to_first_token_seconds histogram\n"
            'vllm:time_to_first_token_seconds_bucket{le="0.5"} 4\n'
            'vllm:time_to_first_token_seconds_bucket{le="soon"} 5\n'
            'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 8\n'
            "vllm:time_to_first_token_seconds_count 8\nvllm:time_to_first_token_seconds_sum 9\n")
    server = MetricsServer(text)
    try:
        load = fleet_load({server.url: scrape(server.url)}, None, 0.5)
    finally:
        server.close()
    assert load.workers == 1 and load.ttft_s == pytest.approx(0.5)


def test_a_status_file_that_cannot_be_written_is_counted_and_the_planner_goes_on(sizer, router_metrics, tmp_path):
    status_dir = tmp_path / "status"
    status_dir.mkdir()
    loop = _loop(sizer, router_metrics.url, status_file=str(status_dir / "planner.json"),
                 targets_file=str(status_dir / "targets.json"))
    loop.step()
    assert (status_dir / "targets.json").exists()                # control: it writes there
    shutil.rmtree(status_dir)                                    # a tmp cleaner, an unmounted volume
    router_metrics.body = router_text(200, 800_000, 200_000)
    assert loop.step() is not None
    assert loop.metrics.status_write_errors._value.get() == 2    # the targets file and the status file
    status_dir.mkdir()                                           # back: written again
    router_metrics.body = router_text(300, 1_200_000, 300_000)
    assert loop.step() is not None
    assert (status_dir / "planner.json").exists() and not (status_dir / "planner.json.tmp").exists()


@pytest.mark.timeout(20)   # the old code looped on, deciding nothing, writing no status
def test_plan_live_refuses_a_status_file_in_a_directory_that_does_not_exist(tmp_path, capsys, monkeypatch):
    # run_live's logging.basicConfig would leave a handler on capsys' stream for later tests
    monkeypatch.setattr(logging.root, "handlers", [])
    monkeypatch.setattr(logging.root, "level", logging.root.level)
    for flag in ("--status-file", "--targets-file"):
        args = ["plan", "live", "--router", f"127.0.0.1:{free_port()}", "--ttft", "2", "--itl", "0.05",
                "--iterations", "1", flag, str(tmp_path / "missing" / "out.json")]
        assert main(args) == 2
        assert "directory does not exist" in capsys.readouterr().err


# --- decisions: the pool acted on, out-of-reach targets, bounds, launch errors (D7-D10) -------

def test_aggregated_reports_the_pool_it_acts_on():
    steady = aggregated(_decision((2, 2, 2, "hold"), (5, 5, 5, "hold")))
    assert (steady.prefill.current, steady.prefill.target, steady.prefill.action) == (5, 5, "hold")
    down = aggregated(_decision((2, 2, 2, "hold"), (5, 3, 4, "scale_down")))
    assert (down.prefill.current, down.prefill.target, down.prefill.action) == (5, 4, "scale_down")
    up = aggregated(_decision((3, 6, 6, "scale_up"), (2, 2, 2, "hold")))
    assert (up.prefill.current, up.prefill.target, up.prefill.action) == (3, 6, "scale_up")


def test_decode_is_sized_by_its_own_need_when_the_ttft_target_is_out_of_reach(costs):
    """20 req/s of 30k-token prompts with 2k-token outputs: decode needs what the same sizer
    says with a reachable TTFT, whatever happens to prefill."""
    def sizer(ttft, itl=0.05, kv_tokens=1_200_000):
        return FleetSizer(SLATargets(ttft_s=ttft, itl_s=itl), costs.prefill, costs.decode, 22.5e9, kv_tokens)

    reachable = sizer(100.0).size(20.0, (30_000,), (2_000,), 0.0, 1.0)
    unreachable = sizer(0.5).size(20.0, (30_000,), (2_000,), 0.0, 1.0)
    assert reachable.note == "" and "TTFT target unreachable" in unreachable.note
    assert unreachable.decode_workers == reachable.decode_workers > 10
    assert unreachable.prefill_workers >= reachable.prefill_workers * 0.9   # keeps up, utilization <= 0.9
    # decode out of reach itself (one request exceeds a worker's KV memory): a keep-up count, at once
    started = time.perf_counter()
    no_room = sizer(100.0, kv_tokens=20_000).size(20.0, (30_000,), (2_000,), 0.0, 1.0)
    assert time.perf_counter() - started < 1.0
    assert "ITL target unreachable" in no_room.note and 1 <= no_room.decode_workers < 10_000
    assert no_room.prefill_workers == reachable.prefill_workers


def test_a_pool_above_max_workers_is_brought_within_bounds_at_once(sizer):
    planner = LivePlanner(sizer, PlannerSettings(max_workers=4), prefill_workers=10, decode_workers=10)
    d = planner.decide(Observation(0.0, 50.0, (4_000,) * 10, (300,) * 10, 0.4))
    assert (d.prefill.target, d.decode.target) == (4, 4)
    assert d.prefill.action == "scale_down" and "--max-workers" in d.prefill.reason
    d = planner.decide(Observation(15.0, 50.0, (4_000,) * 10, (300,) * 10, 0.4))
    assert d.prefill.current == 4 and d.prefill.target <= 4


class BackingOffLauncher(DryRunLauncher):
    """A launcher in its failure backoff for the prefill pool (LocalLauncher.start raises
    LaunchError for failure_backoff_s after a failed start)."""

    def start(self, pool):
        if pool == "prefill":
            raise LaunchError("a worker failed to start; next try in 60 s")
        return super().start(pool)


def test_a_launch_error_in_one_pool_does_not_skip_the_other_pools_actions():
    launcher = BackingOffLauncher(out=io.StringIO())
    launcher.seed("prefill", 1)
    launcher.seed("decode", 3)
    with pytest.raises(LaunchError, match="next try"):          # still reported, once both pools are done
        apply(_decision((1, 2, 2, "scale_up"), (3, 1, 2, "scale_down")), launcher)
    decode = launcher.list("decode")
    assert sum(w.state == "draining" for w in decode) == 1 and len(decode) == 3


# --- hostile config files: a message and exit status 2, never a traceback (D11) -----------------

SMALL_MODEL = ('{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, '
               '"intermediate_size": 128}')
GOOD_POINTS = "[[100, 1e-6], [200, 2e-6], [300, 3e-6]]"     # a tiny model: fast enough for the targets
WORKERS = ["plan", "workers", "--ttft", "2", "--itl", "0.1", "--rate", "1", "--input-tokens", "1000",
           "--output-tokens", "100", "--hit-rate", "0.5"]

CLUSTERS = {
    "good": '{"decode_kv_bytes": 4e11}',                            # control
    "decode_kv_bytes_nan": '{"decode_kv_bytes": NaN}',
    "decode_kv_bytes_inf": '{"decode_kv_bytes": Infinity}',
    "decode_kv_bytes_past_a_float": '{"decode_kv_bytes": 1%s}' % ("0" * 400),
    "model_not_a_string": '{"model": 5}',
    "accelerator_not_a_string": '{"accelerator": 5}',
    "calibration_not_a_string": '{"calibration": 5}',
    "tier_bandwidth_nan": ('{"tiers": [{"name": "pod", "scope": "pod", "capacity_bytes": null,'
                           ' "read_bytes_per_s": NaN}]}'),
    "tier_capacity_inf": ('{"tiers": [{"name": "pod", "scope": "pod", "capacity_bytes": Infinity,'
                          ' "read_bytes_per_s": 1e9}]}'),
}

CALIBRATIONS = {
    "good": (GOOD_POINTS, SMALL_MODEL),                             # control
    "point_not_a_pair": ("[[1]]", SMALL_MODEL),
    "seconds_nan": ("[[100, NaN], [200, 0.2], [300, 0.3]]", SMALL_MODEL),
    "tokens_inf": ("[[1e999, 0.1], [200, 0.2], [300, 0.3]]", SMALL_MODEL),
    "tokens_past_a_float": ("[[1%s, 0.1], [200, 0.2], [300, 0.3]]" % ("0" * 400), SMALL_MODEL),
    "model_config_not_an_object": (GOOD_POINTS, "[1, 2]"),
    "model_config_field_not_a_number": (GOOD_POINTS, SMALL_MODEL.replace('"hidden_size": 64', '"hidden_size": "x"')),
}


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_a_bad_cluster_config_is_a_config_error(name, tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text(CLUSTERS[name])
    assert main([*WORKERS, "--cluster", str(path)]) == (0 if name == "good" else 2)
    assert ("kvtier plan" in capsys.readouterr().err) is (name != "good")


@pytest.mark.parametrize("name", sorted(CALIBRATIONS))
def test_a_bad_calibration_table_is_a_config_error_naming_the_file(name, tmp_path, capsys):
    points, model_config = CALIBRATIONS[name]
    path = tmp_path / "calibration.json"
    path.write_text('{"accelerator": "h100", "devices": 1, "model_config": %s, "points": %s}' % (model_config, points))
    assert main([*WORKERS, "--calibration", str(path)]) == (0 if name == "good" else 2)
    if name != "good":
        assert f"kvtier plan: calibration table {path}" in capsys.readouterr().err


@pytest.mark.parametrize("size", ["1e999", "Infinity"])
def test_a_model_config_with_an_infinite_size_is_a_config_error(size, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(SMALL_MODEL.replace('"hidden_size": 64', f'"hidden_size": {size}'))
    assert main(["plan", "capacity", "--users", "10", "--context-tokens", "100", "--model", str(path)]) == 2
    assert "model config" in capsys.readouterr().err
    path.write_text(SMALL_MODEL)                                     # control
    assert main(["plan", "capacity", "--users", "10", "--context-tokens", "100", "--model", str(path)]) == 0


@pytest.mark.parametrize("command", [
    ["plan", "workers", "--ttft", "1", "--itl", "0.05", "--rate", "2", "--input-tokens", "100", "--output-tokens", "10",
     "--hit-rate", "0.5", "--retention-s", "1e308", "--json"],
    ["plan", "capacity", "--users", "10", "--context-tokens", "100", "--replication", "1e308", "--json"],
])
def test_plan_json_is_strict_json_a_size_that_overflows_is_null(command, capsys):
    """``--retention-s 1e308`` sized the shared tier at ``inf`` bytes and ``--json`` printed
    ``Infinity``, which is not JSON (jq, Go and JavaScript refuse it): null instead."""
    assert main(command) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    sizes = out["tiers"]["shared_bytes"] if "tiers" in out else out["rows"][0]["total_bytes"]
    assert sizes is None
