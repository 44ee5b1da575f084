"""The workers' vLLM metrics as the live planner reads them (kvtier/planner/observe.py fleet_load,
kvtier/planner/loop.py): real HTTP /metrics endpoints scraped with the planner's own scrape
(kvtier.cli.top.scrape), through the real PlannerLoop.step against a real router where the loop
is what is under test. s27 audit P2-P4."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier.cli.top import scrape
from kvtier.planner.hardware import cost_models
from kvtier.planner.launchers import DryRunLauncher
from kvtier.planner.live import FleetSizer, LivePlanner, PlannerSettings
from kvtier.planner.loop import PlannerLoop
from kvtier.planner.models import load_model
from kvtier.planner.observe import fleet_load
from kvtier.planner.workers import SLATargets
from tests.planner.test_local_launcher import RouterThread

pytestmark = pytest.mark.timeout(60)

TTFT = "vllm:time_to_first_token_seconds"


class MetricsEndpoint:
    """A real /metrics endpoint whose body the test sets (None: answers 503, a failed scrape)."""

    def __init__(self) -> None:
        self.body: str | None = ""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = outer.body
                if body is None:
                    self.send_response(503)
                    self.end_headers()
                    return
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def set_histogram(self, buckets: dict[str, float], started: float | None = None) -> None:
        """vLLM's TTFT histogram with these cumulative bucket counts (le -> count); ``started``:
        the process_start_time_seconds it exports beside."""
        lines = [f"# HELP {TTFT} Histogram of time to first token in seconds.", f"# TYPE {TTFT} histogram"]
        for le, count in buckets.items():
            lines.append(f'{TTFT}_bucket{{le="{le}",model_name="m"}} {count}')
        total = buckets["+Inf"]
        lines += [f'{TTFT}_count{{model_name="m"}} {total}', f'{TTFT}_sum{{model_name="m"}} {total * 1.0}']
        lines += ["# TYPE vllm:num_requests_running gauge", 'vllm:num_requests_running{model_name="m"} 0']
        if started is not None:
            lines += ["# TYPE process_start_time_seconds gauge", f"process_start_time_seconds {started}"]
        self.body = "\n".join(lines) + "\n"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    e = MetricsEndpoint()
    yield e
    e.close()


def _interval(endpoint, before: dict, after: dict, started=(None, None)) -> float | None:
    endpoint.set_histogram(before, started[0])
    first = {endpoint.url: scrape(endpoint.url)}
    endpoint.set_histogram(after, started[1])
    now = {endpoint.url: scrape(endpoint.url)}
    assert first[endpoint.url].up and now[endpoint.url].up
    return fleet_load(now, first, 0.9).ttft_s


# --- P2: a worker restarted between two scrapes ---------------------------------------------

def test_a_worker_restarted_between_scrapes_gives_the_interval_ttft_not_a_mix_of_deltas(endpoint):
    """Before: 40 slow requests (0, 40, 40). Restarted, then 50 fast and 10 slow (50, 60, 60): no
    bucket went down, yet deltas taken bucket by bucket (50, 20, 20) are not cumulative, and they
    gave p90 0.036 s for an interval whose p90 is ~4 s (rank 54 of 60, linear in its bucket)."""
    ttft = _interval(endpoint, {"0.1": 0, "10.0": 40, "+Inf": 40}, {"0.1": 50, "10.0": 60, "+Inf": 60})
    assert ttft == pytest.approx(0.1 + 9.9 * 4 / 10, rel=0.05), f"p90 TTFT over the interval is ~4 s, not {ttft}"


def test_a_restart_seen_in_one_bucket_only_takes_the_current_counts_of_every_bucket(endpoint):
    """One bucket went down (90 fast before; 10 fast and 90 slow since the restart), the others
    up: the whole histogram is the new life's. Judged bucket by bucket it was 10, 5, 5 (p90
    0.045 s)."""
    ttft = _interval(endpoint, {"0.1": 90, "10.0": 95, "+Inf": 95}, {"0.1": 10, "10.0": 100, "+Inf": 100})
    assert ttft == pytest.approx(0.1 + 9.9 * (90 - 10) / 90, rel=0.05)


def test_a_restart_whose_deltas_look_cumulative_is_told_by_the_process_start_time(endpoint):
    """(10, 20, 20) -> (50, 60, 60): deltas 40, 40, 40 look like an interval of fast requests;
    only the process start time says the 60 requests, 10 of them slow, are all since a restart."""
    before, after = {"0.1": 10, "10.0": 20, "+Inf": 20}, {"0.1": 50, "10.0": 60, "+Inf": 60}
    same = _interval(endpoint, before, after, started=(1000.0, 1000.0))
    restarted = _interval(endpoint, before, after, started=(1000.0, 2000.0))
    assert same == pytest.approx(0.1 * 36 / 40, rel=0.05)                     # control: the interval's deltas
    assert restarted == pytest.approx(0.1 + 9.9 * (54 - 50) / 10, rel=0.05)   # the current counts


def test_control_an_interval_without_restart_reads_the_deltas(endpoint):
    """Control: 10,000 fast before, 100 slow since: the interval is the 100 slow ones."""
    ttft = _interval(endpoint, {"0.1": 10_000, "10.0": 10_000, "+Inf": 10_000},
                     {"0.1": 10_000, "10.0": 10_100, "+Inf": 10_100})
    assert ttft == pytest.approx(0.1 + 9.9 * 90 / 100, rel=0.05)


# --- P3 / P4: through the planner's loop ---------------------------------------------------------

@pytest.fixture
def router():
    r = RouterThread()
    yield r
    r.close()


def _loop(router_url: str, workers: list[str], tmp_path) -> PlannerLoop:
    costs = cost_models(load_model("llama-3-8b"), "h100", 1)
    sizer = FleetSizer(SLATargets(2.0, 0.05), costs.prefill, costs.decode, 10e9, 100_000)
    launcher = DryRunLauncher(out=open(tmp_path / "dry.txt", "w"))
    launcher.seed("prefill", 1)
    launcher.seed("decode", 1)
    return PlannerLoop(LivePlanner(sizer, PlannerSettings(interval_s=1.0)), launcher, router_url, 256, scrape,
                       worker_urls=lambda: list(workers), status_file=str(tmp_path / "planner.json"))


def test_a_worker_whose_previous_scrape_failed_is_read_since_its_last_good_one(router, endpoint, tmp_path):
    """One scrape of a long-running worker fails (a timeout under load, a 503). The loop kept that
    failed scrape as the baseline, so the next interval read the worker's histogram over its
    whole life: 10,000 fast requests of the past hours swamped the 100 slow ones since, and the
    planner reported p90 0.09 s. Its last good scrape is the baseline."""
    loop = _loop(router.url, [endpoint.url], tmp_path)
    endpoint.set_histogram({"0.1": 10_000, "10.0": 10_000, "+Inf": 10_000})
    loop.step()
    endpoint.body = None                                          # the worker's scrape fails
    loop.step()
    assert loop.last_load.workers == 0
    endpoint.set_histogram({"0.1": 10_000, "10.0": 10_100, "+Inf": 10_100})   # 100 slow since
    loop.step()
    assert loop.last_load.ttft_s == pytest.approx(0.1 + 9.9 * 90 / 100, rel=0.05), \
        f"every request since the last good scrape took 5 s; the planner reports p90 {loop.last_load.ttft_s}"


def test_a_nan_gauge_from_one_worker_neither_hides_a_full_one_nor_breaks_the_status_json(router, tmp_path):
    """One worker exports NaN gauges (a 0/0 while its engine restarts), another is 95 % full.
    ``max`` over the workers returned NaN when the NaN came first: the full worker disappeared
    from kvtier_planner_engine_kv_usage_max, and the status file got ``NaN``, which is not JSON
    (jq, Go, JavaScript refuse it). Non-finite samples are skipped per worker; the file is strict."""
    nan_worker, full_worker = MetricsEndpoint(), MetricsEndpoint()
    nan_worker.body = ("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"m\"} NaN\n"
                       "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} NaN\n"
                       "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} +Inf\n")
    full_worker.body = ("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.95\n"
                        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 3\n")
    try:
        loop = _loop(router.url, [nan_worker.url, full_worker.url], tmp_path)
        loop.step()
        time.sleep(0.2)
        assert loop.step() is not None, "no decision on the second interval"
        load = loop.last_load
        assert (load.workers, load.kv_usage_max, load.running, load.waiting) == (2, pytest.approx(0.95), 3, 0)

        def strict(name):
            raise ValueError(f"{name} in the status file is not JSON")

        status = json.loads((tmp_path / "planner.json").read_text(), parse_constant=strict)
        assert status["engines"]["kv_usage_max"] == pytest.approx(0.95)
        assert status["engines"]["ttft_s"] is None                  # no histogram: null, not NaN
    finally:
        nan_worker.close()
        full_worker.close()


def test_a_figure_that_is_not_finite_is_null_in_the_status_file(tmp_path):
    """Whatever the decision or the engines carry, the status file is strict JSON: a TTFT out of
    reach (+Inf) is null."""
    from kvtier.planner.loop import _replace_json

    path = tmp_path / "s.json"
    _replace_json(str(path), {"a": float("inf"), "b": [float("nan"), 1.5], "c": (float("-inf"),)})
    assert json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(c)) == {"a": None, "b": [None, 1.5],
                                                                                        "c": [None]}
