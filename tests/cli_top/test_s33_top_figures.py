"""``kvtier top``'s figures across a server restart and for a worker of several engines (audit s33
a8 D2, D5), scraped from real HTTP peers.

D2: the frame's hit rate was the raw delta of the hit and miss counters since the last frame;
a restarted server's counters begin again, and the frame showed -33 % or 133 %.
D5: a worker's "KV use" summed its ``kv_cache_usage_perc`` series, one per engine under data
parallel: two engines 90 % full showed 180 %, where the planner reads the fullest, 90 %.
"""

from __future__ import annotations

import pytest

from kvtier.cli.main import main
from kvtier.cli.top import Samples, build_frame, scrape
from tests.cli_top.test_scrape_hostile import RawPeer, _http

NOT_GIVEN = Samples(False, {}, "not given")


def _server_counters(hits: int, misses: int) -> bytes:
    return _http((f'# TYPE kvtier_hits_total counter\nkvtier_hits_total{{op="get"}} {hits}\n'
                  f'# TYPE kvtier_misses_total counter\nkvtier_misses_total{{op="get"}} {misses}\n').encode())


def _hit_rate_between(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """The get hit rate of a frame whose server answered ``before`` (hits, misses), then ``after``."""
    peer = RawPeer(_server_counters(*before))
    try:
        previous = scrape(peer.url, timeout_s=5)
        peer.reply = _server_counters(*after)
        current = scrape(peer.url, timeout_s=5)
    finally:
        peer.close()
    assert previous.up and current.up
    return build_frame(current, NOT_GIVEN, {}, None, prev_server=previous).server_hit_rate["get"]


@pytest.mark.parametrize(("before", "after"), [((100, 0), (50, 200)), ((0, 100), (200, 50)), ((80, 90), (10, 30))],
                         ids=["fewer_hits", "fewer_misses", "both_fewer"])
def test_a_server_restart_between_frames_reads_the_new_totals(before, after):
    """A counter that went down: the server restarted, and both count from 0 again (as Prometheus
    reads a reset), so the frame's rate is over the new totals. Was -33 %, 133 % and "-"."""
    assert _hit_rate_between(before, after) == pytest.approx(after[0] / sum(after))


def test_control_without_a_restart_the_rate_is_over_the_frames_deltas():
    assert _hit_rate_between((100, 0), (150, 50)) == pytest.approx(0.5)


def _worker_gauges(*lines: str) -> bytes:
    return _http(("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n" + "".join(
        f"{line}\n" for line in lines)).encode())


@pytest.mark.parametrize(("gauges", "shown"), [
    (['vllm:kv_cache_usage_perc{engine="0"} 0.9', 'vllm:kv_cache_usage_perc{engine="1"} 0.9'], 0.9),
    (['vllm:kv_cache_usage_perc{engine="0"} 0.2', 'vllm:kv_cache_usage_perc{engine="1"} 0.7'], 0.7),
    (['vllm:kv_cache_usage_perc{engine="0"} NaN', 'vllm:kv_cache_usage_perc{engine="1"} 0.5'], 0.5),
    (['vllm:gpu_cache_usage_perc{engine="0"} 0.0', 'vllm:kv_cache_usage_perc{engine="0"} 0.4'], 0.4),
    ([], None),
], ids=["two_engines_full", "uneven_engines", "a_nan_engine", "both_names", "no_gauge"])
def test_a_workers_kv_use_is_its_fullest_engine_as_the_planner_reads_it(gauges, shown):
    from kvtier.planner.observe import fleet_load

    peer = RawPeer(_worker_gauges(*gauges))
    try:
        worker = scrape(peer.url, timeout_s=5)
    finally:
        peer.close()
    assert worker.up
    row = build_frame(NOT_GIVEN, NOT_GIVEN, {peer.url: worker}, None).workers[0]
    assert row["kv_usage"] == shown      # was 1.8, 0.9, nan, 0.0 and 0.0 (no gauge read as empty)
    assert row["kv_usage"] == fleet_load({peer.url: worker}, None, 0.9).kv_usage_max


def test_the_rendered_frame_shows_a_two_engine_worker_at_90_percent(capsys):
    peer = RawPeer(_worker_gauges('vllm:kv_cache_usage_perc{engine="0"} 0.9',
                                  'vllm:kv_cache_usage_perc{engine="1"} 0.9'))
    try:
        rc = main(["top", "--worker", peer.url, "--once"])
    finally:
        peer.close()
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if peer.url in line)
    assert rc == 0 and "90%" in row and "180%" not in row, out

