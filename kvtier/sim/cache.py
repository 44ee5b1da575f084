"""Block caches of the simulated cluster and the trace replay that measures hit rates.

A cache holds block ids (the trace's hash ids), not bytes: capacity is in blocks.
Eviction is LRU, and a request's blocks are made recent tail first, so of one prompt
its last block is the least recent and goes first, its root last: as vLLM frees a
request's blocks (in reverse, "so that the tail blocks are evicted first"), and as the
router's index orders a decision's matched keys. Evicted root first, one eviction made
a whole cached chain unusable (no block is a hit without its ancestors) while its
other blocks still took room.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, NamedTuple, Sequence

from kvtier.errors import ConfigError
from kvtier.sim.trace import Trace


class LRUBlockCache:
    """A set of block ids with LRU eviction. ``capacity_blocks=None`` means unbounded.

    Not thread safe; the simulator is single-threaded. ``insert`` and ``touch``
    mutate the recency order; ``__contains__`` does not, so a router may look
    without disturbing what it looks at.
    """

    __slots__ = ("capacity_blocks", "_blocks", "evictions")

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ConfigError(f"cache capacity must be >= 0 blocks (or None for unbounded), got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def insert(self, blocks: Sequence[int]) -> None:
        """Make a prompt's ``blocks`` the most recent, its root the youngest and its tail the
        oldest (the first to go), evicting the least recent beyond capacity."""
        if self.capacity_blocks == 0:
            return
        store = self._blocks
        for block in reversed(blocks):
            if block in store:
                store.move_to_end(block)
            else:
                store[block] = None
        if self.capacity_blocks is not None:
            while len(store) > self.capacity_blocks:
                store.popitem(last=False)
                self.evictions += 1

    def prefix_length(self, blocks: Iterable[int]) -> int:
        """How many leading ``blocks`` are cached (a block is useful only after all its ancestors)."""
        store = self._blocks
        count = 0
        for block in blocks:
            if block not in store:
                break
            count += 1
        return count

    def check_integrity(self) -> None:
        if self.capacity_blocks is not None and len(self._blocks) > self.capacity_blocks:
            raise AssertionError(f"cache holds {len(self._blocks)} blocks over its capacity {self.capacity_blocks}")


class ReplayResult(NamedTuple):
    capacity_blocks: int | None
    block_hit_rate: float
    token_hit_rate: float
    hit_blocks: int
    total_blocks: int


def replay_prefix_hits(trace: Trace, capacity_blocks: int | None = None) -> ReplayResult:
    """One shared LRU cache replayed over the trace, timing ignored.

    Each request looks up its prompt (a block hits only if every earlier block of
    the request hit), then stores all its blocks, as a prefill that saved its KV.
    """
    cache = LRUBlockCache(capacity_blocks)
    hit_blocks = total_blocks = hit_tokens = total_tokens = 0
    block_tokens = trace.block_tokens
    for req in trace.requests:
        hits = cache.prefix_length(req.blocks)
        count = len(req.blocks)
        hit_blocks += hits
        total_blocks += count
        total_tokens += req.input_tokens
        # Only the last block may be partial, so hit tokens are full blocks unless all hit.
        hit_tokens += req.input_tokens if hits == count else hits * block_tokens
        cache.insert(req.blocks)
    return ReplayResult(capacity_blocks, hit_blocks / max(total_blocks, 1), hit_tokens / max(total_tokens, 1),
                        hit_blocks, total_blocks)


def unique_blocks(trace: Trace) -> int:
    return len({block for req in trace.requests for block in req.blocks})


def hit_rate_curve(trace: Trace, fractions: Iterable[float] = (0.002, 0.005, 0.01, 0.03, 0.1, 0.2, 0.35, 0.5,
                                                                0.75, 1.0)) -> list[ReplayResult]:
    """Hit rate of a shared LRU cache sized at ``fractions`` of the trace's distinct blocks.

    At 1.0 nothing is ever evicted, so the last point equals the unbounded cache.
    """
    distinct = unique_blocks(trace)
    return [replay_prefix_hits(trace, max(1, round(f * distinct))) for f in fractions]
