"""The trace benches' window: a contiguous stretch, its warm-up, the exact reuse bound, and the
warm-up shortcut that must leave every cache as the whole stretch would."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest

from kvtier.bench import vllm_trace as vt

SLICE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head500.jsonl"
B = vt.HASH_TOKENS


def _req(blocks, tokens=None):
    return {"blocks": list(blocks), "tokens": tokens if tokens is not None else len(blocks) * B, "max_tokens": 1}


def test_window_is_contiguous_warm_up_first_and_compressed():
    warm, counted, _ = vt.trace_window(str(SLICE), 40, 100, span_s=10.0, start=5)
    lines = [line for line in SLICE.read_text().splitlines() if line.strip()]
    assert len(warm) == 100 and len(counted) == 40
    # the 105th request of the file (sorted by time; the head slice is in time order) opens the window
    import json

    assert counted[0]["blocks"] == json.loads(lines[105])["hash_ids"][: vt.MAX_BLOCKS]
    assert counted[0]["arrival_s"] == 0.0 and counted[-1]["arrival_s"] == pytest.approx(10.0)
    assert all(r["arrival_s"] == 0.0 and r["max_tokens"] == 1 for r in warm)
    # what the warm-up saw counts: the bound with it is above the bound without it
    assert vt.reusable_token_ratio(counted, warm) > vt.reusable_token_ratio(counted) >= 0
    with pytest.raises(SystemExit, match="fewer than"):
        vt.trace_window(str(SLICE), 400, 200, span_s=1.0)


def test_reusable_bound_counts_as_vllm_does():
    # a prompt of exactly two whole blocks can hit only one: vLLM computes the last token
    assert vt.reusable_token_ratio([_req([1, 2]), _req([1, 2])]) == pytest.approx(B / (4 * B))
    # a partial last block of an earlier prompt was never cached, though its id was seen
    assert vt.reusable_token_ratio([_req([1, 2], tokens=B + 5), _req([1, 2, 3])]) == pytest.approx(B / (B + 5 + 3 * B))
    # the warm-up's blocks count; its tokens do not
    assert vt.reusable_token_ratio([_req([1, 2, 3])], warmup=[_req([1, 2])]) == pytest.approx(2 * B / (3 * B))


def _lru_hits(sent: list[dict], counted: list[dict], capacity: int | None) -> int:
    """Tokens a prefix cache of ``capacity`` blocks (None: unbounded), LRU, hits in ``counted``."""
    cache: OrderedDict = OrderedDict()
    hits = 0
    for k, r in enumerate(sent + counted):
        got = 0
        for b in r["blocks"][: vt.cacheable_blocks(r["tokens"])]:
            if b not in cache:
                break
            got += 1
        if k >= len(sent):
            hits += got * B
        for b in r["blocks"][: r["tokens"] // B]:
            cache[b] = True
            cache.move_to_end(b)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return hits


@pytest.mark.parametrize("capacity", [None, 60, 150])
def test_warm_up_shortcut_leaves_the_same_hits_as_the_whole_stretch(capacity):
    warm, counted, _ = vt.trace_window(str(SLICE), 60, 300, span_s=10.0)
    short = vt.warmup_replay(warm, counted, cache_pages=capacity or 60)
    assert sum(r["tokens"] for r in short) < 0.5 * sum(r["tokens"] for r in warm)   # it is a shortcut
    assert _lru_hits(short, counted, capacity) == _lru_hits(warm, counted, capacity)
    assert vt.reusable_token_ratio(counted, short) == vt.reusable_token_ratio(counted, warm)
    # positive control: without the warm-up the window loses hits
    assert _lru_hits([], counted, None) < _lru_hits(warm, counted, None)
    assert vt.warmup_replay(warm, counted, 60, full=True) == warm


def test_s29_d2_the_shortcut_s_tail_holds_2x_cache_pages_distinct_blocks():
    """The tail was grown to 2 x cache_pages blocks counted with repeats: a tail of one prompt
    sent again (a shared system prompt) held 2 distinct blocks of a 4-page cache, so the older
    requests still decided what it kept; the shortcut dropped them and a window block the whole
    stretch evicts stayed cached (vLLM alone given hits it would not have)."""
    warm = [_req([1, 2, 3], 3 * B + 1),   # the window hits its first block...
            _req([7, 8], 2 * B + 1),      # ...which these, dropped by the shortcut, push out
            *[_req([5, 6], 2 * B + 1)] * 4]   # 8 blocks counted (2 x 4 pages), 2 distinct
    counted = [_req([1, 9], 2 * B + 1)]
    short = vt.warmup_replay(warm, counted, cache_pages=4)
    assert _lru_hits(warm, counted, 4) == 0
    assert _lru_hits(short, counted, 4) == 0   # was 32 tokens
    # the tail starts where it holds 2 x cache_pages distinct blocks: with 2 pages, at [7, 8]
    # (the four [5, 6] hold 2); the request before it is cut to what the window can hit
    short = vt.warmup_replay(warm, counted, cache_pages=2)
    assert [r["blocks"] for r in short[:2]] == [[1, 2], [7, 8]] and short[2:] == warm[2:]
    assert _lru_hits(short, counted, 2) == _lru_hits(warm, counted, 2)


def test_the_gap_to_the_bound_is_counted_request_by_request():
    bound = vt.reusable_tokens([_req([1, 2, 3]), _req([1, 2, 3, 4]), _req([1, 5])])
    assert bound == [0, 3 * B, B]
    assert vt.against_bound([0, 3 * B, B], bound) == {"requests_below": 0, "tokens_below": 0,
                                                      "requests_above": 0, "tokens_above": 0}
    assert vt.against_bound([0, 2 * B, 2 * B], bound) == {"requests_below": 1, "tokens_below": B,
                                                          "requests_above": 1, "tokens_above": B}


def _row(arrival, first, finish, out, prompt=64, cached=32):
    return {"arrival_s": arrival, "first_token_s": first, "finish_s": finish, "output_tokens": out,
            "prompt_tokens": prompt, "cached_tokens": cached}


def test_metrics_count_the_drain_and_the_cpu_of_helper_processes():
    reply = {"requests": [_row(0.0, 0.5, 1.0, 10), _row(2.0, 2.5, 5.0, 30)], "cpu_s": 4.0}
    m = vt.metrics(reply)
    assert m["makespan_s"] == 5.0 and m["after_last_arrival_s"] == 3.0
    assert m["output_tokens_per_s"] == 8.0 and m["cached_token_ratio"] == 0.5
    assert m["cpu_ms_per_output_token"] == 100.0
    # a peer whose work runs partly in a server process pays for that process's CPU too
    assert vt.metrics(reply, helper_cpu_s=4.0)["cpu_ms_per_output_token"] == 200.0
    assert "cpu_ms_per_output_token" not in vt.metrics({"requests": reply["requests"]})


def test_the_auto_span_leaves_an_engine_that_hits_every_reusable_token_busy_to_the_end():
    """The default span is sized on the machine: the longest over which a fluid engine computing
    only the window's non-reusable tokens, at the warm-up's prefill speed, idles at most
    IDLE_SHARE of its work. Control: at twice the span (what a fixed span is on a machine twice
    as fast) the same engine idles far more, and tokens/s would be the offered load."""
    warm, counted, _ = vt.trace_window(str(SLICE), 60, 300, span_s=1.0)
    unit = [r["arrival_s"] for r in counted]
    work = [r["tokens"] - b for r, b in zip(counted, vt.reusable_tokens(counted, warm))]
    speed = 10_000.0
    busy = sum(work) / speed
    span = vt.auto_span(unit, work, speed)
    assert 0 < span < busy
    assert vt.ideal_idle_s([a * span for a in unit], work, speed) <= vt.IDLE_SHARE * busy
    assert vt.ideal_idle_s([a * (span + 0.05) for a in unit], work, speed) > vt.IDLE_SHARE * busy  # the longest
    assert vt.ideal_idle_s([a * 2 * span for a in unit], work, speed) > 3 * vt.IDLE_SHARE * busy  # control
    assert vt.auto_span(unit, work, 2 * speed) < span  # a faster machine gets a shorter span
    with pytest.raises(ValueError, match="no prefill speed"):
        vt.auto_span(unit, work, 0.0)


def test_the_warm_up_speed_counts_computed_tokens_only():
    reply = {"requests": [_row(0.0, 0.5, 1.0, 1, prompt=640, cached=128), _row(0.0, 0.9, 1.0, 1, prompt=400, cached=0)],
             "seconds": 2.0}
    assert vt.warmup_prefill_speed(reply) == (512 + 400) / 2.0


def test_metrics_report_the_engine_idle_time():
    reply = {"requests": [_row(0.0, 0.5, 1.0, 10)], "idle_s": 0.25}
    assert vt.metrics(reply)["engine_idle_s"] == 0.25
    assert "engine_idle_s" not in vt.metrics({"requests": reply["requests"]})


# -- audit s28: the trace benches on traces they were not built on ----------------------------------
import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402

from kvtier.errors import ConfigError  # noqa: E402


class _ModelBuilt(Exception):
    """Raised where the bench would build its model: the trace was read and its window cut."""


@pytest.fixture
def stop_at_the_model(monkeypatch):
    """The benches up to the model build, no engine: ``ensure_model`` raises :class:`_ModelBuilt`."""
    import kvtier.integrations.transformers.models as models

    def stop(*_a, **_k):
        raise _ModelBuilt

    monkeypatch.setattr(models, "ensure_model", stop)


def _bench_args(*argv):
    """``argv`` parsed by the CLI's own ``kvtier bench`` parser."""
    from kvtier.cli import bench

    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def _rows(n):
    return [json.loads(line) for line in SLICE.read_text().splitlines()[:n]]


