"""The host pool's allocator: page runs for blocks, size-class slabs for tiny ones.

Pure bookkeeping over one byte range (no keys, no policy, no lock: the
:class:`~kvtier.tiers.host.HostTier` holds its lock around every call).

Why this shape. A KV block is large (16 KiB .. 32 MiB) and a pool may hold
many sizes at once (several models, a tenant per model). memcached's slab
allocator gives each size class its own pages with chunks 1.25x apart: up to
20 % of every block is lost to rounding, and a block larger than a page needs
something else anyway. Here the unit is the *granule* (the OS page, 4 KiB, when
blocks are page sized): a block of ``n`` bytes takes a run of
``ceil(n / granule)`` contiguous granules -- the finest page-aligned size class
there is, so a block loses less than one page (a 256 KiB block loses nothing;
a 1.1 MiB one 0.3 %), every payload starts page aligned (O_DIRECT, sockets),
and ``reserve`` hands out one contiguous view (zero-copy receive).

Blocks of at most half a granule (tests, toy models) would waste most of a
page each; they take a chunk of a size class instead (64-byte aligned, 1.25x
apart), carved from a *slab* of :data:`SLAB_GRANULES` granules that is itself a
run -- memcached's scheme, with the slab coming from the same run allocator.
A slab's run is freed only with its last chunk, so a chunk's footprint is not
what its block keeps from reuse: one live chunk pins the whole slab. Where
footprints are charged to someone (the server's per-tenant quotas), build the
allocator with ``slabs=False``: every block then takes a page run, and its
footprint is exactly the memory it holds.

Free runs are coalesced on free and found best fit (smallest free run that is
long enough), which keeps long runs for long blocks. When no run is long
enough the tier evicts (policy order) and, if the holes left are still too
short, asks :meth:`RunAllocator.window` for the cheapest stretch of
neighbours around a hole to evict as well: the run-allocator form of
memcached's slab rebalance (a starving size gets memory another size held).
"""

from __future__ import annotations

import bisect
import mmap
from collections.abc import Callable

PAGE = mmap.PAGESIZE
#: a tiny blocks' slab: 16 pages (64 KiB) loses < 3 % of it to the last chunk of any class
SLAB_GRANULES = 16
#: size-class growth for tiny blocks (memcached's default factor)
GROWTH = 1.25
CACHE_LINE = 64


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


class Run:
    """A stretch of granules ``[start, start + length)``: free, one block, or one slab."""

    __slots__ = ("start", "length", "tag", "slab")

    def __init__(self, start: int, length: int) -> None:
        self.start = start
        self.length = length
        self.tag: object | None = None  #: the block that owns the run (the tier's entry)
        self.slab: Slab | None = None

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def free(self) -> bool:
        return self.tag is None and self.slab is None

    def __repr__(self) -> str:
        kind = "free" if self.free else "slab" if self.slab else "block"
        return f"<Run {kind} {self.start}+{self.length}>"


class Slab:
    """A run cut into equal chunks of one size class."""

    __slots__ = ("run", "cls", "chunk", "nchunks", "free", "tags")

    def __init__(self, run: Run, cls: int, chunk: int, granule: int) -> None:
        self.run = run
        self.cls = cls
        self.chunk = chunk
        base = run.start * granule
        self.nchunks = run.length * granule // chunk
        # popped from the end: lowest addresses first
        self.free: list[int] = [base + i * chunk for i in range(self.nchunks - 1, -1, -1)]
        self.tags: dict[int, object] = {}  #: offset → the block in that chunk


