"""Calls an operation makes besides its own first attempt are no outage: MooncakeTier against a real
Mooncake Store (tests/tiers/mooncake_harness.py), its engine answering every call, slowly.

A key asked twice in one get was read in a second round, as a first attempt with only what the
first round left of the deadline: its overrun took a master that answered every call in time for
an outage (the whole tier down for the backoff), and the repeat got ERROR though the block had just
been served. A put first retried other names' owed removals with its own deadline: a slow removal
failed the put before it sent anything, took the tier down, and the put was missing from
``unsent_puts()`` (audit s32 a5 D1, D4). A delete did so too: the slow removal of another name failed
it before it was sent, reported it refused and took the tier down (audit s32 r6 D2)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvtier.tiers.base import Status, refused_removals
from kvtier.tiers.mooncake import unsent_puts
from kvtier.tiers.mooncake_client import RC_HAS_LEASE
from tests.tiers.mooncake_harness import both_transfer_paths, make_tier, mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

BLOCK = 64 << 10


@pytest.fixture(autouse=True, params=["batch calls", "sessions"])
def transfer_path(request, monkeypatch) -> str:
    return both_transfer_paths(request, monkeypatch)


def block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


class SlowCalls:
    """The tier's real engine; the calls named answer only after ``delay_s`` (a loaded engine), or
    only those whose names (first argument) include ``naming`` (a holder slow to free one object)."""

    def __init__(self, engine, names: tuple[str, ...], delay_s: float, *, naming: str | None = None) -> None:
        self._engine, self._names, self._delay_s, self._naming = engine, names, delay_s, naming

    def __getattr__(self, name: str):
        fn = getattr(self._engine, name)
        if name not in self._names:
            return fn

        def slow(*args):
            if self._naming is None or self._naming in args[0]:
                time.sleep(self._delay_s)
            return fn(*args)

        return slow


class RefusedRemovals:
    """The tier's real engine; every removal refused as a reader's lease refuses it (nothing removed)."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        if name == "batch_remove":
            return lambda names, force=False: [RC_HAS_LEASE] * len(names)
        return getattr(self._engine, name)


def owe_a_refused_removal(t, key: bytes) -> None:
    """Make ``key``'s removal owed: the engine refuses it (a lease the force did not break), and it
    stays owed until a retry lands. (A removal whose call overran is owed only until that call
    lands: audit s33 r4 D3.)"""
    real = t._engine
    t._engine = RefusedRemovals(real)
    try:
        assert t.delete(key) is False
    finally:
        t._engine = real
    assert t.owed_removals == 1
    assert t.available


READS = ("batch_get_into_multi_buffers", "batch_get_into_multi_buffer_ranges")


def test_a_key_asked_twice_in_one_get_is_served_twice_and_leaves_a_master_that_answers_in_time_up():
    t = make_tier(timeout_s=1.0)
    key, data = os.urandom(32), block(1)
    try:
        assert t.put(key, data) is Status.OK
        real = t._engine
        t._engine = SlowCalls(real, READS, 0.6)  # every read answers within the deadline, after 0.6 s
        try:
            outs = [np.zeros_like(data), np.zeros_like(data)]
            statuses = t.get_many([key, key], outs)
        finally:
            t._engine = real
        assert statuses == [Status.OK, Status.OK]
        assert all(np.array_equal(out, data) for out in outs)
        assert t.available, f"a master answering every call in time was taken for down: {t.last_error}"
        assert t.stats.hits >= 2
    finally:
        t.close()


def test_a_key_asked_at_two_sizes_reads_its_second_round_as_a_follow_up():
    """The second size's read waits a round; its overrun fails that block, not the tier."""
    t = make_tier(timeout_s=1.0)
    key, data = os.urandom(32), block(2)
    try:
        assert t.put(key, data) is Status.OK
        real = t._engine
        t._engine = SlowCalls(real, READS, 0.6)
        try:
            statuses = t.get_many([key, key], [np.zeros_like(data), np.zeros(BLOCK // 2, np.uint8)])
        finally:
            t._engine = real
        assert statuses[0] is Status.OK
        assert statuses[1] is not Status.OK
        assert t.available, f"a master answering every call in time was taken for down: {t.last_error}"
    finally:
        t.close()


def test_a_put_after_a_slow_owed_removal_is_stored_and_the_tier_stays_up():
    t = make_tier(timeout_s=0.5)
    real = t._engine
    old = os.urandom(32)
    try:
        assert t.put(old, block(3)) is Status.OK
        owe_a_refused_removal(t, old)
        t._engine = SlowCalls(real, ("batch_remove",), 1.0)  # removals answer after twice the timeout
        key, data = os.urandom(32), block(4)
        with unsent_puts() as unsent:
            status = t.put(key, data)
        t._engine = real
        assert status is Status.OK, "a slow removal of another name failed the put"
        assert unsent == []
        assert t.available, f"a slow removal of another name took the tier down: {t.last_error}"
        out = np.zeros_like(data)
        assert t.get(key, out) is Status.OK and np.array_equal(out, data)
    finally:
        t._engine = real
        t.close()


def test_a_delete_after_a_slow_owed_removal_of_another_name_is_sent_and_the_tier_stays_up():
    t = make_tier(timeout_s=0.5)
    real = t._engine
    old, key = os.urandom(32), os.urandom(32)
    try:
        assert t.put(old, block(5)) is Status.OK
        assert t.put(key, block(6)) is Status.OK
        owe_a_refused_removal(t, old)
        t._engine = SlowCalls(real, ("batch_remove",), 1.0, naming=t.storage_name(old))  # only old's removal is slow
        with refused_removals() as refused:
            removed = t.delete(key)
        t._engine = real
        assert removed is True, "a slow removal of another name failed the delete"
        assert refused == []
        assert t.available, f"a slow removal of another name took the tier down: {t.last_error}"
        assert t.contains(key) is False
        assert t.retry_removals([old]) == [True], "the retry that overran left the removal owed"
    finally:
        t._engine = real
        t.close()
