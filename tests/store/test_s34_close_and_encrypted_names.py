"""Audit s34 a7: an encrypted upper tier (``encrypt_host``) never forgets the block key of a block a
put is still storing (D1); a second ``TieredStore.close()`` waits for the first and returns its
report (D2); a lookup after close finds nothing, as a get then misses (D3). Audit s34 r2: a second
close on a thread the first one waits for returns at once instead of hanging both (r2 D1); lookups do not
hold background promotions off (r2 D2)."""

from __future__ import annotations

import hashlib
import logging
import threading
import time

import numpy as np
import pytest

from kvtier.crypto.aead import sealed_nbytes
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.store.tiered import FlushReport, PrefixMatch, TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.host import HostTier
from tests.store.test_erasure_races import Started, in_other_thread, wait_until

BLOCK = 4096
CHUNK = 4096
SLOT = sealed_nbytes(BLOCK, CHUNK)


def key(i: int) -> bytes:
    return hashlib.sha256(b"s34-%d" % i).digest()


def block(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251 + 1, np.uint8)


def read(store: TieredStore, i: int):
    """``key(i)``'s get status and whether the bytes read are ``block(i)``'s."""
    out = np.empty(BLOCK, np.uint8)
    status = store.get([key(i)], [out]).statuses[0]
    return status, status is Status.OK and np.array_equal(out, block(i))


# -- D1: the block keys of an encrypted upper tier -----------------------------------------------------
class GatedHost(HostTier):
    """A host tier whose write-behind flusher waits at ``flusher_gate`` before each batch (it asks
    ``expire()`` first), so that an eviction comes before the copy. ``hooks["before put"]`` (or
    ``"after put"``, ``"before delete"``, ``"after delete"``) runs once, when the next put (delete)
    begins or once it has stored (removed) its blocks."""

    def __init__(self, blocks: int) -> None:
        super().__init__(blocks * SLOT, SLOT, prefault=False)
        self.flusher_gate = threading.Event()
        self.hooks: dict = {}

    def expire(self) -> int:
        if threading.current_thread().name.startswith("kvtier-writebehind"):
            self.flusher_gate.wait(10)
        return super().expire()

    def _hooked(self, what: str, call):
        self._run_hook(f"before {what}")
        result = call()
        self._run_hook(f"after {what}")
        return result

    def _run_hook(self, name: str) -> None:
        hook = self.hooks.pop(name, None)
        if hook:
            hook()

    def put(self, *args, **kw):
        return self._hooked("put", lambda: super(GatedHost, self).put(*args, **kw))

    def put_many(self, *args, **kw):
        return self._hooked("put", lambda: super(GatedHost, self).put_many(*args, **kw))

    def delete(self, *args, **kw):
        return self._hooked("delete", lambda: super(GatedHost, self).delete(*args, **kw))


@pytest.fixture
def sealed_store(tmp_path):
    """Makes a write-behind store over a two-block encrypted host tier (``encrypt_host``), a plain
    host below: (store, encrypted tier, its host). ``per_key_tenant``: the tier names its tenant per
    key (``tenant_of``: each block put on its own) instead of one tenant (a batch put)."""

    def make(per_key_tenant: bool):
        keyring = Keyring(StaticMasterKey(b"\x22" * 32), tmp_path / "keys", refresh_s=0.0)
        host = GatedHost(2)
        tenancy = dict(tenant_of=lambda _key: "t") if per_key_tenant else dict(tenant="t")
        top = EncryptedTier(host, keyring, chunk_bytes=CHUNK, threads=1, **tenancy)
        top.name = "sealed-host"
        below = HostTier(64 * BLOCK, BLOCK, prefault=False)
        below.name = "below"
        made.append((TieredStore([top, below]), top, host))
        return made[-1]

    made: list = []
    yield make
    for store, _, host in made:
        host.flusher_gate.set()
        store.close()


@pytest.mark.parametrize("per_key_tenant", [False, True], ids=["batch", "per-key"])
def test_a_delete_run_while_a_put_is_under_way_does_not_lose_the_block_it_then_stores(
        sealed_store, per_key_tenant, caplog):
    store, top, host = sealed_store(per_key_tenant)
    host.hooks["before put"] = lambda: in_other_thread(lambda: store.delete([key(0)]))  # ordered before the put
    assert store.put([key(0)], [block(0)]) == [Status.OK]
    store.put([key(i) for i in range(1, 5)], [block(i) for i in range(1, 5)])  # evicts key 0, still dirty
    host.flusher_gate.set()
    store.flush_dirty(10)
    with caplog.at_level(logging.WARNING):
        assert read(store, 0) == (Status.OK, True), "an acknowledged block was lost on its eviction"
    assert "no known block key" not in caplog.text
    assert store.stats()["store"]["demotions"] >= 1


