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
        if key in self._last:
            self.on_access(key)
            return
        # Decided before the key is entered: a block named as its own parent (a caller's bug, or a
        # record on a shared mount) is a plain root, never its own child.
        linked = parent is not None and parent != key and parent in self._last
        self._last[key] = self._born[key] = next(self._tick)
        if linked:
            self._parent[key] = (parent, self._born[parent])
            self._children[parent] += 1
        else:
            self._parent[key] = None
        self._children[key] = 0
        self._push_if_leaf(key)

    def on_access(self, key: BlockKey) -> None:
        if key in self._last:
            self._last[key] = next(self._tick)
            self._push_if_leaf(key)

    def on_remove(self, key: BlockKey) -> None:
        if key not in self._last:
            return
        del self._last[key], self._born[key], self._children[key]
        link = self._parent.pop(key)
        # Children of a removed block (possible via delete()) become roots: their links
        # name this life of it, which no later insertion of the key has.
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
