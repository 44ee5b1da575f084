"""A delete racing the write-behind copy of its block waits for that copy to land, then deletes it
from every tier: once delete() returns, no copy made before it brings the block back.

Deleting the landed copy afterwards instead (the flusher's "late delete") left a window between the
copy's settle and that delete: a get after delete() returned served the erased block from the lower
tier and promoted it back into the fast tier for good, and a block saved again after the erasure and
evicted in that window was "demoted" by a no-op put, then lost to the late delete (s26 audit, D1)."""

from __future__ import annotations

import random
import threading
import time

import numpy as np

from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.faulty import Faults, FaultyTier
from kvtier.tiers.host import HostTier
from tests.store.test_erasure_races import (
    BLOCK, HookHost, Started, block, buf, holds, in_other_thread, key, start_delete, wait_until)

FLUSHER = "kvtier-writebehind"


class DeleteHookHost(HookHost):
    """HookHost whose ``delete_many`` runs ``before_delete_many(thread_name)`` first (every call)."""

    def __init__(self, blocks: int, name: str) -> None:
        super().__init__(blocks, name)
        self.before_delete_many = None

    def delete_many(self, keys):
        if self.before_delete_many is not None:
            self.before_delete_many(threading.current_thread().name)
        return super().delete_many(keys)


def _delete_racing_the_copy(store, slow, k, deleters: list[Started]) -> None:
    """Put ``k``; while the flusher copies it down, start ``delete([k])`` (appended to ``deleters``)."""
    slow.before_put_many = lambda: deleters.append(start_delete(store, [k]))
    assert store.put([k], [block(1)]) == [Status.OK]
    store.flush_dirty(10)


def test_a_get_after_delete_returned_never_serves_a_block_whose_copy_raced_the_delete():
    fast, slow = HookHost(8, "fast"), DeleteHookHost(64, "slow")
    store = TieredStore([fast, slow])
    try:
        k = key(1)
        served, deleters = [], []

        def get_once_deleted(thread_name):  # (where the flusher deleted the landed copy late)
            if thread_name == FLUSHER and deleters:
                deleters[0].join()  # delete() has returned
                out = np.full(BLOCK, 0xA5, np.uint8)
                served.append(in_other_thread(lambda: store.get([k], [out])).loaded)

        slow.before_delete_many = get_once_deleted
        _delete_racing_the_copy(store, slow, k, deleters)
        deleters[0].join()
        wait_until(lambda: served, 0.5)  # (flush_dirty returned before the late delete ran)
        store.flush_dirty(10)
        served.append(store.get([k], [buf()]).loaded)  # and once every copy has settled
        assert slow.stats.puts == 1, "the copy did not land: the race was not run"
        assert served[0] == 0 and set(served) == {0}, f"a get after delete() returned served it: {served}"
        assert not holds(fast, k) and not holds(slow, k), (
            f"the erased block came back: fast={holds(fast, k)} slow={holds(slow, k)}")
    finally:
        store.close()


def test_a_block_saved_again_right_after_the_delete_and_evicted_is_not_lost():
    fast, slow = HookHost(8, "fast"), DeleteHookHost(64, "slow")
    store = TieredStore([fast, slow])
    try:
        k = key(1)
        others = [key(i, b"other") for i in range(16)]
        acted, deleters, once, done = [], [], threading.Lock(), threading.Event()

        def save_again_and_evict():  # delete() returned: k is saved again, then pushed out of the fast tier
            with once:
                if acted:
                    return
                acted.append(True)
            try:
                assert in_other_thread(lambda: store.put([k], [block(1)])) == [Status.OK]
                in_other_thread(lambda: store.put(others, [block(i) for i in range(16)]))
            finally:
                done.set()

        def in_the_late_delete(thread_name):
            if thread_name == FLUSHER and deleters:
                deleters[0].join()  # delete() has returned
                save_again_and_evict()

        slow.before_delete_many = in_the_late_delete
        _delete_racing_the_copy(store, slow, k, deleters)
        deleters[0].join()
        wait_until(lambda: acted, 0.5)  # (flush_dirty returned before the late delete ran)
        save_again_and_evict()  # no late delete: right after delete() returned
        assert done.wait(10)
        store.flush_dirty(10)
        assert not fast.contains(k), "k was not evicted from the fast tier: the race was not run"
        out = np.full(BLOCK, 0xA5, np.uint8)
        res = store.get([k], [out])
        assert res.loaded == 1 and np.array_equal(out, block(1)), (
            f"k, saved again after its erasure (acknowledged), is in no tier; stats {store.stats()['store']}")
    finally:
        store.close()


def test_the_delete_returns_only_once_the_copy_in_flight_has_landed_and_is_deleted():
    fast, slow = HookHost(8, "fast"), HookHost(64, "slow")
    store = TieredStore([fast, slow])
    try:
        k = key(1)
        release, states = threading.Event(), []

        def copy_held():  # the flusher's copy of k is in flight until released
            deleter = start_delete(store, [k])
            time.sleep(0.1)
            states.append(deleter.done())
            release.set()
            states.append(deleter)

        slow.before_put_many = copy_held
        assert store.put([k], [block(1)]) == [Status.OK]
        assert release.wait(10)
        store.flush_dirty(10)
        returned_early, deleter = states
        assert not returned_early, "delete() returned while its block's copy was in flight"
        assert deleter.join() == 2  # the fast tier's copy and the one that landed
        assert slow.stats.puts == 1 and not holds(fast, k) and not holds(slow, k)
    finally:
        store.close()