def test_a_delete_after_the_put_forgets_the_blocks_name(sealed_store):
    store, top, host = sealed_store(False)
    store.put([key(0)], [block(0)])
    assert top.storage_name(key(0)) in top._keys
    assert store.delete([key(0)]) >= 1
    assert top.storage_name(key(0)) not in top._keys
    host.flusher_gate.set()
    assert read(store, 0)[0] is Status.MISS


def test_a_delete_that_removes_the_block_a_put_under_way_stored_forgets_its_name(sealed_store):
    store, top, host = sealed_store(False)
    removed = []
    host.hooks["after put"] = lambda: removed.append(in_other_thread(lambda: store.delete([key(0)])))
    assert store.put([key(0)], [block(0)]) == [Status.OK]
    assert removed and removed[0] >= 1, "the delete removed the block the put stored"
    assert top.storage_name(key(0)) not in top._keys, "a name kept for a block no tier holds"
    host.flusher_gate.set()
    store.flush_dirty(10)
    assert read(store, 0)[0] is Status.MISS


def test_a_put_stored_while_a_delete_is_under_way_after_its_removal_is_still_demoted(sealed_store, caplog):
    store, top, host = sealed_store(False)
    store.put([key(0)], [block(0)])
    host.hooks["after delete"] = lambda: in_other_thread(lambda: store.put([key(0)], [block(0)]))
    store.delete([key(0)])  # its removal below first, then the put: ordered after the delete
    store.put([key(i) for i in range(1, 5)], [block(i) for i in range(1, 5)])  # evicts key 0, still dirty
    host.flusher_gate.set()
    store.flush_dirty(10)
    with caplog.at_level(logging.WARNING):
        assert read(store, 0) == (Status.OK, True), "a block put after the delete was lost on its eviction"
    assert "no known block key" not in caplog.text


def test_a_block_evicted_while_its_delete_is_under_way_is_no_lost_block(sealed_store, caplog):
    store, top, host = sealed_store(False)
    store.put([key(0)], [block(0)])
    evict = lambda: in_other_thread(lambda: store.put([key(1), key(2)], [block(1), block(2)]))  # noqa: E731
    host.hooks["before delete"] = evict  # the two-block host evicts key 0 before its removal
    with caplog.at_level(logging.WARNING):
        store.delete([key(0)])
    assert "no known block key" not in caplog.text, "an eviction during a delete was reported as a lost block"
    assert top.storage_name(key(0)) not in top._keys
    host.flusher_gate.set()
    store.flush_dirty(10)
    assert read(store, 0)[0] is Status.MISS


def test_a_failed_put_forgets_the_blocks_name(sealed_store):
    store, top, host = sealed_store(False)
    too_large = np.zeros(3 * BLOCK, np.uint8)  # sealed, larger than the two-block host
    assert store.put([key(7)], [too_large]) != [Status.OK]
    assert top.storage_name(key(7)) not in top._keys


def test_a_note_stays_when_a_put_of_the_name_begins_while_the_last_one_asks_the_tier_below():
    from kvtier.tiers.encrypted import _BlockKeysByName

    notes, name, block_key = _BlockKeysByName(), b"n" * 32, b"k" * 32
    notes.begin_puts([block_key], [name])
    notes.drop(name)  # a delete while the put is under way: settled when it ends
    answers = iter([False, True])  # not held when first asked; held once the other put stored it

    def held_below(names):
        answer = next(answers)
        if not answer:  # meanwhile another put of the name begins and stores the block
            notes.begin_puts([block_key], [name])
            notes.end_puts([name], [Status.OK], lambda _: pytest.fail("not the last put of the name"))
        return [answer]

    notes.end_puts([name], [Status.OK], held_below)
    assert notes.keys == {name: block_key}, "the note of a block stored by the later put was dropped"
    assert notes.drop(name) == block_key and notes.keys == {}  # no put under way: dropped at once


