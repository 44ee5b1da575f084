"""NamespaceOrder: one namespace's blocks in the order they were added, pageable after a cursor.

``LIST`` used to copy a whole namespace for every page and slice it at an
offset: O(namespace) per page, under the index lock, on the event loop. Here a
page starts after an opaque *cursor* (the position number of the last block
the previous page looked at) and costs O(page):

* every block gets a position number when it is added (increasing, never
  reused), kept in two parallel append-only lists, so a cursor is found by
  bisection even after the block it named was deleted. Positions are the
  namespace's own (:meth:`append`: one more than the last), from a first one
  its index picks (a clock: see :class:`~kvtier.server.index.BlockIndex`): a
  cursor counts only this namespace's blocks, never other namespaces' or
  tenants' (numbered from one server-wide counter, the gap between two cursors
  counted every other tenant's writes in between);
* a deletion leaves a tombstone in the lists (O(log n) to find it); tombstones
  at the front -- quota and TTL delete the oldest blocks first -- are skipped
  for good at once, and the lists are compacted when tombstones outnumber live
  blocks, so there are never more than twice as many slots as blocks
  (amortised O(1) per deletion);
* a page looks at no more than ``limit`` + :data:`MAX_SKIP` slots, so a run
  of tombstones makes a page shorter (its cursor says where to go on), never
  slower.

A block present for a whole listing is listed exactly once; blocks added
meanwhile come after the ones already listed.

The cursor contract: a cursor never makes a block unreachable; across a
restart it may list blocks again (duplicates), never skip them. Within a run
every cursor handed out is below the namespace's next position (a namespace
emptied and filled again starts after it: its index's clock), so a cursor at
or past it is from another run (a server whose clock was behind the previous
run's) and pages from the start (:meth:`page`); a server with a state
directory also numbers after every cursor an earlier run handed out (its
persisted high-water mark, :class:`~kvtier.server.index.BlockIndex`). Not thread safe: the
:class:`~kvtier.server.index.BlockIndex` lock guards it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator

#: tombstones one page may step over beyond its ``limit`` (bounds a page's cost)
MAX_SKIP = 4096
_COMPACT_MIN = 1024  # below this many tombstones compaction is not worth a pass


class NamespaceOrder:
    __slots__ = ("_pos", "_positions", "_keys", "_head", "_dead", "_next")

    def __init__(self, first: int = 1) -> None:
        """``first``: the position :meth:`append` gives the first block (> 0: a cursor of 0 is "from the start")."""
        if first < 1:
            raise ValueError("positions start at 1 or later")
        self._pos: dict[bytes, int] = {}  # storage key -> position number
        self._positions: list[int] = []  # increasing
        self._keys: list[bytes | None] = []  # None: a tombstone
        self._head = 0  # slots before it are all tombstones
        self._dead = 0  # tombstones at or after the head
        self._next = first  # the position append gives next

    def __len__(self) -> int:
        return len(self._pos)

    def __contains__(self, skey: object) -> bool:
        return skey in self._pos

    def __iter__(self) -> Iterator[bytes]:
        """Oldest first, lazily (a caller that stops early pays only for what it took)."""
        keys = self._keys
        for i in range(self._head, len(keys)):
            k = keys[i]
            if k is not None:
                yield k

    def append(self, skey: bytes) -> int:
        """Add a block at the next position of this namespace; returns it."""
        position = self._next
        self.add(skey, position)
        return position

    def add(self, skey: bytes, position: int) -> None:
        if position < self._next:
            raise ValueError("positions must increase")
        self._pos[skey] = position
        self._positions.append(position)
        self._keys.append(skey)
        self._next = position + 1

    def discard(self, skey: bytes) -> None:
        position = self._pos.pop(skey, None)
        if position is None:
            return
        i = bisect_left(self._positions, position, self._head)
        self._keys[i] = None
        self._dead += 1
        keys = self._keys
        while self._head < len(keys) and keys[self._head] is None:
            self._head += 1
            self._dead -= 1
        if self._head >= _COMPACT_MIN and 2 * self._head > len(keys):
            del keys[: self._head]  # one memmove, paid for by the deletions that made the head
            del self._positions[: self._head]
            self._head = 0
        if self._dead >= _COMPACT_MIN and self._dead > len(self._pos):
            self._compact()

    def _compact(self) -> None:
        live = [(p, k) for p, k in zip(self._positions[self._head :], self._keys[self._head :]) if k is not None]
        self._positions = [p for p, _ in live]
        self._keys = [k for _, k in live]
        self._head = 0
        self._dead = 0

    def page(self, after: int, limit: int) -> tuple[list[bytes], int]:
        """Up to ``limit`` storage keys added after the block at position ``after`` (0: from the
        start), and the cursor to continue from (0: nothing is left). A cursor at or past the next
        position was never handed out by this order: it is from an earlier run, numbered on a clock
        that was ahead of this one's, and pages from the start (duplicates, never a skip)."""
        if after >= self._next:
            after = 0
        keys, positions = self._keys, self._positions
        i = bisect_right(positions, after, self._head)
        end = min(len(keys), i + limit + MAX_SKIP)
        out: list[bytes] = []
        while i < end and len(out) < limit:
            k = keys[i]
            if k is not None:
                out.append(k)
            i += 1
        if i >= len(keys):
            return out, 0
        return out, positions[i - 1]

    def check(self) -> None:
        live = [k for k in self._keys[self._head :] if k is not None]
        assert len(live) == len(self._pos) and set(live) == set(self._pos), "namespace order disagrees with its map"
        assert all(a < b for a, b in zip(self._positions, self._positions[1:])), "positions out of order"
        assert self._dead == len(self._keys) - self._head - len(live), "tombstone count is off"
