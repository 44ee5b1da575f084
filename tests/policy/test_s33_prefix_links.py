"""prefix-lru links a child to its parent whatever the order they arrive in (s33 a7 D1).

A tier below receives a chain as the tier above evicts it: leaves first. Before the fix a child
inserted while its parent was not held stayed a root for good, so after an ordinary read of the
chain (its blocks touched in order) the chain's first block was the least recently used "leaf"
and went first, stranding the rest (lookups are longest-prefix). The same for a child whose
parent was deleted and stored again, and for a held root inserted again naming a held parent."""

from __future__ import annotations

from kvtier.policy.eviction import PrefixAwareLRUPolicy

from tests.policy.test_eviction import take


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def read_in_order(p: PrefixAwareLRUPolicy, keys) -> None:
    for key in keys:
        p.on_access(key)


def test_a_chain_that_arrives_leaf_first_is_evicted_leaf_first():
    p = PrefixAwareLRUPolicy()
    for i in (3, 2, 1):                      # the order a demotion brings them in
        p.on_insert(k(i), k(i - 1))
    p.on_insert(k(0))
    read_in_order(p, [k(0), k(1), k(2), k(3)])
    p.on_insert(k(9))                        # a newer root
    assert take(p, 5) == [k(3), k(2), k(1), k(0), k(9)]


def test_a_parent_arriving_in_the_middle_links_both_sides():
    p = PrefixAwareLRUPolicy()
    p.on_insert(k(0))
    p.on_insert(k(2), k(1))                  # k1 not held yet
    p.on_insert(k(1), k(0))                  # links k2 under it, and itself under k0
    read_in_order(p, [k(0), k(1), k(2)])
    assert take(p, 3) == [k(2), k(1), k(0)]


def test_a_parent_deleted_and_stored_again_takes_its_children_back():
    p = PrefixAwareLRUPolicy()
    p.on_insert(k(0))
    p.on_insert(k(1), k(0))
    p.on_insert(k(2), k(1))
    p.on_remove(k(1))                        # deleted: k2 a root for now
    p.on_insert(k(1), k(0))                  # stored again: k2 is its child again
    p.on_access(k(2))
    assert take(p, 3) == [k(2), k(1), k(0)]


def test_a_held_root_inserted_again_naming_a_held_parent_is_linked():
    p = PrefixAwareLRUPolicy()
    p.on_insert(k(1))                        # first stored with no parent link
    p.on_insert(k(0))
    p.on_insert(k(1), k(0))                  # again, naming its parent
    assert take(p, 2) == [k(1), k(0)]


def test_records_that_name_each_other_around_a_ring_make_no_cycle():
    """k1 names k2, k2 names k3, k3 names k1: the last link that would close the ring is not made,
    and every block can still be evicted."""
    p = PrefixAwareLRUPolicy()
    p.on_insert(k(1), k(2))
    p.on_insert(k(2), k(3))
    p.on_insert(k(3), k(1))
    assert sorted(take(p, 3)) == sorted([k(1), k(2), k(3)])
    assert len(p) == 0


def test_a_held_root_inserted_again_under_its_own_descendant_stays_a_root():
    p = PrefixAwareLRUPolicy()
    p.on_insert(k(0))
    p.on_insert(k(1), k(0))
    p.on_insert(k(0), k(1))                  # would make k0 and k1 each other's parent
    assert take(p, 2) == [k(1), k(0)]


def test_waiting_links_go_with_their_blocks():
    """Children naming parents never stored leave no trace once they are removed: the policy's
    memory follows the blocks it holds."""
    p = PrefixAwareLRUPolicy()
    for i in range(1000):
        p.on_insert(k(i), k(10_000 + i))     # parents never held
    assert len(take(p, 1000)) == 1000
    assert len(p) == 0
    assert not p._named_parent and not p._named_by and not p._parent and not p._children
