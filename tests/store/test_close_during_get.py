"""close() on one thread while gets run on others: the gets under way end first (no tier closes
under a read), a get after close is a miss, and a promotion is not published behind the last flush.

close() used to wait for puts but not for gets: a get that had pinned its block in the host tier and
copied after close raised TypeError (the pool was gone), and a get that had read a block from a
lower tier promoted it into the closed fast tier and raised RuntimeError (s26 audit, D2)."""

from __future__ import annotations

import threading
import time

import numpy as np

from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.host import HostTier
from tests.store.test_erasure_races import BLOCK, HookHost, Started, block, buf, key, wait_until


class PausingHost(HostTier):
    """A HostTier that runs a one-shot hook when a block's bytes are looked at (a get: once the
    block is found and pinned, outside the lock)."""

    def __init__(self, blocks: int, name: str) -> None:
        super().__init__(blocks * BLOCK, BLOCK, prefault=False)
        self.name = name
        self.before_copy = None

    def _view(self, *args):
        hook, self.before_copy = self.before_copy, None
        if hook:
            hook()
        return super()._view(*args)


def _start_close(store) -> Started:
    """Start ``store.close()`` on another thread; return once it has closed reads (it then waits
    for the gets under way) or has returned."""
    closer = Started(store.close)
    assert wait_until(lambda: closer.done() or store._promoter._closed)
    wait_until(closer.done, 0.2)
    return closer


def test_a_get_mid_copy_when_the_store_closes_is_served_and_close_waits_for_it():
    fast, slow = PausingHost(8, "fast"), HookHost(64, "slow")
    store = TieredStore([fast, slow])
    k = key(1)
    assert store.put([k], [block(1)]) == [Status.OK]
    store.flush_dirty(10)  # (the write-behind copy looks at the bytes too)
    closers = []
    fast.before_copy = lambda: closers.append(_start_close(store))  # the get holds its pin
    out = np.full(BLOCK, 0xA5, np.uint8)
    res = store.get([k], [out])  # TypeError here when the pool went under the copy
    assert closers and not closers[0].done(), "close() returned while a get was copying"
    closers[0].join()
    assert res.statuses == [Status.OK] and np.array_equal(out, block(1))


def test_a_get_whose_inline_promotion_meets_a_closing_store_returns_its_block_and_publishes_nothing():
    fast, slow = HookHost(8, "fast"), HookHost(64, "slow")
    store = TieredStore([fast, slow])
    k = key(1)
    assert slow.put(k, block(1)) is Status.OK
    closers = []
    slow.after_get_many = lambda: closers.append(_start_close(store))  # read and verified: then close
    out = np.full(BLOCK, 0xA5, np.uint8)
    res = store.get([k], [out])  # RuntimeError('put into a closed HostTier') here before
    assert closers and not closers[0].done(), "close() returned while a get was under way"
    closers[0].join()
    assert res.loaded == 1 and res.tiers == ["slow"] and np.array_equal(out, block(1))
    assert store.stats()["store"]["promotions"] == 0 and fast.stats.puts == 0


def test_close_waits_for_a_reading_bracket_of_another_thread_and_later_gets_miss():
    fast, slow = HookHost(8, "fast"), HookHost(64, "slow")
    store = TieredStore([fast, slow])
    k = key(1)
    assert store.put([k], [block(1)]) == [Status.OK]
    inside, release, results = threading.Event(), threading.Event(), []

    def load():  # a load of several gets (chunks in flight, say)
        with store.reading():
            results.append(store.get([k], [buf()]).loaded)
            inside.set()
            release.wait(10)
            out = np.full(BLOCK, 0xA5, np.uint8)
            results.append((store.get([k], [out]).statuses, bool((out == 0xA5).all())))

    loader = Started(load)
    assert inside.wait(10)
    closer = Started(store.close)
    time.sleep(0.2)
    waited = not closer.done()
    release.set()
    loader.join()
    closer.join()
    assert waited, "close() returned while another thread's load was under way"
    # a get of that load after close began reads nothing: a miss, its buffer untouched
    assert results == [1, ([Status.MISS], True)]
    assert store.get([k], [buf()]).statuses == [Status.MISS]  # and after close


def test_close_inside_a_reading_bracket_of_its_own_thread_returns():
    store = TieredStore([HookHost(8, "fast"), HookHost(64, "slow")])
    k = key(1)
    assert store.put([k], [block(1)]) == [Status.OK]
    closer = Started(lambda: _close_while_reading(store, k))
    assert closer.join(5) == [Status.MISS]


def _close_while_reading(store, k):
    with store.reading():
        assert store.get([k], [buf()]).loaded == 1
        store.close()  # does not wait for its own bracket
        return store.get([k], [buf()]).statuses


def test_gets_racing_close_on_real_threads_never_raise():
    """Readers (plain, background promotion, on_ready) hammer a store that another thread closes,
    20 times: every get ends with a status, never an exception; served bytes are the block's own."""
    keys = [key(i, b"c") for i in range(24)]
    errors, served = [], [0]
    for _ in range(20):
        fast, slow = HostTier(8 * BLOCK, BLOCK, prefault=False), HostTier(64 * BLOCK, BLOCK, prefault=False)
        fast.name, slow.name = "fast", "slow"
        store = TieredStore([fast, slow])
        store.put(keys, [block(i) for i in range(24)])
        stop = threading.Event()

        def reader(kw, store=store, stop=stop):
            outs = [np.empty(BLOCK, np.uint8) for _ in keys]
            try:
                while not stop.is_set():
                    res = store.get(keys, outs, stop_at_miss=False, **kw)
                    for i, status in enumerate(res.statuses):
                        if status is Status.OK:
                            served[0] += 1
                            assert np.array_equal(outs[i], block(i)), "a wrong block was served"
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(repr(exc))

        readers = [threading.Thread(target=reader, args=(kw,)) for kw in
                   ({}, {"promote_in_background": True}, {"on_ready": lambda got, payloads: None})]
        for t in readers:
            t.start()
        time.sleep(0.01)
        store.close()
        stop.set()
        for t in readers:
            t.join(10)
    assert served[0] > 0
    assert not errors, f"{len(errors)} gets raised: {sorted(set(errors))[:3]}"
