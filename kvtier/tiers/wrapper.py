"""``WrappingTier``: the base of tiers that transform or perturb another tier.

Delegates what a wrapper does not change -- counters, capacity, integrity,
closing -- so that a wrapper states only what it adds.
"""

from __future__ import annotations

from kvtier.tiers.base import Tier, TierStats


class WrappingTier(Tier):
    def __init__(self, inner: Tier) -> None:
        self.inner = inner
        super().__init__()

    @property
    def stats(self) -> TierStats:
        # One set of counters: the wrapped tier's, plus what the wrapper counts into it.
        return self.inner.stats

    @stats.setter
    def stats(self, _value) -> None:
        pass  # Tier.__init__ assigns fresh stats; a wrapper's are the inner tier's

    @property
    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes

    @property
    def bounded_reads(self) -> bool:
        return self.inner.bounded_reads

    @property
    def available(self) -> bool:
        return self.inner.available

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    def check_integrity(self) -> None:
        self.inner.check_integrity()

    def close(self) -> None:
        self.inner.close()
