"""A client shared by two tiers closes once the last lets go, if the call one of them left running has
ended by then: MooncakeTiers against a real Mooncake Store.

A tier that closes while an engine call of its still runs (overrun) must not close the shared
client under it (closing the store under a running call crashed the process). Whether that call
still ran was asked once, when that tier let go: a client whose other tier closed much later, with
nothing running any more, was left open until the process ended (its store, transfer engine,
registered staging and registrar thread), one more per such cycle (audit s32 a5 D5).

A cluster of its own (a master + one holder), so that only this test's tiers share its client."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvtier.tiers.base import Status
from tests.tiers.mooncake_harness import make_tier, mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

BLOCK = 64 << 10


@pytest.fixture(scope="module")
def cluster():
    from kvtier.tiers.mooncake_launch import MooncakeCluster

    c = MooncakeCluster.start(holders=1, segment_bytes=64 << 20)
    yield c
    c.stop()


class SlowLookups:
    """The tier's real engine; its lookups answer after ``delay_s``."""

    def __init__(self, engine, delay_s: float) -> None:
        self._engine, self._delay_s = engine, delay_s

    def __getattr__(self, name: str):
        fn = getattr(self._engine, name)
        if name != "batch_is_exist":
            return fn

        def slow(*args):
            time.sleep(self._delay_s)
            return fn(*args)

        return slow


def registrar_thread_alive(client) -> bool:
    thread = client.registrar._thread
    return thread is not None and thread.is_alive()


def test_the_last_tier_to_let_go_closes_the_client_once_the_call_another_left_running_has_ended(cluster):
    a, b = make_tier(cluster, timeout_s=0.5), make_tier(cluster, timeout_s=0.5)
    shared = a._client
    assert b._client is shared
    key = os.urandom(32)
    assert b.put(key, np.ones(BLOCK, np.uint8)) is Status.OK
    assert b.get(key, np.zeros(BLOCK, np.uint8)) is Status.OK  # b's reads keep registered staging
    assert registrar_thread_alive(shared)
    a._engine = SlowLookups(a._engine, 2.0)
    a.contains(key)  # overruns
    a.close()  # with its lookup still in the engine
    assert not a._caller.wait_idle(0), "premise: a let go with its lookup still running"
    assert a._caller.wait_idle(5.0), "premise: the lookup ends"
    b.close()  # nothing runs any more
    shared.registrar.settle(5.0)
    deadline = time.monotonic() + 5
    while registrar_thread_alive(shared) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not registrar_thread_alive(shared), "the shared client was left open after every call had ended"


def test_the_last_tier_to_let_go_leaves_the_client_open_while_a_call_another_left_still_runs(cluster):
    a, b = make_tier(cluster, timeout_s=0.5), make_tier(cluster, timeout_s=0.5)
    shared = a._client
    key = os.urandom(32)
    a._engine = SlowLookups(a._engine, 2.0)
    a.contains(key)  # overruns
    a.close()  # with its lookup still in the engine
    b.close()  # ... still in the engine now: closing the store under it would crash the process
    assert not a._caller.wait_idle(0), "premise: the lookup still runs"
    assert not shared.registrar._closed, "the client was closed under a running engine call"
    assert a._caller.wait_idle(5.0)
