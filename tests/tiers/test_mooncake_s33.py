"""Removals of blocks that never verify, late put-session revokes, closed tiers a shared client holds,
and read counts an EncryptedTier takes back: MooncakeTiers against a real Mooncake Store
(tests/tiers/mooncake_harness.py).

* Blocks that failed verification twice were removed one engine call at a time, each with a deadline
  of its own, and asked of the engine even with the tier down: one get of N tampered blocks took
  N x ``timeout_s`` with removals not answering.
* A put session's late revoke ran outside the tier's count of running calls: a ``close()`` meanwhile
  closed the shared store under it (which crashed the process).
* A tier that closed with a call running stayed held by the shared client, with the memory it
  registered, until the client's last user let go, however long ago that call ended.
* An EncryptedTier took back the tier's hit counts under its own lock, not the tier's: counts lost.

(audit s33 a3 D1-D4)"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import numpy as np
import pytest

from kvtier.tiers.base import Status
from tests.polling import wait_until
from tests.tiers.mooncake_harness import both_transfer_paths, make_tier, mooncake_available
from tests.tiers.test_encrypted_mooncake import sealed_tier
from tests.tiers.test_encrypted_mooncake_rereads import tamper
from tests.tiers.test_mooncake_repeats_and_owed_removals import SlowCalls
from tests.tiers.test_mooncake_shared_client_release import SlowLookups

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

BLOCK = 64 << 10
TIMEOUT_S = 1.0
REMOVALS = ("remove", "batch_remove")


@pytest.fixture
def transfer_path(request, monkeypatch) -> str:
    return both_transfer_paths(request, monkeypatch)


@pytest.fixture(scope="module")
def own_cluster():
    """A master + one holder of this module's own: the tests that watch a shared client's close are
    the only users of its client."""
    from kvtier.tiers.mooncake_launch import MooncakeCluster

    c = MooncakeCluster.start(holders=1, segment_bytes=64 << 20)
    yield c
    c.stop()


def block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


class CountedRemovals:
    """The tier's real engine; each removal call is counted and answers after ``delay_s``."""

    def __init__(self, engine, delay_s: float = 0.0) -> None:
        self._engine, self._delay_s = engine, delay_s
        self.calls = 0

    def __getattr__(self, name: str):
        fn = getattr(self._engine, name)
        if name not in REMOVALS:
            return fn

        def remove(*args):
            self.calls += 1
            time.sleep(self._delay_s)
            return fn(*args)

        return remove


def stored(engine, names: list[str]) -> list[bool]:
    return [code == 1 for code in engine.batch_is_exist(names)]


# -- D1: blocks that fail twice are removed in one follow-up call; none is asked while down ------
@pytest.mark.parametrize("transfer_path", ["batch calls", "sessions"], indirect=True)
def test_tampered_blocks_are_removed_in_one_call_within_the_gets_timeout(transfer_path):
    t = make_tier(timeout_s=TIMEOUT_S)
    n = 6
    keys, datas = [os.urandom(32) for _ in range(n)], [block(i) for i in range(n)]
    assert t.put_many(keys, datas) == [Status.OK] * n
    for k in keys:  # anyone with engine access can do this
        tamper(t, k)
    real = t._engine
    t._engine = removals = CountedRemovals(real, delay_s=1.5 * TIMEOUT_S)  # removals that do not answer in time
    try:
        start = time.monotonic()
        statuses = t.get_many(keys, [np.zeros(BLOCK, np.uint8) for _ in keys])
        took = time.monotonic() - start
    finally:
        t._engine = real
    assert statuses == [Status.CORRUPT] * n
    assert removals.calls == 1, f"{n} tampered blocks were removed in {removals.calls} engine calls"
    assert took < 2 * TIMEOUT_S, f"a get of {n} tampered blocks took {took:.2f} s against timeout_s {TIMEOUT_S}"
    assert t.available, "a removal that a get made after its reads took the tier down"
    # the removal that did not answer in time is owed: hidden at once, and retried until it lands
    assert t.contains_many(keys) == [False] * n
    names = [t.storage_name(k) for k in keys]
    assert wait_until(lambda: not any(stored(real, names))), "the late removal never landed"
    assert wait_until(lambda: not any(t.retry_removals(keys)))
    t.close()


def test_a_block_removed_while_the_tier_is_down_is_owed_without_asking_the_engine():
    t = make_tier(timeout_s=0.3, backoff_s=0.5)
    key = os.urandom(32)
    assert t.put(key, block(1)) is Status.OK
    real = t._engine
    t._engine = SlowCalls(real, ("batch_is_exist",), 2 * t.timeout_s)
    assert not t.contains(key)  # the lookup overran: the tier backs off
    assert not t.available, "premise: the tier is down"
    t._engine = removals = CountedRemovals(real)
    try:
        t.remove_unverifiable(key)  # (an EncryptedTier's block that fails its AES-GCM tags)
    finally:
        t._engine = real
    assert removals.calls == 0, "a removal was asked of the engine with the tier down"
    assert t.owed_removals == 1, "a removal the tier could not ask for was neither hidden nor retried"
    # once the backoff is over the health check brings the tier back, and the owed removal lands
    assert wait_until(lambda: not t.retry_removals([key])[0]), "the owed removal never landed"
    assert stored(real, [t.storage_name(key)]) == [False]
    t.close()


