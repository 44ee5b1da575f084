"""A keyring across a fork, and a tenant's first use racing a shred in another process.

A lease is one process's share of a data key's AES-GCM budget: a forked child must take its own
from the store, never spend its parent's. A first use creates the tenant's key file and reads it
back; a shred elsewhere in between means creating the keys again, never a None dereferenced.
(From audit s27 crypto2, K1 and K2.)
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections import Counter

import numpy as np
import pytest

from kvtier.core.keys import BlockKey
from kvtier.crypto import aead
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.host import HostTier

MASTER = StaticMasterKey(bytes(range(32)))
TENANT = "acme"

# -- K1: a fork must not duplicate the parent's lease ------------------------------------------
CHUNK = 64
PLAIN = 3 * CHUNK  # 3 AES-GCM invocations per block


def _seal_blocks(tier: EncryptedTier, host: HostTier, tag: int, count: int) -> list[tuple[int, str, int]]:
    """Seal ``count`` blocks through the real tier; what each sealed header says: (epoch, key id, chunks)."""
    out = np.empty(aead.sealed_nbytes(PLAIN, CHUNK), np.uint8)
    made = []
    for i in range(count):
        key = BlockKey(tag.to_bytes(8, "big") + i.to_bytes(24, "big"))
        assert tier.put(key, np.full(PLAIN, i % 251, np.uint8)).name == "OK"
        name = tier.storage_name(key)
        assert host.get(name, out).name == "OK"
        header = aead.parse_header(out)
        made.append((header.epoch, header.key_id.hex(), header.n_chunks))
        host.delete(name)
    return made


def test_a_forked_child_never_spends_the_budget_its_parent_was_granted(tmp_path):
    # A process (an engine, a pre-forking server) loads its store and seals; then it forks a worker.
    keys = Keyring(MASTER, tmp_path / "keys", rotate_after=1 << 20, lease_size=64)
    host = HostTier(64 * 4096, 4096, prefault=False)
    tier = EncryptedTier(host, keys, TENANT, chunk_bytes=CHUNK, threads=1, streams=1)
    made = _seal_blocks(tier, host, 1, 1)  # takes a lease of 64 encryptions, 61 left
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()

    def child() -> None:  # (fork: the closure is not pickled)
        queue.put(_seal_blocks(tier, host, 2, 20))

    proc = ctx.Process(target=child)
    proc.start()
    made += _seal_blocks(tier, host, 3, 20)  # parent: 60 more encryptions
    made += queue.get(timeout=20)  # child: 60 more
    proc.join(20)
    assert proc.exitcode == 0
    sealed = Counter()
    for epoch, key_id, chunks in made:
        sealed[(epoch, key_id)] += chunks
    leased = keys.leased(TENANT)
    over = {e: (n, leased.get(e, 0)) for (e, _), n in sealed.items() if n > leased.get(e, 0)}
    # on the old code: {0: (121, 64)}: parent and child both used the same 61-encryption lease
    assert not over, f"encryptions made under a key beyond what the store ever leased (made, leased): {over}"


def _in_child(body) -> int:
    """Run ``body`` in a forked child (os.fork: the fork hooks run) under a 10 s alarm; its exit status."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            signal.alarm(10)
            code = 0 if body() else 2
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_forked_child_takes_a_lease_of_its_own_that_follows_its_parents(tmp_path):
    keys = Keyring(MASTER, tmp_path / "keys", refresh_s=0.0, lease_size=10)
    keys.key_for_write(TENANT, 3)
    parent = keys.lease(TENANT)
    assert (parent.start, parent.end, parent.remaining) == (0, 10, 7)
    result = tmp_path / "child"

    def child() -> bool:
        fresh = keys.lease(TENANT) is None  # the parent's is not the child's
        keys.key_for_write(TENANT, 2)
        lease = keys.lease(TENANT)
        result.write_text(f"{fresh} {lease.start} {lease.end} {lease.remaining}")
        return True

    assert _in_child(child) == 0
    assert result.read_text() == "True 10 20 8"  # granted after the parent's, none of it shared
    assert keys.lease(TENANT) == parent  # the parent keeps its own
    assert keys.leased(TENANT) == {0: 20}