def _trace_of_16_token_blocks(tmp_path, n=12):
    """The slice's first ``n`` requests with 16-token blocks (the same ids, lengths to fit)."""
    rows = [dict(r, input_length=len(r["hash_ids"]) * 16 - 3) for r in _rows(n)]
    path = tmp_path / "b16.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_s28_d3_a_trace_of_another_block_size_replays_with_trace_block_tokens(tmp_path):
    """bench vllm --trace had TRACE_BLOCK_TOKENS = 512 hard-coded: a 16-token trace could not be
    replayed at all. With --trace-block-tokens each trace block is still one page."""
    path = _trace_of_16_token_blocks(tmp_path)
    with pytest.raises(ConfigError, match=r"with 512-token blocks expect .*--trace-block-tokens"):
        vt.trace_window(str(path), 4, 2, span_s=1.0)
    window = vt.trace_window(str(path), 4, 2, span_s=1.0, block_tokens=16)
    for r in window.warm + window.counted:
        assert math.ceil(r["tokens"] / B) == len(r["blocks"])   # one page per trace block, the last partial
        assert r["tokens"] == len(r["blocks"]) * B - 6          # 3 of 16 tokens short, scaled x2


def test_s28_d3_the_512_token_scaling_is_unchanged():
    """The generalised scaling gives the 512-token trace what the integer one (scale 16) gave."""
    from kvtier.sim.trace import load_trace

    counted = vt.trace_window(str(SLICE), 40, 100, span_s=10.0)[1]
    reqs = load_trace(SLICE).requests[100:140]
    assert [r["tokens"] for r in counted] == [min(min(len(q.blocks), vt.MAX_BLOCKS) * B,
                                                         math.ceil(q.input_tokens / 16)) for q in reqs]
    assert [r["max_tokens"] for r in counted] == [min(vt.MAX_OUTPUT, max(1, q.output_tokens // 16))
                                                         for q in reqs]


@pytest.mark.parametrize("bench", ["vllm", "route"])
def test_s28_d3_both_benches_take_the_trace_block_size(tmp_path, stop_at_the_model, bench):
    """bench route --trace accepted --block-tokens (its --synthetic flag), ignored it and refused
    the 16-token trace anyway; bench vllm had no way to say it."""
    path = str(_trace_of_16_token_blocks(tmp_path))
    common = ["--trace", path, "--warmup-requests", "2", "--requests", "4"]
    extra = ["--policies", "round-robin"] if bench == "route" else []
    args = _bench_args(bench, *common, *extra)
    with pytest.raises(ConfigError, match="--trace-block-tokens"):
        args.func(args)   # 512-token blocks, the default: refused, naming the flag that fixes it
    args = _bench_args(bench, *common, *extra, "--trace-block-tokens", "16")
    with pytest.raises(_ModelBuilt):
        args.func(args)   # read as 16-token blocks: on to the model
    if bench == "route":   # the flag it ignored is refused with --trace, naming the right one
        args = _bench_args(bench, *common, *extra, "--block-tokens", "16")
        with pytest.raises(ConfigError, match="--block-tokens is --synthetic's.*--trace-block-tokens"):
            args.func(args)


def test_s28_d4_a_window_of_one_timestamp_is_spread_over_the_span_and_says_so():
    """The slice's first 5 requests share timestamp 0: the counted arrivals all came out at 0 s
    (squeeze 0) while the JSON reported span_s (or an auto span bisected on no spread)."""
    counted = vt.trace_window(str(SLICE), 4, 1, span_s=10.0, start=0)[1]
    assert [r["arrival_s"] for r in counted] == [0.0, 3.3333, 6.6667, 10.0]   # rounded as ever (was 0, 0, 0, 0)
    window = vt.trace_window(str(SLICE), 4, 1, span_s=10.0, start=0)
    facts = vt.window_facts(window, window.warm, 10.0, vt.TRACE_BLOCK_TOKENS)
    assert facts["arrivals"].startswith("spread evenly over span_s: the window's 4 counted requests share one")
    # the control: a window with spread keeps the trace's gaps, and says that
    spread = vt.trace_window(str(SLICE), 40, 100, span_s=10.0, start=5)
    assert spread.arrivals == "the trace's gaps, compressed to span_s"
    # and the auto span sizes on the spread arrivals (not the 2 x busy + 1 of arrivals all at 0)
    work = [r["tokens"] for r in window.counted]
    busy = sum(work) / 1000.0
    assert vt.auto_span([r["arrival_s"] / 10 for r in window.counted], work, 1000.0) < busy


def test_s28_d5_requests_0_is_refused_not_replaced_by_256(tmp_path, stop_at_the_model):
    """`args.requests or TRACE_REQUESTS` turned an explicit 0 into 256: on a short trace the error
    named a --requests 256 never given, on a long one 256 requests were replayed."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(20)))
    args = _bench_args("vllm", "--trace", str(path), "--requests", "0", "--warmup-requests", "2")
    with pytest.raises(SystemExit, match="--requests must be > 0"):
        args.func(args)
    args = _bench_args("vllm", "--trace", str(path), "--warmup-requests", "2")   # not given: the default
    with pytest.raises(SystemExit, match=f"--requests {vt.TRACE_REQUESTS}"):
        args.func(args)


@pytest.mark.parametrize("flag, value", [("--model", "deepseek"), ("--block-tokens", "64"),
                                         ("--stores", "host,remote,mooncake"), ("--tokens", "512"),
                                         ("--runs", "1"), ("--gen-tokens", "2")])
def test_s29_d5_bench_vllm_trace_refuses_the_flags_of_the_run_without_it(tmp_path, stop_at_the_model, flag, value):
    """--trace took the TTFT bench's flags and ignored them: --model deepseek (latent attention)
    replayed on --trace-model's Llama, --block-tokens 64 on 32-token pages, --stores mooncake as
    host + disk. Refused now, naming the flags --trace does read."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(20)))
    common = ["--trace", str(path), "--requests", "4", "--warmup-requests", "2"]
    args = _bench_args("vllm", *common, flag, value)
    with pytest.raises(ConfigError, match=rf"^{flag} is for the run without --trace: .*--trace-model.*"
                                          "--trace-block-tokens"):
        args.func(args)
    args = _bench_args("vllm", *common, "--model", "tiny", "--block-tokens", "64")
    with pytest.raises(ConfigError, match="^--model and --block-tokens are for the run without --trace"):
        args.func(args)
    args = _bench_args("vllm", *common, "--trace-model", "tiny")   # control: the trace's own flags run on
    with pytest.raises(_ModelBuilt):
        args.func(args)


def test_s29_d5_bench_vllm_without_trace_keeps_its_defaults(stop_at_the_model):
    """The flags default to None so that --trace can tell one given: the run without --trace
    fills in the defaults it always had."""
    args = _bench_args("vllm")
    with pytest.raises((_ModelBuilt, SystemExit)):   # SystemExit: no vLLM on this machine
        args.func(args)
    assert (args.tokens, args.runs, args.gen_tokens, args.model, args.block_tokens, args.stores) == (
        4096, 3, 4, "demo", 256, "host,remote")
    args = _bench_args("vllm", "--model", "tiny", "--tokens", "1024", "--block-tokens", "128")
    with pytest.raises((_ModelBuilt, SystemExit)):
        args.func(args)
    assert (args.tokens, args.model, args.block_tokens, args.runs) == (1024, "tiny", 128, 3)
