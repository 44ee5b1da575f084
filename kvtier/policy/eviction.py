"""Eviction policies: which block a full tier should drop next.

A policy only *orders* keys; the tier (the mechanism) owns memory, skips pinned
blocks and frees space. The tier reports every change through ``on_insert`` /
``on_access`` / ``on_remove`` and asks for candidates with ``victims()``, a
generator it may stop at any time. Policies are not thread safe: tiers call
them under their own lock.

The eviction order is a contract and tests pin it.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator

from kvtier.core.keys import BlockKey
from kvtier.errors import ConfigError


class EvictionPolicy(ABC):
    name: str = "policy"

    @abstractmethod
    def on_insert(self, key: BlockKey, parent: BlockKey | None = None) -> None: ...

    @abstractmethod
    def on_access(self, key: BlockKey) -> None: ...

    @abstractmethod
    def on_remove(self, key: BlockKey) -> None: ...

    @abstractmethod
    def victims(self) -> Iterator[BlockKey]:
        """Candidates in eviction order. The caller calls ``on_remove`` (evicted)
        or ``on_access`` (skipped, e.g. pinned) for each before taking the next."""

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def on_insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: BlockKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[BlockKey]:
        # Re-read the front each time: the caller mutates the order between steps.
        seen: set[BlockKey] = set()
        while self._order:
            key = next(iter(self._order))
            if key in seen:  # every remaining key was skipped once: nothing evictable
                return
            seen.add(key)
            yield key

    def __len__(self) -> int:
        return len(self._order)


class PrefixAwareLRUPolicy(EvictionPolicy):
    """LRU among leaves: a block is evicted only after all its descendants here.

    A block without its ancestors is useless (lookups are longest-prefix), so
    dropping a parent first would strand its whole subtree. Leaves are kept in
    a heap ordered by last access; stale heap entries are skipped lazily, and the
    heap is rebuilt from the live leaves once stale entries outnumber them, so its
    size follows the blocks held, not the hits they took.

    Blocks may arrive children first (a tier below receives a chain as the tier above
    evicts it: leaves first). A child whose parent is not here is a root until the parent
    arrives, then it is linked to it; so is a child whose parent was removed (deleted) and
    stored again, and a held root that is inserted again naming a parent held here. No
    link closes a cycle (records that name each other as parents): such a child stays a root.
    """

    name = "prefix-lru"

    def __init__(self) -> None:
        self._tick = itertools.count()
        self._last: dict[BlockKey, int] = {}
        self._born: dict[BlockKey, int] = {}      # tick of the key's current insertion
        # (parent, the parent's birth tick) or None: a link to an earlier life of the parent
        # (removed, then stored again) is stale and must not touch the new one's count.
        self._parent: dict[BlockKey, tuple[BlockKey, int] | None] = {}
        self._children: dict[BlockKey, int] = {}
        self._heap: list[tuple[int, BlockKey]] = []
        # The parent each held block names, and the reverse, so that a parent inserted after its
        # children (or again, after a delete) links them. One entry per held block that names
        # a parent: an entry goes with its block, so memory follows the blocks held.
        self._named_parent: dict[BlockKey, BlockKey] = {}
        self._named_by: dict[BlockKey, dict[BlockKey, None]] = {}

    def _push_if_leaf(self, key: BlockKey) -> None:
        if self._children.get(key, 0) == 0 and key in self._last:
            heapq.heappush(self._heap, (self._last[key], key))
            if len(self._heap) > 2 * len(self._last) + 64:
                self._compact()

    def _compact(self) -> None:
        """Keep one entry per live leaf. O(n), after at least n pushes since the last one."""
        self._heap = [(t, k) for k, t in self._last.items() if self._children[k] == 0]
        heapq.heapify(self._heap)

    def on_insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        if parent == key:
            parent = None  # (a caller's bug, or a record on a shared mount): a plain root, never its own child
        if key in self._last:
            self.on_access(key)
            if parent is not None and not self._linked(key):
                self._name_parent(key, parent)
                if parent in self._last and key not in self._ancestors(parent):
                    self._link(key, parent)
            return
        self._last[key] = self._born[key] = next(self._tick)
        self._parent[key] = None
        self._children[key] = 0
        if parent is not None:
            self._name_parent(key, parent)
            if parent in self._last:
                self._link(key, parent)  # (a new block has no descendants: no cycle)
        self._adopt_waiting_children(key)
        self._push_if_leaf(key)

    def _linked(self, key: BlockKey) -> bool:
        """Whether ``key`` is a child of its parent's current life here (not a root)."""
        link = self._parent[key]
        return link is not None and self._born.get(link[0]) == link[1]

    def _link(self, child: BlockKey, parent: BlockKey) -> None:
        self._parent[child] = (parent, self._born[parent])
        self._children[parent] += 1

    def _ancestors(self, key: BlockKey) -> set[BlockKey]:
        """The blocks above ``key`` through current links, O(depth)."""
        found: set[BlockKey] = set()
        link = self._parent[key]
        while link is not None and self._born.get(link[0]) == link[1] and link[0] not in found:
            found.add(link[0])
            link = self._parent[link[0]]
        return found

    def _name_parent(self, key: BlockKey, parent: BlockKey) -> None:
        self._forget_named_parent(key)
        self._named_parent[key] = parent
        self._named_by.setdefault(parent, {})[key] = None

    def _forget_named_parent(self, key: BlockKey) -> None:
        parent = self._named_parent.pop(key, None)
        if parent is not None:
            children = self._named_by[parent]
            del children[key]
            if not children:
                del self._named_by[parent]

    def _adopt_waiting_children(self, key: BlockKey) -> None:
        """Link the held blocks that name ``key`` (just inserted) as their parent and are roots
        (they came first, or their link names an earlier life of it), unless one is an ancestor
        of ``key``: the link would close a cycle."""
        ancestors: set[BlockKey] | None = None
        for child in self._named_by.get(key, ()):
            if self._linked(child):
                continue
            if self._children[child]:  # only a block with descendants can be an ancestor
                ancestors = self._ancestors(key) if ancestors is None else ancestors
                if child in ancestors:
                    continue
            self._link(child, key)

    def on_access(self, key: BlockKey) -> None:
        if key in self._last:
            self._last[key] = next(self._tick)
            self._push_if_leaf(key)

    def on_remove(self, key: BlockKey) -> None:
        if key not in self._last:
            return
        del self._last[key], self._born[key], self._children[key]
        self._forget_named_parent(key)  # (blocks naming it stay named: its next life links them)
        link = self._parent.pop(key)
        # Children of a removed block (possible via delete()) become roots: their links
        # name this life of it, which no later insertion of the key has (that one links them anew).
        if link is not None and self._born.get(link[0]) == link[1]:
            self._children[link[0]] -= 1
            self._push_if_leaf(link[0])

    def victims(self) -> Iterator[BlockKey]:
        skipped: set[BlockKey] = set()
        while self._heap:
            tick, key = self._heap[0]
            if self._last.get(key) != tick or self._children.get(key, 0) != 0:
                heapq.heappop(self._heap)  # stale entry
                continue
            if key in skipped:
                return
            skipped.add(key)
            yield key

    def __len__(self) -> int:
        return len(self._last)


POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    PrefixAwareLRUPolicy.name: PrefixAwareLRUPolicy,
}


def check_policy_name(name) -> None:
    """Raise :class:`~kvtier.errors.ConfigError` unless ``name`` is a policy of :data:`POLICIES`."""
    if not isinstance(name, str) or name not in POLICIES:
        raise ConfigError(f"eviction={name!r}; choose one of {sorted(POLICIES)}")


def make_policy(name: str) -> EvictionPolicy:
    check_policy_name(name)
    return POLICIES[name]()
