"""LRU block caches and the replay sanity checks against the published figures."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.sim.cache import LRUBlockCache, hit_rate_curve, replay_prefix_hits, unique_blocks


def test_lru_evicts_least_recent_first_and_prefix_tail_goes_first():
    cache = LRUBlockCache(3)
    cache.insert([1, 2, 3])     # a prompt: its tail 3 is the least recent of its blocks (as vLLM frees them)
    cache.insert([2])           # touched again
    cache.insert([4])
    assert 3 not in cache and {1, 2, 4} <= set(cache._blocks)
    cache.insert([5])
    assert 1 not in cache and 2 in cache
    assert cache.evictions == 2
    cache.check_integrity()


def test_prefix_length_stops_at_the_first_missing_block_and_does_not_touch():
    cache = LRUBlockCache(None)
    cache.insert([1, 2, 4])
    assert cache.prefix_length([1, 2, 3, 4]) == 2
    assert list(cache._blocks) == [4, 2, 1]


def test_zero_capacity_holds_nothing_and_negative_is_rejected():
    cache = LRUBlockCache(0)
    cache.insert([1])
    assert len(cache) == 0
    with pytest.raises(ConfigError):
        LRUBlockCache(-1)


def test_replay_counts_prefix_hits_only(make_trace):
    trace = make_trace([(0, [1, 2, 3]), (1, [1, 2, 9]), (2, [7, 2, 3])])
    result = replay_prefix_hits(trace)
    # request 2 reuses 1,2; request 3 has a new root, so its cached 2,3 cannot be used
    assert (result.hit_blocks, result.total_blocks) == (2, 9)


def test_unbounded_shared_cache_hits_the_reference_figures(conversation_trace):
    """The published trace: 36.6 % of blocks (the paper: about 40 %); the shipped slice: its exact counts."""
    ref = conversation_trace
    result = replay_prefix_hits(ref.trace)
    if isinstance(ref.block_hits, tuple):
        assert (result.hit_blocks, result.total_blocks) == ref.block_hits
    assert result.block_hit_rate == pytest.approx(ref.rate(ref.block_hits), abs=0.0005)
    assert result.token_hit_rate == pytest.approx(ref.rate(ref.token_hits), abs=0.0005)
    if ref.origin == "published":
        assert 0.30 < result.block_hit_rate < 0.45  # the paper: "about 40 %"


def test_replay_agrees_with_a_plain_count_on_the_shipped_slice(shipped_trace):
    """An independent count: a block hits when it and every earlier block of its request were seen before."""
    seen: set[int] = set()
    hit_blocks = hit_tokens = 0
    for request in shipped_trace.trace.requests:
        counts = shipped_trace.trace.block_token_counts(request)
        prefix = True
        for block, tokens in zip(request.blocks, counts):
            prefix = prefix and block in seen
            hit_blocks += prefix
            hit_tokens += tokens * prefix
        seen.update(request.blocks)
    total_tokens = sum(r.input_tokens for r in shipped_trace.trace.requests)
    result = replay_prefix_hits(shipped_trace.trace)
    assert (hit_blocks, result.total_blocks) == shipped_trace.block_hits == (result.hit_blocks, result.total_blocks)
    assert (hit_tokens, total_tokens) == shipped_trace.token_hits
    assert result.token_hit_rate == pytest.approx(hit_tokens / total_tokens)


def test_hit_rate_curve_is_monotone_and_ends_at_the_unbounded_figure(conversation_trace):
    trace = conversation_trace.trace
    curve = hit_rate_curve(trace, fractions=(0.02, 0.1, 0.4, 1.0))
    rates = [point.block_hit_rate for point in curve]
    assert all(a <= b for a, b in zip(rates, rates[1:]))
    assert rates[0] < rates[-1] - 0.1
    assert curve[-1].capacity_blocks == unique_blocks(trace)
    assert rates[-1] == replay_prefix_hits(trace).block_hit_rate
