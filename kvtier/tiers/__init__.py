"""Storage tiers: one contract (:mod:`kvtier.tiers.base`), several mechanisms."""

from kvtier.tiers.base import Status, Tier, TierStats

__all__ = ["Status", "Tier", "TierStats"]
