"""Audit s34 a7: an encrypted upper tier (``encrypt_host``) never forgets the block key of a block a
put is still storing (D1); a second ``TieredStore.close()`` waits for the first and returns its
report (D2); a lookup after close finds nothing, as a get then misses (D3)."""

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
from kvtier.store.tiered import PrefixMatch, TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.host import HostTier
from tests.store.test_erasure_races import Started, in_other_thread

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