def test_a_block_saved_while_its_delete_runs_is_copied_down_once_the_delete_ends():
    fast, slow = HookHost(8, "fast"), DeleteHookHost(64, "slow")
    store = TieredStore([fast, slow])
    try:
        k = key(1)
        assert store.put([k], [block(1)]) == [Status.OK]
        store.flush_dirty(10)
        saved = []

        def save_again(thread_name):  # the fast tier's copy is gone; the delete is not over
            if not saved:
                saved.append(in_other_thread(lambda: store.put([k], [block(1)])))

        slow.before_delete_many = save_again
        store.delete([k])
        assert saved == [[Status.OK]] and holds(fast, k)
        assert store.flush_dirty(10).dropped == 0
        assert holds(slow, k), "an acknowledged put made while the delete ran was never copied down"
    finally:
        store.close()


def test_a_delete_waiting_for_a_copy_that_evicts_below_and_demotes_ends():
    """The copy the delete waits for evicts from the middle tier: the demotion hook takes the
    write-behind lock and puts into the bottom tier while the delete waits (no lock cycle)."""
    fast, mid, slow = HookHost(8, "fast"), HookHost(2, "mid"), HookHost(64, "slow")
    store = TieredStore([fast, mid, slow], writebehind_batch_blocks=1)
    try:
        first = [key(i, b"first") for i in range(2)]
        for i, f in enumerate(first):  # mid is full of blocks nothing marked clean: evicted, demoted
            assert mid.put(f, block(i)) is Status.OK
        k = key(1)
        deleters = []
        mid.before_put_many = lambda: deleters.append(start_delete(store, [k]))
        assert store.put([k], [block(1)]) == [Status.OK]
        store.flush_dirty(10)
        deleters[0].join()
        assert not any(holds(t, k) for t in (fast, mid, slow))
        assert store.stats()["store"]["demotions"] >= 1, "the copy demoted nothing: not exercised"
        assert all(holds(mid, f) or holds(slow, f) for f in first)
    finally:
        store.close()


def test_close_while_a_delete_waits_for_a_stuck_copy_returns_and_the_delete_ends_after():
    fast, slow = HookHost(8, "fast"), HookHost(64, "slow")
    store = TieredStore([fast, slow], close_flush_timeout_s=0.1)
    k = key(1)
    gate, deleters = threading.Event(), []

    def stuck_copy():  # a lower tier that hangs until released
        deleters.append(start_delete(store, [k]))
        gate.wait(10)

    slow.before_put_many = stuck_copy
    assert store.put([k], [block(1)]) == [Status.OK]
    assert wait_until(lambda: deleters)
    closer = Started(store.close)
    closer.join(5)  # close does not wait for the delete (the flusher is left to finish)
    assert not deleters[0].done(), "the delete returned while its block's copy was in flight"
    gate.set()  # the copy meets closed tiers and fails: the delete goes on
    deleters[0].join(5)


def test_erasures_racing_write_behind_and_readers_under_load_stay_erased():
    """Real threads, no hooks: a writer puts a block and deletes it at once (the write-behind copy
    often still in flight), two readers hammer it. The lower tier's writes and deletes take 2 ms
    (a disk, a network tier); reads are a memcpy. Every deleted block must stay gone, and no get
    that started after delete() returned may serve it. (The late delete: about 1 block in 10 came
    back, and thousands of gets served erased blocks, in 5 s.)"""

    class SlowWrites(FaultyTier):
        def get(self, key, out):
            return self.inner.get(key, out)

    fast = HostTier(16 * BLOCK, BLOCK, prefault=False)
    fast.name = "fast"
    slow = SlowWrites(HostTier(4096 * BLOCK, BLOCK, prefault=False), Faults(delay_s=0.002))
    slow.name = "slow"
    store = TieredStore([fast, slow], writebehind_batch_blocks=1)
    current, erased, served_after, served = [0], set(), [], [0]
    stop = threading.Event()
    rng = random.Random(7)

    def reader():
        out = np.empty(BLOCK, np.uint8)
        while not stop.is_set():
            i = current[0]
            was_erased = i in erased
            if store.get([key(i, b"e")], [out]).loaded:
                served[0] += 1
                if was_erased:
                    served_after.append(i)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        end = time.monotonic() + 4
        i = 0
        while time.monotonic() < end:
            i += 1
            current[0] = i
            assert store.put([key(i, b"e")], [block(i)]) == [Status.OK]
            time.sleep(rng.random() * 0.003)
            store.delete([key(i, b"e")])
            erased.add(i)
            time.sleep(0.003)
    finally:
        stop.set()
        for t in readers:
            t.join(10)
    store.flush_dirty(10)
    back = sorted(j for j in erased if fast.contains(key(j, b"e")) or slow.contains(key(j, b"e")))
    stats = store.stats()
    store.close()
    # controls: the readers did read the blocks before their erasure, and copies raced the deletes
    assert served[0] > 0 and len(erased) >= 10
    assert stats["tiers"]["slow"]["puts"] > 0
    assert not back and not served_after, (
        f"{len(back)} of {len(erased)} erased blocks are back in a tier (e.g. {back[:5]}); "
        f"{len(served_after)} gets served a block whose delete() had returned")
