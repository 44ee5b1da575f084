"""LRU block caches and the replay sanity checks against the published figures."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.sim.cache import LRUBlockCache, hit_rate_curve, replay_prefix_hits, unique_blocks


def test_lru_evicts_least_recent_first_and_prefix_root_goes_first():
    cache = LRUBlockCache(3)
    cache.insert([1, 2, 3])     # a prompt: root 1 is the least recent of its blocks
    cache.insert([2])           # touched again
    cache.insert([4])
    assert 1 not in cache and {2, 3, 4} <= set(cache._blocks)
    cache.insert([5])
    assert 3 not in cache and 2 in cache
    assert cache.evictions == 2
    cache.check_integrity()


def test_prefix_length_stops_at_the_first_missing_block_and_does_not_touch():
    cache = LRUBlockCache(None)
    cache.insert([1, 2, 4])
    assert cache.prefix_length([1, 2, 3, 4]) == 2
    assert list(cache._blocks) == [1, 2, 4]


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


def test_unbounded_shared_cache_on_the_conversation_trace_hits_36_6_percent(conversation_trace):
    result = replay_prefix_hits(conversation_trace)
    assert result.block_hit_rate == pytest.approx(0.366, abs=0.0005)
    assert result.token_hit_rate == pytest.approx(0.374, abs=0.0005)
    assert 0.30 < result.block_hit_rate < 0.45  # the paper: "about 40 %"


def test_hit_rate_curve_is_monotone_and_ends_at_the_unbounded_figure(conversation_trace):
    curve = hit_rate_curve(conversation_trace, fractions=(0.02, 0.1, 0.4, 1.0))
    rates = [point.block_hit_rate for point in curve]
    assert all(a <= b for a, b in zip(rates, rates[1:]))
    assert rates[0] < rates[-1] - 0.1
    assert curve[-1].capacity_blocks == unique_blocks(conversation_trace)
    assert rates[-1] == replay_prefix_hits(conversation_trace).block_hit_rate