class RunAllocator:
    """Page runs and tiny-block slabs over ``granules`` granules of ``granule`` bytes.

    ``alloc(n)`` returns ``(offset, home)`` where ``home`` is the :class:`Run`
    the block owns or the :class:`Slab` it has a chunk of; ``free(offset,
    home)`` gives it back. Offsets are in bytes from the start of the pool.
    With ``slabs=False`` there are no size classes: every block, however small,
    owns a run of whole granules (see the module docstring for why).
    """

    def __init__(self, granules: int, granule: int, *, slabs: bool = True) -> None:
        if granules < 1:
            raise ValueError("the pool needs at least one granule")
        self.granule = granule
        self.granules = granules
        self.slab_granules = min(SLAB_GRANULES, granules)
        #: chunk sizes of the tiny-block classes (none without slabs, or when granules are sub-page anyway)
        self.classes: list[int] = _class_sizes(granule) if slabs else []
        self._by_start: dict[int, Run] = {}
        self._by_end: dict[int, Run] = {}
        self._free_lens: list[int] = []  #: sorted distinct lengths of free runs
        self._free_at: dict[int, dict[int, Run]] = {}  #: length → start → free run
        self._free_granules = 0
        self._partial: list[dict[Slab, None]] = [{} for _ in self.classes]  #: slabs with a free chunk
        self._slabs: list[dict[Slab, None]] = [{} for _ in self.classes]
        self._plans: dict[int, tuple[int | None, int, int]] = {}
        self._add(Run(0, granules))

    # -- sizes -------------------------------------------------------------------------
    def size_class(self, nbytes: int) -> int | None:
        """Index of the tiny-block class for ``nbytes``, or None if it takes a page run."""
        if not self.classes or nbytes > self.classes[-1]:
            return None
        return bisect.bisect_left(self.classes, nbytes)

    def plan(self, nbytes: int) -> tuple[int | None, int, int]:
        """(size class or None, run length it needs, footprint) for a block of ``nbytes``.

        Cached: a pool sees few distinct sizes, and this is on every put's path.
        """
        got = self._plans.get(nbytes)
        if got is None:
            cls = self.size_class(nbytes)
            if cls is None:
                length = -(-nbytes // self.granule)
                got = (None, length, length * self.granule)
            else:
                got = (cls, self.slab_granules, self.classes[cls])
            if len(self._plans) < 4096:
                self._plans[nbytes] = got
        return got

    def footprint(self, nbytes: int) -> int:
        """Bytes of pool a block of ``nbytes`` takes."""
        return self.plan(nbytes)[2]

    def granules_for(self, nbytes: int) -> int:
        """Length of the run ``alloc(nbytes)`` needs: the block's own, or a new slab's."""
        return self.plan(nbytes)[1]

    @property
    def free_bytes(self) -> int:
        return self._free_granules * self.granule

    @property
    def largest_free_bytes(self) -> int:
        return (self._free_lens[-1] if self._free_lens else 0) * self.granule

    def alloc_fits(self, nbytes: int) -> bool:
        """Whether :meth:`alloc` of ``nbytes`` would succeed now (a free run or chunk for it)."""
        cls, length, _ = self.plan(nbytes)
        if cls is not None and self._partial[cls]:
            return True
        return bool(self._free_lens) and self._free_lens[-1] >= length

    # -- allocation ----------------------------------------------------------------------
    def alloc(self, nbytes: int, tag: object) -> tuple[int, Run | Slab] | None:
        """Memory for a block of ``nbytes`` owned by ``tag``, without evicting; None if none."""
        cls, length, _ = self.plan(nbytes)
        if cls is None:
            if not self._free_lens or self._free_lens[-1] < length:
                return None  # the common case of a full pool, without a search
            run = self._take(length)
            if run is None:
                return None
            run.tag = tag
            return run.start * self.granule, run
        partial = self._partial[cls]
        if partial:
            slab = next(iter(partial))
        else:
            run = self._take(self.slab_granules)
            if run is None:
                return None
            slab = run.slab = Slab(run, cls, self.classes[cls], self.granule)
            self._slabs[cls][slab] = None
            partial[slab] = None
        offset = slab.free.pop()
        slab.tags[offset] = tag
        if not slab.free:
            del partial[slab]
        return offset, slab

    def free(self, offset: int, home: Run | Slab) -> Run:
        """Give a block's memory back; returns the run that now holds that memory
        (a coalesced free run, or the slab's run if the slab still has blocks)."""
        if isinstance(home, Slab):
            del home.tags[offset]
            home.free.append(offset)
            if home.tags:
                self._partial[home.cls][home] = None
                return home.run
            self._partial[home.cls].pop(home, None)
            del self._slabs[home.cls][home]
            home.run.slab = None
            return self._release(home.run)
        home.tag = None
        return self._release(home)

    def hand_over(self, offset: int, home: Run | Slab, tag: object) -> tuple[int, Run | Slab]:
        """Give an evicted block's memory straight to ``tag``, a block of the same
        footprint: the common case of uniform blocks costs no free-list work."""
        if isinstance(home, Slab):
            home.tags[offset] = tag
        else:
            home.tag = tag
        return offset, home

    # -- making room ---------------------------------------------------------------------
    def window(self, anchor: Run, length: int, blocked: Callable[[Run], bool]) -> list[Run] | None:
        """The cheapest stretch of adjacent runs that contains ``anchor`` and spans at
        least ``length`` granules, none of them ``blocked`` (pinned); None if there is none.

        Cost is the granules held by blocks in it (free ones cost nothing): the
        fewest bytes to evict next to a hole so that a run of ``length`` appears.
        """
        if blocked(anchor):
            return None
        need = length - anchor.length
        left: list[Run] = []
        got, r = 0, anchor
        while got < need and (r := self._by_end.get(r.start)) is not None and not blocked(r):
            left.append(r)
            got += r.length
        right: list[Run] = []
        got, r = 0, anchor
        while got < need and (r := self._by_start.get(r.end)) is not None and not blocked(r):
            right.append(r)
            got += r.length
        seq = left[::-1] + [anchor] + right
        at = len(left)
        span = [0]
        cost = [0]
        for run in seq:
            span.append(span[-1] + run.length)
            cost.append(cost[-1] + (0 if run.free else run.length))
        best: tuple[int, int, int] | None = None
        j = at
        for i in range(at + 1):
            j = max(j, i)
            while j < len(seq) and span[j + 1] - span[i] < length:
                j += 1
            if j == len(seq):
                break
            c = cost[j + 1] - cost[i]
            if best is None or c < best[0]:
                best = (c, i, j)
        if best is None:
            return None
        return seq[best[1] : best[2] + 1]

    # -- run bookkeeping ----------------------------------------------------------------
    def _take(self, length: int) -> Run | None:
        """Best fit: the shortest free run of at least ``length``, split to size."""
        i = bisect.bisect_left(self._free_lens, length)
        if i == len(self._free_lens):
            return None
        have = self._free_lens[i]
        run = next(iter(self._free_at[have].values()))
        self._unfree(run)
        if have > length:  # the tail stays free
            del self._by_end[run.end]
            rest = Run(run.start + length, have - length)
            run.length = length
            self._by_end[run.end] = run
            self._add(rest)
        return run

    def _release(self, run: Run) -> Run:
        left = self._by_end.get(run.start)
        if left is not None and left.free:
            self._unfree(left)
            del self._by_start[run.start], self._by_end[left.end]
            left.length += run.length
            self._by_end[left.end] = left
            run = left
        right = self._by_start.get(run.end)
        if right is not None and right.free:
            self._unfree(right)
            del self._by_start[right.start], self._by_end[run.end]
            run.length += right.length
            self._by_end[run.end] = run
        self._free(run)
        return run

    def _add(self, run: Run) -> None:
        self._by_start[run.start] = run
        self._by_end[run.end] = run
        self._free(run)

    def _free(self, run: Run) -> None:
        at = self._free_at.get(run.length)
        if at is None:
            at = self._free_at[run.length] = {}
            bisect.insort(self._free_lens, run.length)
        at[run.start] = run
        self._free_granules += run.length

    def _unfree(self, run: Run) -> None:
        at = self._free_at[run.length]
        del at[run.start]
        if not at:
            del self._free_at[run.length]
            del self._free_lens[bisect.bisect_left(self._free_lens, run.length)]
        self._free_granules -= run.length

    # -- checks -------------------------------------------------------------------------
    def runs(self) -> list[Run]:
        """Every run, in address order."""
        out, at = [], 0
        while at < self.granules:
            run = self._by_start[at]
            out.append(run)
            at = run.end
        return out

    def check(self) -> dict[int, int]:
        """Assert the bookkeeping is whole; returns {class: chunks in use}."""
        runs = self.runs()
        assert runs[-1].end == self.granules, "the runs do not tile the pool"
        assert len(runs) == len(self._by_start) == len(self._by_end), "stale run entries"
        free = [r for r in runs if r.free]
        assert sum(r.length for r in free) == self._free_granules, "free granule count is off"
        assert sorted((r.length, r.start) for r in free) == sorted(
            (n, s) for n, at in self._free_at.items() for s in at
        ), "the free index disagrees with the free runs"
        assert self._free_lens == sorted(self._free_at), "free lengths are not sorted or stale"
        for a, b in zip(runs, runs[1:]):
            assert not (a.free and b.free), f"adjacent free runs {a} {b} were not coalesced"
        used_chunks = {}
        for cls, slabs in enumerate(self._slabs):
            total = free_chunks = used = 0
            for slab in slabs:
                assert slab.run.slab is slab and slab.cls == cls, "a slab lost its run"
                assert len(slab.free) + len(slab.tags) == slab.nchunks, (
                    f"slab of class {cls}: {len(slab.free)} free + {len(slab.tags)} used != {slab.nchunks}"
                )
                assert not set(slab.free) & slab.tags.keys(), "a chunk is both free and used"
                assert slab.tags, "an empty slab was not released"
                assert (slab in self._partial[cls]) == bool(slab.free), "partial-slab list is stale"
                total += slab.nchunks
                free_chunks += len(slab.free)
                used += len(slab.tags)
            assert free_chunks + used == total, f"class {cls}: free + used != total"
            used_chunks[cls] = used
        assert sum(len(s) for s in self._slabs) == sum(1 for r in runs if r.slab is not None), "orphan slab"
        return used_chunks


def _class_sizes(granule: int) -> list[int]:
    """Chunk sizes for blocks of at most half a granule: 64-byte aligned, ``GROWTH`` apart."""
    top = granule // 2
    if top < CACHE_LINE:
        return []
    sizes = [CACHE_LINE]
    while sizes[-1] < top:
        sizes.append(min(top, max(sizes[-1] + CACHE_LINE, round_up(int(sizes[-1] * GROWTH), CACHE_LINE))))
    return sizes
