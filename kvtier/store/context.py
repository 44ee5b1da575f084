"""ContextCache: the token-level face of a TieredStore for one namespace.

Engines think in token ids and KV tensors; the store thinks in keys and byte
buffers. This facade computes keys, checks every buffer against the layout
(raising :class:`~kvtier.errors.LayoutError` that names the mismatch) and
hands whole blocks to the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import NamedTuple

import numpy as np

from kvtier.core.keys import BlockKey, block_keys
from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace
from kvtier.core.payload import BlockMeta
from kvtier.store import safety
from kvtier.store.tiered import GetResult, TieredStore
from kvtier.tiers.base import Status


class CachedPrefix(NamedTuple):
    """What the store holds of a prompt: ``keys`` of all its full blocks, the
    first ``hit_blocks`` of which are cached (``tiers[i]`` names where)."""

    keys: list[BlockKey]
    hit_blocks: int
    hit_tokens: int
    tiers: list[str]


class ContextCache:
    def __init__(self, store: TieredStore, namespace: Namespace) -> None:
        self.store = store
        self.namespace = namespace
        self.layout: KVLayout = namespace.layout
        self._meta = BlockMeta.of_layout(self.layout)
        if namespace.tenant == "":
            safety.warn_default_tenant(f"the namespace of model {namespace.model_id!r}")

    def keys(self, tokens: Sequence[int] | np.ndarray) -> list[BlockKey]:
        return block_keys(self.namespace, tokens)

    def lookup(self, tokens: Sequence[int] | np.ndarray) -> CachedPrefix:
        keys = self.keys(tokens)
        match = self.store.lookup(keys)
        return CachedPrefix(keys, match.hit_blocks, match.hit_blocks * self.layout.block_tokens, match.tiers)

    def load(self, keys: Sequence[BlockKey], outs: Sequence[np.ndarray]) -> GetResult:
        """Load blocks into caller buffers (each checked against the layout)."""
        for i, out in enumerate(outs):
            self.layout.check_block(out, what=f"output buffer {i}")
        return self.store.get(keys, outs)

    def load_async(self, keys: Sequence[BlockKey], outs: Sequence[np.ndarray]) -> Future[GetResult]:
        for i, out in enumerate(outs):
            self.layout.check_block(out, what=f"output buffer {i}")
        return self.store.get_async(keys, outs)

    def save(self, keys: Sequence[BlockKey], blocks: Sequence[np.ndarray]) -> list[Status]:
        """Store whole blocks under ``keys`` (a chain, first key's parent unknown)."""
        self._check_blocks(keys, blocks)
        return self.store.put(keys, blocks, metas=[self._meta] * len(keys))

    def save_async(self, keys: Sequence[BlockKey], blocks: Sequence[np.ndarray]) -> Future[list[Status]]:
        """As :meth:`save`, off the caller's thread; ``blocks`` must stay unchanged until done."""
        self._check_blocks(keys, blocks)
        return self.store.put_async(keys, blocks, metas=[self._meta] * len(keys))

    def _check_blocks(self, keys: Sequence[BlockKey], blocks: Sequence[np.ndarray]) -> None:
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        for i, block in enumerate(blocks):
            self.layout.check_block(block, what=f"block {i}")
