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
        # The parent each held block names, so that a parent inserted after its children (or
        # again, after a delete) links them. A link holds the name (it stays when the link goes
        # stale): _named_parent keeps only the names no link of the block holds (it waits for a
        # parent not held, or a link would close a cycle). _named_by is the reverse: a parent's one
        # child itself, a dict only from a second on (a dict or an entry more per block would
        # nearly double the policy's memory). Entries go with their blocks: memory follows the
        # blocks held.
        self._named_parent: dict[BlockKey, BlockKey] = {}
        self._named_by: dict[BlockKey, BlockKey | dict[BlockKey, None]] = {}

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
            self._insert_again(key, parent)
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

    def _insert_again(self, key: BlockKey, parent: BlockKey | None) -> None:
        """A held block stored again: an access, and a root now naming a held parent is linked
        to it (unless that closes a cycle)."""
        self.on_access(key)
        if parent is not None and not self._linked(key):
            self._name_parent(key, parent)
            if parent in self._last and not self._closes_cycle(key, parent):
                self._link(key, parent)

    def _linked(self, key: BlockKey) -> bool:
        """Whether ``key`` is a child of its parent's current life here (not a root)."""
        link = self._parent[key]
        return link is not None and self._born.get(link[0]) == link[1]

    def _link(self, child: BlockKey, parent: BlockKey) -> None:
        self._parent[child] = (parent, self._born[parent])
        self._children[parent] += 1
        self._named_parent.pop(child, None)  # (the link holds the name now)

    def _named(self, key: BlockKey) -> BlockKey | None:
        """The parent ``key`` names (linked to it or not), or None."""
        name = self._named_parent.get(key)
        if name is None and (link := self._parent[key]) is not None:
            name = link[0]
        return name

    def _closes_cycle(self, child: BlockKey, parent: BlockKey) -> bool:
        """Whether ``parent`` is ``child`` or below it: linking them would close a cycle. Steps up
        from ``parent`` and down ``child``'s subtree in turn and stops when either walk ends, so it
        costs about the smaller of the two: a short run arriving leaf first under a long held
        chain walks the run, not the chain (tiers call this under their lock)."""
        for above, below in zip(self._line_up(parent), self._subtree(child)):
            if above == child or below == parent:
                return True
        return False

    def _line_up(self, key: BlockKey) -> Iterator[BlockKey]:
        """``key``, then the blocks above it through current links."""
        yield key
        link = self._parent[key]
        while link is not None and self._born.get(link[0]) == link[1]:
            key = link[0]
            yield key
            link = self._parent[key]

    def _subtree(self, root: BlockKey) -> Iterator[BlockKey]:
        """``root``, then the blocks below it through current links."""
        pending = [root]
        while pending:
            key = pending.pop()
            yield key
            life = self._born[key]  # (birth ticks are never reused: a link holding it is to this life)
            for child in self._naming(key):
                link = self._parent[child]
                if link is not None and link[1] == life:
                    pending.append(child)

    def _naming(self, parent: BlockKey) -> dict[BlockKey, None] | tuple[BlockKey, ...]:
        """The held blocks that name ``parent`` (linked to it or not)."""
        named = self._named_by.get(parent)  # (None: keys are never None)
        if named is None:
            return ()
        return named if type(named) is dict else (named,)  # (a dict is never a key: unhashable)

    def _name_parent(self, key: BlockKey, parent: BlockKey) -> None:
        self._forget_named_parent(key)
        self._named_parent[key] = parent
        if parent not in self._named_by:
            self._named_by[parent] = key
        elif type(named := self._named_by[parent]) is dict:
            named[key] = None
        else:
            self._named_by[parent] = {named: None, key: None}

    def _forget_named_parent(self, key: BlockKey) -> None:
        parent = self._named(key)
        if parent is None:
            return
        self._named_parent.pop(key, None)
        named = self._named_by[parent]
        if type(named) is not dict:  # (``key`` itself)
            del self._named_by[parent]
            return
        del named[key]
        if len(named) == 1:
            self._named_by[parent] = next(iter(named))

    def _adopt_waiting_children(self, key: BlockKey) -> None:
        """Link the held blocks that name ``key`` (just inserted) as their parent; each is a root (it
        came first, or its link names an earlier life of ``key``). One that is an ancestor of ``key``
        stays a root: the link would close a cycle."""
        for child in self._naming(key):
            if self._children[child] and self._closes_cycle(child, key):  # (a leaf is no one's ancestor)
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
