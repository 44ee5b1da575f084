"""The block manager: tiers stacked fastest first, and the token-level facade."""

from kvtier.store.tiered import GetResult, PrefixMatch, TieredStore, WriteMode

__all__ = ["GetResult", "PrefixMatch", "TieredStore", "WriteMode"]
