"""``WrappingTier``: the base of tiers that transform or perturb another tier.

Delegates what a wrapper does not change -- counters, capacity, integrity,
closing, blocks' ages and whether its TTL admits one (:meth:`admits`) -- so
that a wrapper states only what it adds. Over a tier that keeps ages
(:attr:`~kvtier.tiers.base.Tier.keeps_age`) a wrapper's puts are given
``created`` and must pass it on; one that renames keys answers
:meth:`created_of` under its own names.
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
    def keeps_age(self) -> bool:
        return self.inner.keeps_age

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    def created_of(self, key):
        return self.inner.created_of(key)

    def admits(self, created) -> bool:
        return self.inner.admits(created)

    def expire(self) -> int:
        return self.inner.expire()

    def check_integrity(self) -> None:
        self.inner.check_integrity()

    def close(self) -> None:
        self.inner.close()
