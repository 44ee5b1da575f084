"""prefix-lru's chain links stay cheap (s33 r2 D1, D2).

D1: a short run of blocks arriving leaf first under a long held chain (the disk receiving a turn's
new blocks as the host demotes them, the earlier turns already on disk) walked the whole chain
above it on each run's insert, under the disk tier's lock. D2: the map of which blocks name which
parent took a dict per parent, nearly doubling the policy's memory per held block."""

from __future__ import annotations

import random
import tracemalloc

from kvtier.policy.eviction import PrefixAwareLRUPolicy

from tests.policy.test_eviction import take

RUN = 3      # blocks per turn, arriving leaf first
TURNS = 50


class Touched:
    """A block key that counts how often the policy hashes or compares it: the policy's work,
    counted without a clock (the cores are shared)."""

    __slots__ = ("n",)
    touches = 0

    def __init__(self, n: int) -> None:
        self.n = n

    def __hash__(self) -> int:
        Touched.touches += 1
        return hash(self.n)

    def __eq__(self, other) -> bool:
        Touched.touches += 1
        return isinstance(other, Touched) and self.n == other.n


def work_per_turn(depth: int) -> float:
    """Key touches per turn of RUN blocks inserted leaf first below a held chain ``depth`` long."""
    p = PrefixAwareLRUPolicy()
    keys = [Touched(i) for i in range(depth + TURNS * RUN)]
    for i in range(depth):                   # the conversation so far, parents first
        p.on_insert(keys[i], keys[i - 1] if i else None)
    Touched.touches = 0
    for start in range(depth, depth + TURNS * RUN, RUN):
        for i in reversed(range(start, start + RUN)):
            p.on_insert(keys[i], keys[i - 1])
    return Touched.touches / TURNS


def test_a_run_arriving_leaf_first_costs_the_same_under_a_deep_chain_as_under_a_shallow_one():
    shallow, deep = work_per_turn(10), work_per_turn(5_000)
    assert deep <= 1.5 * shallow, f"{deep:.0f} key touches per turn at depth 5,000, {shallow:.0f} at depth 10"


def test_a_run_arriving_leaf_first_is_linked_to_the_chain_above_it():
    p = PrefixAwareLRUPolicy()
    keys = [Touched(i) for i in range(6)]
    for i in (0, 1, 2):
        p.on_insert(keys[i], keys[i - 1] if i else None)
    for i in (5, 4, 3):                      # the next turn, leaf first
        p.on_insert(keys[i], keys[i - 1])
    for key in keys:                         # read in order: the first block least recently used
        p.on_access(key)
    assert [key.n for key in take(p, 6)] == [5, 4, 3, 2, 1, 0]


def test_a_waiting_child_above_the_block_it_waits_for_stays_a_root():
    """k0 waits for k9, k1..k3 hang below k0; then k9 arrives naming k3 (records naming each other
    around a ring): k9 is linked below k3, and k0, its ancestor now, stays a root; every block can
    still be evicted, descendants first. The walk that finds it goes down k0's run, and up from k9."""
    p = PrefixAwareLRUPolicy()
    p.on_insert(Touched(0), Touched(9))
    for i in (1, 2, 3):
        p.on_insert(Touched(i), Touched(i - 1))
    p.on_insert(Touched(9), Touched(3))
    assert [key.n for key in take(p, 5)] == [9, 3, 2, 1, 0]
    assert len(p) == 0 and not p._named_parent and not p._named_by and not p._parent


def test_a_chain_takes_about_as_much_memory_per_block_as_before_the_reverse_map():
    """One 100k-block chain inserted parents first: before the reverse map (named parents) the
    policy took ~358 bytes per held block, with a dict per parent 686."""
    keys = [i.to_bytes(32, "big") for i in range(100_000)]
    tracemalloc.start()
    try:
        p = PrefixAwareLRUPolicy()
        for i, key in enumerate(keys):
            p.on_insert(key, keys[i - 1] if i else None)
        per_block = tracemalloc.get_traced_memory()[0] / len(keys)
    finally:
        tracemalloc.stop()
    assert per_block <= 450, f"{per_block:.0f} bytes per held block"


def check_integrity(p: PrefixAwareLRUPolicy) -> None:
    """The links and the names kept are those of the blocks held; no cycle; a leaf to evict."""
    held = set(p._last)
    assert set(p._parent) == held == set(p._children) == set(p._born)
    assert set(p._named_parent) <= held
    naming = {key: p._named(key) for key in held if p._named(key) is not None}
    filed = {}
    for parent, named in p._named_by.items():
        children = list(named) if type(named) is dict else [named]
        assert type(named) is not dict or len(named) >= 2, "a dict kept for one child"
        filed.update((child, parent) for child in children)
    assert filed == naming, "the reverse map is not the names held"
    counts = dict.fromkeys(held, 0)
    for key in held:
        if p._linked(key):
            assert p._parent[key][0] == naming[key], "linked to a parent it does not name"
            counts[p._parent[key][0]] += 1
    assert counts == p._children, "child counts"
    for key in held:
        above, seen = key, {key}
        while p._linked(above):
            above = p._parent[above][0]
            assert above not in seen, f"cycle through {key}"
            seen.add(above)
    if held:
        victim = next(p.victims(), None)
        assert victim is not None and p._children[victim] == 0


def test_random_inserts_removals_and_evictions_keep_the_policy_whole():
    for seed in range(150):
        rnd = random.Random(seed)
        p = PrefixAwareLRUPolicy()
        n = rnd.choice([5, 10, 30])
        for _ in range(400):
            op, key = rnd.random(), rnd.randrange(n)
            if op < 0.5:
                p.on_insert(key, rnd.choice([None, rnd.randrange(n)]))
            elif op < 0.7:
                p.on_remove(key)
            elif op < 0.8:
                p.on_access(key)
            elif (victim := next(p.victims(), None)) is not None:
                p.on_remove(victim)
            check_integrity(p)