def test_a_child_forked_while_another_thread_holds_the_keyring_lock_can_use_it(tmp_path):
    keys = Keyring(MASTER, tmp_path / "keys", refresh_s=0.0)
    keys.key_for_write(TENANT)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with keys._lock:
            held.set()
            release.wait(20)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(10)
        # the holding thread does not exist in the child: without a new lock it would wait for good
        status = _in_child(lambda: keys.key_for_write(TENANT).epoch == 0)
    finally:
        release.set()
        thread.join(10)
    # (on the old code the child waits for the lock until its 10 s alarm ends it)
    assert status == 0, f"the child's keyring use ended with {status}"


def test_a_keyring_dropped_before_a_fork_is_no_trouble_to_the_child(tmp_path):
    Keyring(MASTER, tmp_path / "gone").key_for_write(TENANT)  # collected: the hook holds it weakly
    keys = Keyring(MASTER, tmp_path / "keys")
    assert _in_child(lambda: keys.current_epoch(TENANT) == 0) == 0


# -- K2: a first use racing a shred elsewhere ----------------------------------------------------
def _shred_at_read(me: Keyring, other: Keyring, at: set[int]) -> list:
    """``other`` (another process) shreds the tenant just before ``me``'s ``_read_doc`` calls
    numbered in ``at`` (1-based), which must be reads made without the tenant's lock (a shred
    there would wait for the lock ``me`` holds: a deadlock, not a race)."""
    original, calls = me._read_doc, []

    def read(tenant):
        calls.append(tenant)
        if len(calls) in at:
            other.shred_tenant(tenant)
        return original(tenant)

    me._read_doc = read
    return calls


def test_a_first_write_racing_a_shred_elsewhere_gets_keys_not_an_attribute_error(tmp_path):
    me = Keyring(MASTER, tmp_path / "keys", refresh_s=0.0)
    other = Keyring(MASTER, tmp_path / "keys", refresh_s=0.0)
    calls = _shred_at_read(me, other, {3})  # after me created the file (lock released), before its read-back
    block = BlockKey(b"\x01" * 32)
    try:
        name = me.storage_key(TENANT, block)  # what EncryptedTier.put/get computes first
    except AttributeError as exc:
        pytest.fail(f"a PUT of a new tenant racing an erase elsewhere raised {exc!r}")
    assert len(calls) >= 3  # the race was placed
    assert name == Keyring(MASTER, tmp_path / "keys").storage_key(TENANT, block)  # the keys re-created


@pytest.mark.parametrize("use", ["index_key", "current_epoch", "key_for_write"])
def test_every_creating_use_survives_shreds_around_the_creation(tmp_path, use):
    me = Keyring(MASTER, tmp_path / "keys", refresh_s=0.0)
    other = Keyring(MASTER, tmp_path / "keys", refresh_s=0.0)
    if use == "key_for_write":
        me.key_for_write(TENANT)  # a lease held, then the tenant shredded elsewhere
        other.shred_tenant(TENANT)
    # reads 1, 3, 5, 7 are made without the lock, 2, 4, 6 under it (creating the file): shredded
    # at both read-backs, the keys are created a third time
    calls = _shred_at_read(me, other, {3, 5})
    try:
        getattr(me, use)(TENANT)
    except AttributeError as exc:
        pytest.fail(f"{use} racing shreds elsewhere raised {exc!r}")
    assert len(calls) >= 7  # both races were placed
    fresh = Keyring(MASTER, tmp_path / "keys")
    assert me.index_key(TENANT) == fresh.index_key(TENANT)  # what it uses is what the store holds
