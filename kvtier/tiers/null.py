"""``null``: stores nothing, finds nothing. A baseline and a stand-in for a disabled tier."""

from __future__ import annotations

from collections.abc import Iterator

from kvtier.core.keys import BlockKey
from kvtier.core.payload import BlockMeta
from kvtier.tiers.base import Status, Tier


class NullTier(Tier):
    name = "null"

    def contains(self, key: BlockKey) -> bool:
        return False

    def get(self, key: BlockKey, out) -> Status:
        self.stats.misses += 1
        return Status.MISS

    def put(self, key: BlockKey, data, *, parent: BlockKey | None = None, meta: BlockMeta | None = None,
            created: float | None = None) -> Status:
        # Accepting and dropping is the cache contract ("may lose, never wrong").
        self.stats.puts += 1
        return Status.OK

    def delete(self, key: BlockKey) -> bool:
        return False

    def keys(self) -> Iterator[BlockKey]:
        return iter(())

    @property
    def capacity_bytes(self) -> int:
        return 0

    @property
    def used_bytes(self) -> int:
        return 0
