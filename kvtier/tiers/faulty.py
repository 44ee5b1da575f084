"""A fault-injecting wrapper for tests: errors, delays and corruption on demand.

It wraps a real tier and perturbs what passes through, so that tests exercise
the real mechanism under faults. Probabilities are drawn from a seeded RNG so
a failing test replays exactly.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvtier.core.keys import BlockKey
from kvtier.core.payload import BlockMeta
from kvtier.tiers.base import Status, Tier, age_kw
from kvtier.tiers.wrapper import WrappingTier


@dataclass
class Faults:
    get_error: float = 0.0  #: probability a get fails with Status.ERROR
    put_error: float = 0.0  #: probability a put fails with Status.ERROR
    corrupt_read: float = 0.0  #: probability a successful get has a byte flipped in the caller's buffer
    delay_s: float = 0.0  #: added to every operation
    down: bool = False  #: every operation fails, as a dead tier would


class FaultyTier(WrappingTier):
    """Wraps ``inner``; faults are set through :attr:`faults` at any time.

    A corrupted read is reported as OK on purpose: it models silent corruption
    below the verification layer, which a caller's own check must catch.
    """

    def __init__(self, inner: Tier, faults: Faults | None = None, seed: int = 0) -> None:
        super().__init__(inner)
        self.faults = faults or Faults()
        self.name = f"faulty({inner.name})"
        self._rng = random.Random(seed)

    @property
    def on_evict(self):
        return self.inner.on_evict

    @on_evict.setter
    def on_evict(self, hook) -> None:
        # Evictions happen in the wrapped tier: the hook belongs there.
        self.inner.on_evict = hook

    def _roll(self, p: float) -> bool:
        return p > 0 and self._rng.random() < p

    def _pause(self) -> None:
        if self.faults.delay_s:
            time.sleep(self.faults.delay_s)

    def contains(self, key: BlockKey) -> bool:
        self._pause()
        return not self.faults.down and self.inner.contains(key)

    def get(self, key: BlockKey, out) -> Status:
        self._pause()
        if self.faults.down or self._roll(self.faults.get_error):
            self.stats.errors += 1
            return Status.ERROR
        status = self.inner.get(key, out)
        if status is Status.OK and self._roll(self.faults.corrupt_read):
            buf = np.frombuffer(memoryview(out).cast("B"), dtype=np.uint8)
            buf[self._rng.randrange(buf.size)] ^= 1 << self._rng.randrange(8)
        return status

    def put(self, key: BlockKey, data, *, parent: BlockKey | None = None, meta: BlockMeta | None = None,
            created: float | None = None) -> Status:
        self._pause()
        if self.faults.down or self._roll(self.faults.put_error):
            self.stats.errors += 1
            return Status.ERROR
        return self.inner.put(key, data, parent=parent, meta=meta, **age_kw(self.inner, created))

    def delete(self, key: BlockKey) -> bool:
        self._pause()
        return not self.faults.down and self.inner.delete(key)

    def keys(self) -> Iterator[BlockKey]:
        return self.inner.keys()

