"""``kvtier bench route --trace``: its measuring parts (decision p99 from the router's own
Prometheus histogram, round figures, the issue's targets, the streaming replay client against
an OpenAI-speaking stand-in), and one smoke run of the whole command on the tiny model (real
``kvtier serve``, real vLLM workers, real ``kvtier route`` processes)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from kvtier.bench import route_trace
from kvtier.router.metrics import RouterMetrics

SLICE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head500.jsonl"


def _window_work(path: Path, requests: int, warmup: int, start: int = 0, vocab: int = 2048) -> int:
    """The counted window's non-reusable tokens, as the bench counts them."""
    from kvtier.bench import vllm_trace as vt

    warm, counted, _ = vt.trace_window(str(path), requests, warmup, 1.0, start)
    prompts = vt.synthesise(counted, vocab)
    return sum(len(p["prompt"]) - hit for p, hit in zip(prompts, vt.reusable_tokens(counted, warm)))


def test_auto_span_loads_the_workers_the_same_share_whatever_the_requests_and_the_machine(tmp_path):
    """The default span was a fixed 15 s: the load it put on the workers was the window's work,
    so a trace of shorter requests left them idle (4 % busy on an agent trace, every round's TTFT
    the same 0.03 s). The auto span gives every window and machine the same busy share.
    Control: a fixed span, the old default, loads two windows of different work differently."""
    small = tmp_path / "short.jsonl"   # the slice with every request a quarter as long
    rows = [json.loads(line) for line in SLICE.read_text().splitlines()]
    short = [r["hash_ids"][: max(1, len(r["hash_ids"]) // 4)] for r in rows]
    small.write_text("".join(json.dumps({**r, "input_length": len(ids) * 512 - 100, "hash_ids": ids}) + "\n"
                             for r, ids in zip(rows, short)))
    work = {name: _window_work(path, 64, 200) for name, path in (("full", SLICE), ("short", small))}
    assert work["short"] < 0.5 * work["full"], work
    for speed in (4000.0, 9000.0):   # both workers' prompt tokens per second
        spans = {name: route_trace.auto_span(w, speed) for name, w in work.items()}
        for name, span in spans.items():
            assert work[name] / (span * speed) == pytest.approx(route_trace.BUSY_SHARE, rel=0.02)
        assert spans["short"] < spans["full"]
    assert route_trace.auto_span(work["full"], 9000.0) < route_trace.auto_span(work["full"], 4000.0)  # faster: shorter
    busy_at_15s = {name: w / (15.0 * 4000.0) for name, w in work.items()}   # control: the old fixed default
    assert busy_at_15s["short"] < 0.5 * busy_at_15s["full"]
    with pytest.raises(ValueError, match="no prefill speed"):
        route_trace.auto_span(work["full"], 0.0)


def test_the_shared_tier_holds_every_round_the_run_replays():
    """With room for three rounds, the replay that filled the server was the slowest of its run
    whichever policy held its slot: the server now holds the priming round, each policy's and one
    more. Control: the old size (two host tiers of 1.5 rounds) holds fewer than a default run's six."""
    round_mib = 617.0   # the conversation trace's default window, mid model
    rounds = 1 + len(route_trace.POLICIES)
    assert route_trace.shared_tier_mib(round_mib, rounds) >= (rounds + 1) * round_mib
    assert 2 * math.ceil(round_mib * 1.5) < rounds * round_mib   # control: the old size
    assert route_trace.shared_tier_mib(0.5, 2) == 128          # a floor for tiny windows


def test_warm_up_speed_counts_computed_tokens_and_arrivals_spread_over_the_span():
    rows = [{"prompt_tokens": 1000, "cached_tokens": 600}, {"prompt_tokens": 500, "cached_tokens": 0}]
    assert route_trace.replay_prefill_speed(rows, 0.5) == pytest.approx(1800.0)   # (400 + 500) / 0.5
    unit = [{"arrival_s": 0.0, "prompt": [1]}, {"arrival_s": 0.5, "prompt": [2]}, {"arrival_s": 1.0, "prompt": [3]}]
    assert [r["arrival_s"] for r in route_trace.at_span(unit, 12.0)] == [0.0, 6.0, 12.0]
    assert [r["arrival_s"] for r in unit] == [0.0, 0.5, 1.0]   # the unit arrivals stay for the next round


def test_decision_p99_is_read_from_the_routers_histogram():
    m = RouterMetrics()
    for _ in range(980):
        m.decision.observe(0.00005)      # bucket (3e-5, 1e-4]
    for _ in range(20):
        m.decision.observe(0.002)        # bucket (1e-3, 3e-3]
    text = m.render().decode()
    p50 = route_trace.histogram_quantile(text, "kvtier_router_decision_seconds", 0.5)
    p99 = route_trace.histogram_quantile(text, "kvtier_router_decision_seconds", 0.99)
    assert 3e-5 < p50 <= 1e-4
    # the 990th of 1000 lies in the slow bucket: p99 must not report the fast one
    assert 1e-3 < p99 <= 3e-3
    assert route_trace.histogram_quantile(RouterMetrics().render().decode(), "kvtier_router_decision_seconds",
                                          0.99) is None


def test_ttft_parts_from_server_timing_and_the_workers_vllm_histograms():
    assert route_trace.server_timing("router;dur=0.52, upstream;dur=1466.5") == pytest.approx(
        {"router": 0.00052, "upstream": 1.4665})
    assert route_trace.server_timing("") == {} and route_trace.server_timing("x;desc=y, z;dur=bad") == {}
    rows = [dict(_row(1.0, 0), router_s=0.001, upstream_s=0.9), dict(_row(2.0, 0), router_s=0.003, upstream_s=1.95)]
    parts = route_trace.summarise(rows, "")["ttft_parts_p50_ms"]
    assert parts == {"router": 2.0, "held": 0.0, "held_p90": 0.0, "upstream": 1425.0, "client_minus_upstream": 75.0}
    # time held in the router (kvtier.router.admission) is its own part, not the relay's
    held = [dict(r, held_s=0.05) for r in rows]
    parts = route_trace.summarise(held, "")["ttft_parts_p50_ms"]
    assert parts["held"] == 50.0 and parts["client_minus_upstream"] == pytest.approx(25.0)
    assert route_trace.server_timing("router;dur=0.5, held;dur=250, upstream;dur=9")["held"] == pytest.approx(0.25)
    # vLLM's histograms, two label sets summed; the round's means from before/after scrapes
    def scrape(ttft_sum, n):
        return "\n".join(f'vllm:{name}_{kind}{{engine="0",model_name="m"}} {value}'
                          for name in ("time_to_first_token_seconds", "request_queue_time_seconds",
                                       "request_prefill_time_seconds", "request_decode_time_seconds")
                          for kind, value in (("sum", ttft_sum), ("count", n)))
    before = [route_trace.vllm_sums(scrape(1.0, 2)), route_trace.vllm_sums(scrape(0.0, 0))]
    after = [route_trace.vllm_sums(scrape(4.0, 4)), route_trace.vllm_sums(scrape(3.0, 2))]
    side = route_trace.worker_side(before, after)
    assert side["ttft_mean_s"] == 1.5 and side["queue_mean_s"] == 1.5   # (3 + 3) s over 4 requests


def _row(ttft, cached, prompt=100, out=10, arrival=0.0, finish=2.0, worker="w0"):
    return {"ttft_s": ttft, "cached_tokens": cached, "prompt_tokens": prompt, "output_tokens": out,
            "arrival_s": arrival, "finish_s": finish, "worker": worker}


def test_round_figures_and_targets():
    rows = [_row(0.1, 50), _row(0.2, 0, worker="w1"), _row(0.3, 100, arrival=1.0, finish=4.0),
            _row(1.0, 10, worker="w1")]
    out = route_trace.summarise(rows, "")
    assert out["ttft_p50_s"] == 0.25 and out["ttft_p90_s"] == pytest.approx(0.79, abs=1e-3)
    assert out["cached_token_ratio"] == 0.4 and out["output_tokens_per_s"] == 10.0   # 40 tokens / 4 s
    assert out["requests_per_worker"] == [2, 2] and out["decision_p99_ms"] is None

    base = {"ttft_p50_s": 1.0, "ttft_p90_s": 2.0, "cached_token_ratio": 0.2}
    good = {"ttft_p50_s": 0.4, "ttft_p90_s": 1.0, "cached_token_ratio": 0.4}
    rr = {"ttft_p50_s": 0.6, "ttft_p90_s": 0.9, "cached_token_ratio": 0.3}
    t = route_trace.targets({"baseline": base, "policies": {"tier-aware": good, "round-robin": rr}})
    assert t["ttft_p50_half_of_baseline"] and t["ttft_p50_best_policy"] and t["cached_1_5x_baseline"]
    assert not t["ttft_p90_best_policy"]     # round-robin's p90 is lower: reported as missed
    slow = dict(good, ttft_p50_s=0.51)
    assert not route_trace.targets({"baseline": base, "policies": {"tier-aware": slow}})["ttft_p50_half_of_baseline"]


class _Streamer:
    """Speaks vLLM's streamed completions: the first chunk after ``delay_s``, then the usage chunk."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.bodies, self.received = delay_s, [], []

    async def complete(self, request):
        body = await request.json()
        self.bodies.append(body)
        self.received.append(time.monotonic())
        await asyncio.sleep(self.delay_s)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Kvtier-Worker": "w0"})
        await out.prepare(request)
        n = body["max_tokens"]
        for _ in range(n):
            await out.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": 32}}
        await out.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        await out.write_eof()
        return out


def test_replay_sends_on_schedule_with_the_rounds_salt_and_times_the_first_chunk():
    streamer = _Streamer(delay_s=0.15)
    requests = [{"arrival_s": 0.0, "prompt": list(range(64)), "max_tokens": 3},
                {"arrival_s": 0.4, "prompt": list(range(40)), "max_tokens": 2}]

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", streamer.complete)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await route_trace._replay(f"http://127.0.0.1:{port}", "m", requests, "salt-1")
        finally:
            await runner.cleanup()

    rows = asyncio.run(main())
    assert [b["cache_salt"] for b in streamer.bodies] == ["salt-1", "salt-1"]
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in streamer.bodies)
    assert streamer.received[1] - streamer.received[0] == pytest.approx(0.4, abs=0.1)   # arrivals kept
    for r in rows:
        assert 0.15 <= r["ttft_s"] < 0.6 and r["cached_tokens"] == 32 and r["worker"] == "w0"
    assert [r["output_tokens"] for r in rows] == [3, 2] and [r["prompt_tokens"] for r in rows] == [64, 40]


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")


@needs_vllm
@pytest.mark.timeout(600)
def test_rounds_run_in_a_seeded_shuffled_order():
    """The fixed order (round-robin first, tier-aware last) gave the first round empty host and
    server tiers and the last one tiers full of older rounds' blocks: every policy must get
    every slot over seeds, and a seed must give the same order again."""
    policies = list(route_trace.POLICIES)
    assert route_trace.round_order(policies, 7) == route_trace.round_order(policies, 7)
    orders = [route_trace.round_order(policies, seed) for seed in range(200)]
    assert all(sorted(o) == sorted(policies) for o in orders)
    for slot in (0, len(policies) - 1):
        assert {o[slot] for o in orders} == set(policies), slot


def test_trace_smoke_run(tmp_path):
    """The whole command on a tiny slice: kvtier deployment (one policy) and the baseline.
    Most of its time is four vLLM start-ups (two deployments of two workers)."""
    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "route", "--trace", str(SLICE),
                          "--json", "--model", "tiny", "--warmup-requests", "20", "--requests", "6", "--start", "4",
                          "--policies", "tier-aware", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(r["policies"]) == {"tier-aware"} and r["baseline"] is not None
    for row in (r["baseline"], r["policies"]["tier-aware"]):
        assert row["requests"] == r["requests"] and row["output_tokens_per_s"] > 0
        assert 0 <= row["cached_token_ratio"] <= 1 and row["ttft_p90_s"] >= row["ttft_p50_s"] > 0
        assert row["decision_p99_ms"] is not None and row["prefix_cache_reset"] is True
        # where the TTFTs went: the router's Server-Timing and the workers' vLLM histograms
        parts = row["ttft_parts_p50_ms"]
        assert 0 < parts["router"] < parts["upstream"] and row["worker_side"]["ttft_mean_s"] > 0
    rows = json.loads((tmp_path / "rows-tier-aware.json").read_text())
    assert len(rows) == r["requests"] and all(x["upstream_s"] <= x["ttft_s"] for x in rows)
    # the router keys the round's salted prompts as the workers' events do: it predicts hits
    # where the workers find them (the warm-up filled their caches)
    hits = [x for x in rows if x["cached_tokens"]]
    assert hits and all(x["predicted_cached_tokens"] is not None for x in rows)
    assert sum(x["predicted_cached_tokens"] for x in hits) > 0, rows
    assert set(r["targets"]) >= {"ttft_p50_half_of_baseline", "cached_1_5x_baseline"}
    # tier-aware against the baseline request by request, from the same rows as the rounds' quantiles
    paired = r["tier_aware_paired"]["baseline"]
    baseline_rows = json.loads((tmp_path / "rows-baseline.json").read_text())
    assert paired["p50"]["diff_s"] == round(float(np.quantile([x["ttft_s"] for x in rows], 0.5)
                                                  - np.quantile([x["ttft_s"] for x in baseline_rows], 0.5)), 4)
    assert set(r["tier_aware_paired"]) == {"baseline"} and paired["p90"]["resolved"] in ("lower", "higher", "no")
    lo, hi = paired["p50"]["ci95_s"]
    assert lo <= hi
    assert r["warmup_requests"] == 20 and r["shared_read_gbps_measured"] > 0
    # the uncounted priming replay ran before the first round, and the JSON names the order
    assert r["priming"] is True and r["priming_s"] > 0 and r["round_order"] == ["tier-aware"]
    # the default span: sized on the priming replay's prefill speed, the same for every round
    auto = r["auto_span"]
    assert auto["measured_in"] == "the priming replay" and auto["prefill_tokens_per_s"] > 0
    assert r["span_s"] == route_trace.auto_span(auto["nonreusable_tokens"], auto["prefill_tokens_per_s"]) > 0
    for rows_of in (rows, baseline_rows):   # the counted arrivals (two 3-s slots of the trace) spread over it
        sent = sorted(x["arrival_s"] for x in rows_of)
        assert sent[-1] - sent[0] == pytest.approx(r["span_s"], abs=0.25)
    assert any(tmp_path.glob("router-prime-*.log"))