# -- D2: a put session's late revoke is running work of the tier ---------------------------------
class SlowSessionMaster:
    """The tier's real engine, its put sessions' start taking ``start_s`` (a slow master) and their
    revoke ``revoke_s``; a revoke that finds the store closed meanwhile calls nothing (that call
    crashed the process)."""

    def __init__(self, engine, start_s: float, revoke_s: float) -> None:
        self._engine, self._start_s, self._revoke_s = engine, start_s, revoke_s
        self.revoking, self.revoked = threading.Event(), threading.Event()
        self.store_closed = False
        self.closed_under_revoke = False

    def __getattr__(self, name: str):
        fn = getattr(self._engine, name)
        if name == "batch_put_session_start":
            return lambda *args: (time.sleep(self._start_s), fn(*args))[1]
        if name == "batch_put_session_revoke":
            return lambda *args: self._revoke(fn, *args)
        return fn

    def _revoke(self, fn, *args):
        self.revoking.set()
        time.sleep(self._revoke_s)
        try:
            if self.store_closed:
                self.closed_under_revoke = True
                return None
            return fn(*args)
        finally:
            self.revoked.set()


class WatchedStore:
    """The shared client's store, its close noted on ``master``."""

    def __init__(self, store, master: SlowSessionMaster) -> None:
        self._store, self._master = store, master

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def close(self):
        self._master.store_closed = True
        return self._store.close()


def test_closing_a_tier_while_a_late_put_session_is_revoked_leaves_the_shared_store_open(own_cluster, monkeypatch):
    from kvtier.tiers.mooncake import MooncakeTier

    monkeypatch.setattr(MooncakeTier, "_session_min_bytes", 1)  # the put moves in a session
    t = make_tier(own_cluster, timeout_s=0.3)
    t._engine = master = SlowSessionMaster(t._engine, start_s=0.6, revoke_s=0.5)
    t._client.store = WatchedStore(t._client.store, master)
    assert t.put(os.urandom(32), block(2)) is Status.ERROR  # the session's start overran the put
    assert master.revoking.wait(5), "premise: the late start's reservations are revoked"
    t.close()  # with the revoke in the engine
    assert master.revoked.wait(5)
    assert not master.closed_under_revoke, "close() closed the shared store under a running revoke"


# -- D3: the shared client lets go of closed tiers whose late calls have ended ------------------
def test_a_closed_tier_whose_late_call_ended_is_let_go_with_its_memory_at_the_next_acquire(own_cluster):
    keeper = make_tier(own_cluster)  # the process's long-lived tier: the client stays open
    closed = make_tier(own_cluster, timeout_s=0.3)
    assert closed._client is keeper._client
    pool = np.zeros(16 << 20, np.uint8)  # e.g. a KV pool it reads into
    closed.register_memory(pool)
    pool_alive, tier_alive = weakref.ref(pool), weakref.ref(closed)
    closed._engine = SlowLookups(closed._engine, 1.5)
    closed.contains(os.urandom(32))  # overruns: the lookup still runs as the tier closes
    closed.close()
    caller = closed._caller
    assert not caller.wait_idle(0), "premise: the tier closed with its lookup still running"
    assert caller.wait_idle(5), "premise: the lookup ends"
    del pool, closed, caller
    make_tier(own_cluster).close()  # another tier comes and goes
    keeper._client.registrar.settle(5)

    def let_go() -> bool:
        gc.collect()
        return pool_alive() is None and tier_alive() is None

    assert wait_until(let_go, 3.0), "a closed tier whose late call ended keeps its registered memory alive"
    keeper.close()


# -- D4: hits an EncryptedTier takes back are taken under the tier's own lock -------------------
def test_hits_taken_back_beside_the_tiers_own_counting_are_all_kept(tmp_path):
    sealed = sealed_tier(tmp_path)
    inner = sealed.inner
    key, data = os.urandom(32), block(3)
    assert inner.put(key, data) is Status.OK
    hits, nbytes = inner.stats.hits, inner.stats.bytes_read
    gets, taken_back = 50, [0]
    done = threading.Event()

    def take_back() -> None:  # what a sealed get does for each torn block it reads again, hashed
        view = memoryview(bytearray(100))
        while not done.is_set():
            sealed._uncount_unhashed_reads([view])
            taken_back[0] += 1

    taker = threading.Thread(target=take_back)
    taker.start()
    try:
        out = np.zeros_like(data)
        for _ in range(gets):  # the tier counting its own reads' hits meanwhile
            assert inner.get(key, out) is Status.OK
    finally:
        done.set()
        taker.join()
    assert inner.stats.hits - hits == gets - taken_back[0]
    lost = (gets * BLOCK - taken_back[0] * 100) - (inner.stats.bytes_read - nbytes)
    assert lost == 0, f"{lost} bytes read were lost from the tier's counts"
    sealed.close()
