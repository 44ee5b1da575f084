"""A forced removal that runs past its deadline is owed (hidden, retried) only until it lands.

A get drops a block that failed verification twice, a delete removes a block, each in one engine
call; when the call overran, its names were owed, and nothing forgot them when the late call
landed: the next retry of owed removals (a server makes one periodically) force-removed whatever
the names held by then -- a good copy another writer of the fleet (same secret, same names) had put
since (audit s33 r4 D3). Against a real Mooncake master and holder (tests/tiers/mooncake_harness.py);
the removal calls answer late, the engine's own answers otherwise."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvtier.tiers.base import Status
from tests.polling import wait_until
from tests.tiers.mooncake_harness import make_tier, mooncake_available
from tests.tiers.test_encrypted_mooncake_rereads import tamper
from tests.tiers.test_mooncake_s33 import CountedRemovals, stored

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

BLOCK = 64 << 10
TIMEOUT_S = 0.5
LATE_S = 0.8  # the removals answer after this: past TIMEOUT_S


def good_block() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, BLOCK, dtype=np.uint8)


def _another_writer_puts_and_keeps(mine, other, key: bytes, data: np.ndarray) -> None:
    """Once ``mine``'s late removal of ``key`` landed, ``other`` puts a good copy, and ``mine``'s
    retry of its owed removals leaves that copy alone."""
    real, name = mine._engine, mine.storage_name(key)
    assert wait_until(lambda: not stored(real, [name])[0]), "premise: the late removal lands"
    assert wait_until(lambda: mine.owed_removals == 0), "a removal that landed is still owed"
    assert other.put(key, data) is Status.OK
    assert wait_until(mine.healthy)  # (an overrun delete took it down: back once the master answers)
    time.sleep(1.1)  # (owed removals are retried at most once a second)
    mine.retry_removals()  # the server's periodic retry
    out = np.zeros(BLOCK, np.uint8)
    assert other.get(key, out) is Status.OK, "another writer's good block was removed by a removal that had landed"
    assert (out == data).all()


def test_a_gets_drop_that_overran_is_not_retried_once_it_landed():
    secret = os.urandom(32)
    mine, other = (make_tier(secret=secret, timeout_s=TIMEOUT_S) for _ in range(2))
    key, data = os.urandom(32), good_block()
    try:
        assert mine.put(key, data) is Status.OK
        tamper(mine, key)  # anyone with engine access can do this
        real = mine._engine
        mine._engine = CountedRemovals(real, delay_s=LATE_S)
        try:
            assert mine.get(key, np.zeros(BLOCK, np.uint8)) is Status.CORRUPT  # dropped, the drop overran
        finally:
            mine._engine = real
        _another_writer_puts_and_keeps(mine, other, key, data)
    finally:
        mine.close()
        other.close()


def test_a_delete_that_overran_is_owed_until_it_lands_then_not_retried():
    secret = os.urandom(32)
    mine, other = (make_tier(secret=secret, timeout_s=TIMEOUT_S) for _ in range(2))
    key, data = os.urandom(32), good_block()
    try:
        assert mine.put(key, data) is Status.OK
        real = mine._engine
        mine._engine = CountedRemovals(real, delay_s=LATE_S)
        try:
            assert mine.delete(key) is False  # not known removed: owed, hidden meanwhile
            assert mine.owed_removals == 1
        finally:
            mine._engine = real
        _another_writer_puts_and_keeps(mine, other, key, data)
    finally:
        mine.close()
        other.close()


class _LateFailingRemovals:
    """The engine, but its forced removals answer after LATE_S with an error: raised, or a failing
    code for each name."""

    def __init__(self, engine, raises: bool):
        self._engine, self._raises = engine, raises

    def __getattr__(self, name):
        fn = getattr(self._engine, name)
        if name != "batch_remove":
            return fn

        def remove(names, *args):
            time.sleep(LATE_S)
            if self._raises:
                raise RuntimeError("rpc failed")
            return [-1] * len(names)
        return remove


@pytest.mark.parametrize("late_answer", ["raises", "error codes"])
def test_a_put_after_an_overrun_delete_is_kept_when_the_late_call_fails(late_answer):
    """The late callback only ever takes names off the owed list: the put that brought the block back
    since has the last word (re-owed, it read as a miss and the next retry removed it: audit s33 r9
    D1). The premise's control: the overrun delete owes the name, the put un-owes it."""
    mine = make_tier(timeout_s=TIMEOUT_S)
    key, data = os.urandom(32), good_block()
    try:
        assert mine.put(key, data) is Status.OK
        real = mine._engine
        mine._engine = _LateFailingRemovals(real, raises=late_answer == "raises")
        assert mine.delete(key) is False and mine.owed_removals == 1  # overran: owed, hidden
        mine._engine = real
        assert wait_until(mine.healthy)
        assert mine.put(key, data) is Status.OK and mine.owed_removals == 0  # brought back
        time.sleep(LATE_S + 0.3)  # the late call has ended, in an error
        assert mine.owed_removals == 0, "the late failure owed again the block a newer put stored"
        time.sleep(1.1)  # (owed removals are retried at most once a second)
        mine.retry_removals()
        out = np.zeros(BLOCK, np.uint8)
        assert mine.get(key, out) is Status.OK and (out == data).all()
        assert stored(real, [mine.storage_name(key)])[0]
    finally:
        mine.close()
