"""An overrun removal's late answer forgets only the names owed since before it was asked.

delete1 of a block overruns (the engine removed it at once, its answer comes late): owed. A put
brings the block back (owed no more), and delete2 of it is refused: owed again, reported refused,
hidden and "retried until it lands". Then delete1's late answer (code 0) arrived and took the name
off the owed list: delete2's erasure was never retried, the tier served the block again and the
fleet kept it (audit s34 a1 D1). Against a real Mooncake master and holder
(tests/tiers/mooncake_harness.py); the removal calls are the engine's, delayed or refused."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from kvtier.tiers.base import Status
from tests.polling import wait_until
from tests.tiers.mooncake_harness import make_tier, mooncake_available
from tests.tiers.test_mooncake_s33 import stored

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

BLOCK = 64 << 10
TIMEOUT_S = 0.5
FIRST_ANSWER_LATE_S = 3.0  # delete1's answer, after its removal landed: long past TIMEOUT_S


class _Removals:
    """The engine, but its forced removals either land at once and answer late (``landed_late``,
    set once answered), or are refused, late (``refused_after_s``)."""

    def __init__(self, engine, *, refused_after_s: float | None = None):
        self._engine, self._refused_after_s = engine, refused_after_s
        self.answered = threading.Event()

    def __getattr__(self, name):
        fn = getattr(self._engine, name)
        if name != "batch_remove":
            return fn

        def remove(names, *args):
            if self._refused_after_s is not None:
                time.sleep(self._refused_after_s)
                return [-1] * len(names)
            codes = fn(names, *args)
            time.sleep(FIRST_ANSWER_LATE_S)
            self.answered.set()
            return codes
        return remove


@pytest.mark.parametrize("refusal_late_s", [0.8, 4.5], ids=["refusal-answers-first", "refusal-answers-last"])
def test_a_late_answer_leaves_owed_what_a_newer_delete_owes(refusal_late_s):
    mine = make_tier(timeout_s=TIMEOUT_S)
    key, data = os.urandom(32), np.random.default_rng(7).integers(0, 256, BLOCK, dtype=np.uint8)
    real, name = mine._engine, mine.storage_name(key)
    try:
        assert mine.put(key, data) is Status.OK
        first = mine._engine = _Removals(real)
        assert mine.delete(key) is False and mine.owed_removals == 1  # overran: owed
        mine._engine = real
        assert wait_until(mine.healthy)
        assert mine.put(key, data) is Status.OK and mine.owed_removals == 0  # brought back
        mine._engine = _Removals(real, refused_after_s=refusal_late_s)
        assert mine.delete(key) is False and mine.owed_removals == 1  # refused (late): owed again
        mine._engine = real
        assert first.answered.wait(10), "premise: delete1's answer comes"
        time.sleep(0.2 + max(0.0, refusal_late_s - FIRST_ANSWER_LATE_S))  # (and delete2's too)
        assert mine.owed_removals == 1, "delete1's late answer took off the removal delete2 owes"
        assert wait_until(mine.healthy)
        time.sleep(1.1)  # (owed removals are retried at most once a second)
        mine.retry_removals()  # the server's periodic retry
        assert mine.get(key, np.zeros(BLOCK, np.uint8)) is not Status.OK
        assert not stored(real, [name])[0], "the block whose delete was owed stays in the fleet"
        assert mine.owed_removals == 0
    finally:
        mine.close()
