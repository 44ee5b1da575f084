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
    a heap ordered by last access; stale heap entries are skipped lazily.
    """

    name = "prefix-lru"

    def __init__(self) -> None:
        self._tick = itertools.count()
        self._last: dict[BlockKey, int] = {}
        self._parent: dict[BlockKey, BlockKey | None] = {}
        self._children: dict[BlockKey, int] = {}
        self._heap: list[tuple[int, BlockKey]] = []

    def _push_if_leaf(self, key: BlockKey) -> None:
        if self._children.get(key, 0) == 0 and key in self._last:
            heapq.heappush(self._heap, (self._last[key], key))

    def on_insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        if key in self._last:
            self.on_access(key)
            return
        self._last[key] = next(self._tick)
        known_parent = parent if parent in self._last else None
        self._parent[key] = known_parent
        self._children.setdefault(key, 0)
        if known_parent is not None:
            self._children[known_parent] += 1
        self._push_if_leaf(key)

    def on_access(self, key: BlockKey) -> None:
        if key in self._last:
            self._last[key] = next(self._tick)
            self._push_if_leaf(key)

    def on_remove(self, key: BlockKey) -> None:
        if key not in self._last:
            return
        del self._last[key]
        parent = self._parent.pop(key, None)
        self._children.pop(key, None)
        if parent is not None and parent in self._children:
            self._children[parent] -= 1
            self._push_if_leaf(parent)
        # Children of a removed block (possible via delete()) become roots.
        # They keep their stale parent link; on_remove of them tolerates it.

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


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