# -- D2: close() called twice at once ---------------------------------------------------------------
class GatedDisk(DiskTier):
    """A disk tier whose writes wait at ``gate``: a flush stays under way until it opens."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()

    def put_many(self, *args, **kw):
        self.gate.wait(10)
        return super().put_many(*args, **kw)


def test_a_second_close_waits_for_the_first_and_returns_its_report(tmp_path):
    disk = GatedDisk(tmp_path, 256 * BLOCK, direct_io=False)
    store = TieredStore([HostTier(128 * BLOCK, BLOCK, prefault=False), disk])
    keys = [key(i) for i in range(64)]
    store.put(keys, [block(i) for i in range(64)])
    try:
        closers = [Started(store.close), Started(store.close)]
        time.sleep(0.3)
        assert not any(c.done() for c in closers), "a close returned while the dirty blocks were being copied"
    finally:
        disk.gate.set()
    reports = [c.join() for c in closers]
    assert reports[0] == reports[1] and reports[0].flushed == 64 and reports[0].dropped == 0
    assert store.close() == reports[0]  # and so does a close after both
    assert sum(DiskTier(tmp_path, 256 * BLOCK, direct_io=False).contains(k) for k in keys) == 64


# -- D3: lookup after close -------------------------------------------------------------------------
def test_a_lookup_after_close_finds_nothing(tmp_path):
    store = TieredStore([HostTier(8 * BLOCK, BLOCK, prefault=False), DiskTier(tmp_path, 64 * BLOCK, direct_io=False)])
    keys = [key(i) for i in range(4)]
    store.put(keys, [block(i) for i in range(4)])
    assert store.lookup(keys).hit_blocks == 4
    store.close()
    assert store.lookup(keys) == PrefixMatch(0, [])
    assert store.get(keys, [np.empty(BLOCK, np.uint8) for _ in keys]).loaded == 0


# -- r2 D1: a second close on a thread the first close waits for ---------------------------------------
NOTHING_DONE = FlushReport(0, 0, 0.0)  # what a close returns that leaves the work to the first one


class HookedHost(HostTier):
    """A host tier that runs ``on_put()`` inside each put (a slow fastest tier, interrupted there)
    and makes ``put_many`` wait at ``put_gate`` (open unless cleared)."""

    def __init__(self) -> None:
        super().__init__(64 * BLOCK, BLOCK, prefault=False)
        self.on_put = lambda: None
        self.put_gate = threading.Event()
        self.put_gate.set()

    def put_many(self, *args, **kw):
        self.on_put()
        self.put_gate.wait(10)
        return super().put_many(*args, **kw)


@pytest.fixture
def hooked_store(tmp_path):
    """A write-behind store over a :class:`HookedHost` and a disk, blocks 0-7 put: (store, its host,
    ``on_disk()``: how many of blocks 0-8 the disk holds, read after the store closed)."""
    host = HookedHost()
    store = TieredStore([host, DiskTier(tmp_path, 256 * BLOCK, direct_io=False)])
    store.put([key(i) for i in range(8)], [block(i) for i in range(8)])

    def on_disk() -> int:
        disk = DiskTier(tmp_path, 256 * BLOCK, direct_io=False)
        try:
            return sum(disk.contains(key(i)) for i in range(9))
        finally:
            disk.close()

    yield store, host, on_disk
    host.put_gate.set()


def closed_cleanly(first: Started) -> bool:
    """Whether the first close ended (within a few seconds) having dropped no dirty block."""
    return first.join(5).dropped == 0


def start_first_close(store: TieredStore) -> Started:
    """A close on another thread (an engine's shutdown hook), once it has begun."""
    first = Started(store.close)
    assert wait_until(lambda: store._closed, 5)
    return first


def test_a_close_inside_reading_while_the_first_close_waits_for_that_read_returns_at_once(hooked_store):
    store, _, on_disk = hooked_store
    seen = {}

    def loader():  # a load of several gets gives up and shuts the store down too
        with store.reading():
            seen["first"] = start_first_close(store)
            seen["second"] = store.close()

    Started(loader).join(5)
    assert seen["second"] == NOTHING_DONE
    assert closed_cleanly(seen["first"]), "the first close did not go on once the read ended"
    assert on_disk() == 8


def test_a_close_run_inside_a_get_while_the_first_close_waits_for_that_get_returns_at_once(hooked_store):
    store, _, on_disk = hooked_store
    seen = {}

    def on_ready(_indices, _payloads):  # a signal handler runs here so, on the thread inside the get
        if "second" not in seen:
            seen["first"] = start_first_close(store)
            seen["second"] = store.close()

    outs = [np.empty(BLOCK, np.uint8) for _ in range(8)]
    assert Started(lambda: store.get([key(i) for i in range(8)], outs, on_ready=on_ready)).join(5).loaded == 8
    assert seen["second"] == NOTHING_DONE
    assert closed_cleanly(seen["first"]) and on_disk() == 8


def test_a_close_run_inside_a_put_while_the_first_close_waits_for_that_put_returns_at_once(hooked_store):
    store, host, on_disk = hooked_store
    seen = {}

    def interrupt_the_put():  # a signal handler runs here so, on the thread inside the put
        host.on_put = lambda: None
        seen["first"] = start_first_close(store)
        seen["second"] = store.close()

    host.on_put = interrupt_the_put
    assert Started(lambda: store.put([key(8)], [block(8)])).join(5) == [Status.OK]
    assert seen["second"] == NOTHING_DONE
    assert closed_cleanly(seen["first"])
    assert on_disk() == 9, "the block the put acknowledged was not copied down"


def test_a_close_from_an_async_jobs_done_callback_during_the_first_close_returns_at_once(hooked_store):
    store, host, on_disk = hooked_store
    seen = {}
    callback_done = threading.Event()

    def close_on_done(_future):  # runs on the store's I/O thread, which the first close joins
        seen["second"] = store.close()
        callback_done.set()

    host.put_gate.clear()
    job = store.put_async([key(8)], [block(8)])
    job.add_done_callback(close_on_done)  # the job waits at the gate: not done, so run by its thread
    first = start_first_close(store)
    host.put_gate.set()
    assert callback_done.wait(5), "the close in the done-callback hung"
    assert seen["second"] == NOTHING_DONE
    assert closed_cleanly(first) and on_disk() == 9


def test_a_second_close_on_a_thread_the_first_does_not_wait_for_still_waits_for_it(hooked_store):
    store, host, on_disk = hooked_store
    host.put_gate.clear()
    putter = Started(lambda: store.put([key(8)], [block(8)]))  # holds the first close up
    first = start_first_close(store)
    second = Started(store.close)
    time.sleep(0.3)
    assert not second.done(), "a close on an unrelated thread returned before the first had ended"
    host.put_gate.set()
    assert putter.join(5) == [Status.OK]
    assert second.join(5) == first.join(5) and closed_cleanly(first)
    assert on_disk() == 9


# -- r2 D2: lookups and background promotions --------------------------------------------------------
def test_background_promotions_run_while_other_threads_call_lookup_back_to_back(tmp_path):
    disk = DiskTier(tmp_path, 256 * BLOCK, direct_io=False)
    keys = [key(i) for i in range(32)]
    disk.put_many(keys, [block(i) for i in range(32)])
    store = TieredStore([HostTier(64 * BLOCK, BLOCK, prefault=False), disk])
    stop = threading.Event()

    def poll():  # a scheduler polling prefix hits over a long waiting queue
        while not stop.is_set():
            store.lookup([key(100 + i) for i in range(8)])

    pollers = [Started(poll) for _ in range(2)]
    try:
        assert store.get(keys, [np.empty(BLOCK, np.uint8) for _ in keys], promote_in_background=True).loaded == 32
        assert store.wait_promotions(5), "lookups held the background promotions off"
    finally:
        stop.set()
        for poller in pollers:
            poller.join(5)
    assert store.stats()["store"]["promotions"] == 32
    assert store.lookup(keys) == PrefixMatch(32, [store.tiers[0].name] * 32)
    store.close()


class GatedLookupHost(HostTier):
    """A host tier whose ``lookup_prefix`` waits at ``gate`` once ``entered`` is set."""

    def __init__(self) -> None:
        super().__init__(8 * BLOCK, BLOCK, prefault=False)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def lookup_prefix(self, keys) -> int:
        self.entered.set()
        self.gate.wait(10)
        return super().lookup_prefix(keys)


def test_close_still_waits_for_a_lookup_under_way():
    host = GatedLookupHost()
    store = TieredStore([host])
    store.put([key(0)], [block(0)])
    lookup = Started(lambda: store.lookup([key(0)]))
    assert host.entered.wait(5)
    closer = Started(store.close)
    time.sleep(0.3)
    assert not closer.done(), "close closed the tiers under a lookup under way"
    host.gate.set()
    assert lookup.join(5) == PrefixMatch(1, [host.name])
    closer.join(5)
