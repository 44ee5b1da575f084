"""Races around TieredStore.delete (an erasure), put and close, each step placed at an exact point
by a hook of :class:`HookHost`: an erased block never comes back, a block saved again after its
erasure is still copied down, and close() neither loses a put under way nor leaves a promotion
running."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest

from kvtier.store import promotion
from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.host import HostTier

BLOCK = 4096


def key(i: int, salt: bytes = b"") -> bytes:
    return hashlib.sha256(salt + i.to_bytes(4, "little")).digest()


def block(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251 + 1, np.uint8)


def buf() -> np.ndarray:
    return np.empty(BLOCK, np.uint8)


def in_other_thread(fn):
    """Run ``fn`` to completion on another thread (a concurrent caller); its result or error."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the concurrent call hung"
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Started:
    """``fn`` running on another thread (a concurrent caller that may block): ``done()``, and
    ``join()`` for its result or error."""

    def __init__(self, fn) -> None:
        self._box: dict = {}
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by join()
            self._box["error"] = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout: float = 10.0):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the concurrent call hung"
        if "error" in self._box:
            raise self._box["error"]
        return self._box.get("value")


def wait_until(condition, timeout: float = 10.0) -> bool:
    """Wait until ``condition()``, at most ``timeout``; whether it came."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= end:
            return False
        time.sleep(0.001)
    return True


def start_delete(store, keys) -> Started:
    """Start ``store.delete(keys)`` on another thread; return once it has returned, or has marked
    the keys as being deleted and not returned within 0.2 s (it waits for their copies in flight:
    a hook of that copy's put calls this, so the copy goes on once this returns)."""
    deleter = Started(lambda: store.delete(keys))
    assert wait_until(lambda: deleter.done() or all(k in store._writebehind._deleting for k in keys))
    wait_until(deleter.done, 0.2)
    return deleter


class HookHost(HostTier):
    """A HostTier whose get/get_many/put_many/commit run a one-shot hook: another caller's step."""

    def __init__(self, blocks: int, name: str) -> None:
        super().__init__(blocks * BLOCK, BLOCK, prefault=False)
        self.name = name
        self.after_get_many = self.after_get = self.before_put_many = self.after_commit = None

    def get_many(self, keys, outs):
        statuses = super().get_many(keys, outs)
        hook, self.after_get_many = self.after_get_many, None
        if hook:
            hook()
        return statuses

    def get(self, key, out):
        status = super().get(key, out)
        hook, self.after_get = self.after_get, None
        if hook:
            hook()
        return status

    def put_many(self, keys, datas, **kw):
        hook, self.before_put_many = self.before_put_many, None
        if hook:
            hook()
        return super().put_many(keys, datas, **kw)

    def commit(self, res, **kw):
        won = super().commit(res, **kw)
        hook, self.after_commit = self.after_commit, None
        if hook:
            hook()
        return won


def holds(tier, k) -> bool:
    return tier.get(k, buf()) is Status.OK


@pytest.fixture
def tiered():
    fast, slow = HookHost(8, "fast"), HookHost(64, "slow")
    store = TieredStore([fast, slow])
    yield store, fast, slow
    store.close()


# -- promotions against deletes ---------------------------------------------------------------
def test_an_inline_promotion_does_not_bring_back_a_block_deleted_during_the_get(tiered):
    store, fast, slow = tiered
    k = key(1)
    slow.put(k, block(1))
    slow.after_get_many = lambda: in_other_thread(lambda: store.delete([k]))
    assert store.get([k], [buf()]).loaded == 1  # read before the erasure: served
    res = store.get([k], [buf()])
    assert res.loaded == 0, f"the erased block is served again from {res.tiers[0]!r}"
    assert not holds(fast, k)


def test_an_inline_promotion_without_a_delete_lands(tiered):
    store, fast, slow = tiered
    k = key(1)
    slow.put(k, block(1))
    assert store.get([k], [buf()]).tiers == ["slow"]
    assert holds(fast, k) and store.stats()["store"]["promotions"] == 1


def test_a_background_promotion_racing_a_delete_publishes_nothing_and_marks_nothing_clean(tiered):
    store, fast, slow = tiered
    k = key(1)
    slow.put(k, block(1))
    assert store.get([k], [buf()], promote_in_background=True).tiers == ["slow"]
    slow.after_get = lambda: in_other_thread(lambda: store.delete([k]))  # during the promoter's re-read
    served = []  # a get right after a commit (none is expected: the copy is aborted)
    fast.after_commit = lambda: served.append(in_other_thread(lambda: store.get([k], [buf()]).loaded))
    assert store.wait_promotions(10)
    assert served in ([], [0]), "a get after delete() returned served the erased block"
    assert not holds(fast, k) and not holds(slow, k)
    assert k not in store._writebehind._clean[0], "a stale clean mark outlived the erasure"
    # saved again: acknowledged, so copied down like any put
    assert store.put([k], [block(1)]) == [Status.OK]
    store.flush_dirty(10)
    assert holds(slow, k), "the block saved again after the erasure was never written behind"


def test_a_block_saved_again_after_a_raced_promotion_survives_its_eviction(tiered):
    store, fast, slow = tiered
    k = key(1)
    slow.put(k, block(1))
    store.get([k], [buf()], promote_in_background=True)
    slow.after_get = lambda: in_other_thread(lambda: store.delete([k]))
    assert store.wait_promotions(10)
    assert store.put([k], [block(1)]) == [Status.OK]
    others = [key(i, b"other") for i in range(16)]
    store.put(others, [block(i) for i in range(16)])  # pushes k out of the 8-block fast tier
    store.flush_dirty(10)
    assert store.get([k], [buf()]).loaded == 1, "the block saved again was lost on eviction"


def test_a_background_promotion_without_a_delete_lands_and_is_clean(tiered):
    store, fast, slow = tiered
    k = key(1)
    slow.put(k, block(1))
    store.get([k], [buf()], promote_in_background=True)
    assert store.wait_promotions(10)
    assert holds(fast, k) and k in store._writebehind._clean[0]


# -- write-behind against delete and close ------------------------------------------------------
def test_a_block_saved_again_while_its_deleted_copy_is_in_flight_is_copied_down(tiered):
    store, fast, slow = tiered
    k = key(1)
    deleters = []
    # while the flusher's copy of k is in flight (the delete waits for it: the flusher goes on)
    slow.before_put_many = lambda: deleters.append(start_delete(store, [k]))
    assert store.put([k], [block(1)]) == [Status.OK]
    store.flush_dirty(10)
    deleters[0].join()
    assert slow.stats.puts == 1 and not holds(fast, k) and not holds(slow, k)
    assert store.put([k], [block(1)]) == [Status.OK]  # saved again once delete() returned
    assert store.flush_dirty(10).dropped == 0
    assert holds(fast, k)
    assert holds(slow, k), "the block saved again after the delete never reached the lower tier"


def test_a_delete_during_a_copy_still_erases_the_copy(tiered):
    store, fast, slow = tiered
    k = key(1)
    deleters = []
    slow.before_put_many = lambda: deleters.append(start_delete(store, [k]))
    store.put([k], [block(1)])
    store.flush_dirty(10)
    deleters[0].join()
    assert slow.stats.puts == 1  # the copy landed (it was in flight when the delete began)
    assert not holds(fast, k) and not holds(slow, k)


def test_close_waits_for_a_put_under_way_and_copies_its_blocks_down():
    fast, slow = HookHost(8, "fast"), HookHost(64, "slow")
    store = TieredStore([fast, slow])
    k = key(1)
    stored, release = threading.Event(), threading.Event()
    put_many = fast.put_many

    def slow_put_many(keys, datas, **kw):  # the block is in the fast tier; the put has not marked it yet
        statuses = put_many(keys, datas, **kw)
        stored.set()
        release.wait(5)
        return statuses

    fast.put_many = slow_put_many
    result = {}
    putter = threading.Thread(target=lambda: result.setdefault("statuses", store.put([k], [block(1)])))
    putter.start()
    assert stored.wait(5)
    reports = []
    closer = threading.Thread(target=lambda: reports.append(store.close()))
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() did not wait for the put under way"
    release.set()
    putter.join(5)
    closer.join(5)
    assert result["statuses"] == [Status.OK]
    assert reports[0].dropped == 0, reports
    # (the tiers are closed: their counters say where the block went; the copy may have begun
    # before close's flush did, so the report need not count it)
    assert slow.stats.puts == 1 and store.stats()["store"]["writebehind_flushed"] == 1


def test_put_after_close_is_refused_with_a_clear_error():
    store = TieredStore([HookHost(8, "a"), HookHost(8, "b")])
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.put([key(1)], [block(1)])


def test_put_into_a_closed_host_tier_is_refused_with_a_clear_error():
    host = HookHost(8, "a")
    assert host.put(key(1), block(1)) is Status.OK
    host.close()
    with pytest.raises(RuntimeError, match="closed"):
        host.put(key(2), block(2))


# -- the promoter thread's hand-over against close ------------------------------------------------
def test_close_waits_for_a_promotion_of_a_thread_started_while_the_last_one_exited(monkeypatch):
    monkeypatch.setattr(promotion, "_IDLE_EXIT_S", 0.05)
    fast, slow = HookHost(8, "fast"), HookHost(64, "slow")
    store = TieredStore([fast, slow], write_mode="write-through")
    promoter = store._promoter
    loop, first_exit = promoter._loop, threading.Event()

    def lingering_loop():  # the first thread, having left its loop, is slow to end
        loop()
        if not first_exit.is_set():
            first_exit.set()
            time.sleep(0.5)

    promoter._loop = lingering_loop
    k1, k2 = key(1), key(2)
    slow.put(k1, block(1))
    slow.put(k2, block(2))
    store.get([k1], [buf()], promote_in_background=True)
    assert first_exit.wait(5)
    in_flight, release = threading.Event(), threading.Event()

    def slow_read():
        in_flight.set()
        release.wait(3)

    with store.reading():  # the promoter waits for it: only its re-read of k2 is slowed
        store.get([k2], [buf()], promote_in_background=True)  # starts a second thread
        slow.after_get = slow_read
    assert in_flight.wait(5)
    time.sleep(0.7)  # the first thread has ended meanwhile
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(1.0)
    returned_early = not closer.is_alive()
    release.set()
    closer.join(5)
    assert not returned_early, "close() returned while a promotion was in flight"
