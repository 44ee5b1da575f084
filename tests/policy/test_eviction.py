"""Eviction order is a contract: these tests pin it exactly."""

import pytest

from kvtier.policy.eviction import LRUPolicy, PrefixAwareLRUPolicy, make_policy


def take(policy, n):
    """Evict n victims the way a tier does: on_remove each as it is taken."""
    out = []
    for key in policy.victims():
        out.append(key)
        policy.on_remove(key)
        if len(out) == n:
            break
    return out


def test_lru_order_follows_access():
    p = LRUPolicy()
    for k in "abcd":
        p.on_insert(k)
    p.on_access("a")
    assert take(p, 4) == ["b", "c", "d", "a"]


def test_lru_stops_when_every_candidate_was_skipped():
    p = LRUPolicy()
    for k in "ab":
        p.on_insert(k)
    seen = []
    for key in p.victims():  # the tier skips both (pinned): touches them
        seen.append(key)
        p.on_access(key)
    assert seen == ["a", "b"]


def test_prefix_aware_evicts_descendants_before_ancestors():
    p = PrefixAwareLRUPolicy()
    # chain a <- b <- c, and another chain x <- y; a is the oldest.
    p.on_insert("a")
    p.on_insert("b", "a")
    p.on_insert("c", "b")
    p.on_insert("x")
    p.on_insert("y", "x")
    p.on_access("a")  # touching an ancestor does not make it a victim before its children
    assert take(p, 5) == ["c", "b", "y", "x", "a"]


def test_prefix_aware_branching_tree():
    p = PrefixAwareLRUPolicy()
    p.on_insert("root")
    p.on_insert("l1", "root")
    p.on_insert("r1", "root")
    p.on_insert("l2", "l1")
    assert take(p, 1) == ["r1"]  # oldest leaf
    assert take(p, 3) == ["l2", "l1", "root"]


def test_prefix_aware_skip_then_continue():
    p = PrefixAwareLRUPolicy()
    p.on_insert("a")
    p.on_insert("b", "a")
    p.on_insert("z")
    gen = p.victims()
    first = next(gen)
    assert first == "b"
    p.on_access("b")  # pinned: skipped
    assert next(gen) == "z"


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="choose one of"):
        make_policy("mru")
