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
    warm, counted = vt.trace_window(str(SLICE), 40, 100, span_s=10.0, start=5)
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
    warm, counted = vt.trace_window(str(SLICE), 60, 300, span_s=10.0)
    short = vt.warmup_replay(warm, counted, cache_pages=capacity or 60)
    assert sum(r["tokens"] for r in short) < 0.5 * sum(r["tokens"] for r in warm)   # it is a shortcut
    assert _lru_hits(short, counted, capacity) == _lru_hits(warm, counted, capacity)
    assert vt.reusable_token_ratio(counted, short) == vt.reusable_token_ratio(counted, warm)
    # positive control: without the warm-up the window loses hits
    assert _lru_hits([], counted, None) < _lru_hits(warm, counted, None)
    assert vt.warmup_replay(warm, counted, 60, full=True) == warm


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
    warm, counted = vt.trace_window(str(SLICE), 60, 300, span_s=1.0)
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
