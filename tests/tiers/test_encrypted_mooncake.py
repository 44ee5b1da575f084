"""EncryptedTier over a real Mooncake Store: sealed batches land in staging registered with the
Mooncake tier (no copy out of its own staging) and are authenticated once, by their AES-GCM tags;
a read that overran its deadline never writes into a buffer a later read uses.

A real ``mooncake_master`` and holder processes on loopback (tests/tiers/mooncake_harness.py)."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from kvtier.core.payload import HEADER_NBYTES
from kvtier.tiers.base import Status
from tests.tiers.mooncake_harness import both_transfer_paths, make_tier, mooncake_available, start_cluster

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

BLOCK = 256 * 1024


@pytest.fixture(autouse=True, params=["batch calls", "sessions"])
def transfer_path(request, monkeypatch) -> str:
    return both_transfer_paths(request, monkeypatch)


def key(i: int) -> bytes:
    return (i + 9100).to_bytes(4, "big") * 8


def block(i: int) -> np.ndarray:
    return np.random.default_rng(9100 + i).integers(0, 256, BLOCK, dtype=np.uint8)


def sealed_tier(tmp_path, cluster=None, **kw):
    from kvtier.crypto.keyring import Keyring
    from kvtier.crypto.providers import StaticMasterKey
    from kvtier.tiers.encrypted import EncryptedTier

    keyring = Keyring(StaticMasterKey(b"m" * 32), tmp_path / "keys")
    return EncryptedTier(make_tier(cluster, tenant="acme", **kw), keyring, "acme", chunk_bytes=64 * 1024)


def poisoned(n: int) -> list[np.ndarray]:
    return [np.full(BLOCK, 0xA5, np.uint8) for _ in range(n)]


def test_sealed_batches_are_received_in_registered_staging_and_opened_there(tmp_path, monkeypatch):
    enc = sealed_tier(tmp_path)
    staging = enc.inner._staging
    taken: list[int] = []  # sizes of the Mooncake tier's own staging buffers taken
    take = staging.take
    monkeypatch.setattr(staging, "take", lambda nbytes: taken.append(nbytes) or take(nbytes))
    try:
        assert enc._direct, "EncryptedTier should read straight into staging registered with a MooncakeTier"
        keys = [key(i) for i in range(4)]
        assert enc.put_many(keys, [block(i) for i in range(4)]) == [Status.OK] * 4
        # A new buffer's registration runs on a thread of its own, waited for only briefly: on a loaded
        # host the first read of a new buffer may go through staging. Once registered, none does.
        assert enc.get_many(keys, poisoned(4)) == [Status.OK] * 4
        assert enc._buffers._registrar.settle(30), "the staging's registration never ran"
        outs = poisoned(4)
        taken.clear()
        assert enc.get_many(keys, outs) == [Status.OK] * 4
        assert all(np.array_equal(o, block(i)) for i, o in enumerate(outs))
        # no block-sized staging of the Mooncake tier's own was used: header rows only
        assert taken and max(taken) < BLOCK, taken
        # positive control: the same batch through an unregistered buffer goes through that staging
        sealed = [np.empty(enc._sealed_size(BLOCK), np.uint8) for _ in keys]
        assert enc.inner.get_many([enc.storage_name(k) for k in keys], sealed) == [Status.OK] * 4
        assert max(taken) >= BLOCK
    finally:
        enc.close()


def _object(engine, name: str) -> np.ndarray:
    size = engine.get_size(name)
    obj = np.empty(size, np.uint8)
    assert engine.get_into(name, obj.ctypes.data, size) == size
    return obj


@pytest.mark.parametrize("forgery", ["flipped byte", "moved under this block's header"])
def test_a_tampered_sealed_block_read_unhashed_is_a_miss_and_is_removed(tmp_path, forgery):
    """The Mooncake tier does not hash a sealed payload: its AES-GCM tags must catch what its
    keyed tag would have. A payload byte flipped under the genuine header; and another block's
    genuine sealed payload put under this block's genuine header (the Mooncake header check
    passes: only the tags, which bind the sealed block to its keyed name, can catch it)."""
    enc = sealed_tier(tmp_path)
    try:
        keys = [key(10), key(11), key(12)]
        assert enc.put_many(keys, [block(10), block(11), block(12)]) == [Status.OK] * 3
        engine = enc.inner._engine
        name = enc.inner.storage_name(enc.storage_name(key(10)))
        forged = _object(engine, name)
        if forgery == "flipped byte":
            forged[HEADER_NBYTES + 5000] ^= 0x01
        else:
            other = _object(engine, enc.inner.storage_name(enc.storage_name(key(11))))
            forged[HEADER_NBYTES:] = other[HEADER_NBYTES:]
        assert engine.upsert_from(name, forged.ctypes.data, forged.nbytes) == 0
        failures = enc.stats.verify_failures
        outs = poisoned(3)
        assert enc.get_many(keys, outs) == [Status.CORRUPT, Status.OK, Status.OK]
        assert enc.stats.verify_failures == failures + 1
        assert np.array_equal(outs[1], block(11)) and np.array_equal(outs[2], block(12))
        assert not np.array_equal(outs[0], block(11)), "another block's bytes were returned"
        assert not enc.contains(key(10)), "a block that can never open is still offered"
        assert engine.is_exist(name) == 0, "a block that can never open was kept (a put would bring it back)"
        assert enc.get_many([key(10)], poisoned(1)) == [Status.MISS]
        # control: a fresh put heals it
        assert enc.put(key(10), block(10)) is Status.OK
        out = poisoned(1)
        assert enc.get_many([key(10)], out) == [Status.OK] and np.array_equal(out[0], block(10))
    finally:
        enc.close()


def test_a_sealed_read_that_overruns_quarantines_its_staging_until_the_late_read_ends(tmp_path):
    """A read of a frozen holder overruns; the engine may land the bytes in the group's registered
    staging buffer later. That buffer must not be handed to another read until the late read has
    ended, or its late bytes would tear a later block (which would then fail its tags and be deleted
    as tampered). Control: the buffer of a read that did not overrun is reused at once."""
    cluster = start_cluster(holders=1, segment_bytes=64 << 20)
    enc = sealed_tier(tmp_path, cluster, timeout_s=0.5, max_backoff_s=0.2)
    inner, pool = enc.inner, enc._buffers
    try:
        keys = [key(20 + i) for i in range(4)]
        outs = poisoned(4)
        deadline = time.monotonic() + 20  # a fresh cluster's first calls may fail (see test_mooncake_fastpath)
        while (enc.put_many(keys, [block(20 + i) for i in range(4)]) != [Status.OK] * 4
               or enc.get_many(keys, outs) != [Status.OK] * 4):
            assert time.monotonic() < deadline, f"the fresh cluster never served: {inner.last_error}"
            time.sleep(0.2)
        # control: after a read that ended in time its buffer is back in the pool, not quarantined
        assert pool._free and not pool._quarantined
        used = {id(b) for b in pool._free}
        cluster.signal_holder(0, signal.SIGSTOP)
        try:
            assert Status.OK not in enc.get_many(keys, poisoned(4))
            assert inner.late_direct_reads >= 1, "the overrun read was not counted"
            assert any(id(b) in used for b in pool._quarantined), "the overrun read's staging was not quarantined"
            assert not any(id(b) in {id(q) for q in pool._quarantined} for b in pool._free)
            fresh = pool.take(enc._sealed_size(BLOCK) * 4)
            assert id(fresh) not in {id(q) for q in pool._quarantined}, "a quarantined buffer was handed out"
            pool.give(fresh)
        finally:
            cluster.signal_holder(0, signal.SIGCONT)
        assert inner.quiesce(timeout_s=30), "the late read never ended"
        deadline = time.monotonic() + 20
        outs = poisoned(4)
        while enc.get_many(keys, outs) != [Status.OK] * 4:
            assert time.monotonic() < deadline, f"never served again: {inner.last_error}"
            time.sleep(0.2)
        assert all(np.array_equal(o, block(20 + i)) for i, o in enumerate(outs))
        assert enc.stats.verify_failures == 0, "a correct block failed its tags"
        assert not pool._quarantined, "the quarantined buffer never came back once the late read ended"
    finally:
        enc.close()
        cluster.stop()


def test_a_forged_unknown_epoch_does_not_poison_a_key_for_good(tmp_path):
    """Anyone on the fleet can overwrite an object (Mooncake authenticates nobody): the genuine bytes
    with the sealed header's epoch set to one no key store holds. The read keeps it unread (a missing
    key proves nothing) and the engine keeps an existing object on put: every later put answered OK
    and the key missed for good. A put of such a key now replaces it."""
    enc = sealed_tier(tmp_path)
    data = block(40)
    try:
        assert enc.put(key(40), data) is Status.OK
        engine = enc.inner._engine
        name = enc.inner.storage_name(enc.storage_name(key(40)))
        size = engine.get_size(name)
        obj = np.empty(size, np.uint8)
        assert engine.get_into(name, obj.ctypes.data, size) == size
        obj[HEADER_NBYTES + 8:HEADER_NBYTES + 12] = np.frombuffer((77).to_bytes(4, "little"), np.uint8)  # epoch
        assert engine.upsert_from(name, obj.ctypes.data, size) == 0
        out = poisoned(1)[0]
        assert enc.get_many([key(40)], [out]) == [Status.MISS]  # unreadable here: a miss
        assert enc.put_many([key(40)], [data]) == [Status.OK]  # the genuine writer stores it again
        out = poisoned(1)[0]
        assert enc.get_many([key(40)], [out]) == [Status.OK] and np.array_equal(out, data), \
            f"the key stays poisoned (the forged object kept: {engine.is_exist(name) == 1})"
        # control: an untouched neighbour stored twice still hits (only names a read found
        # unreadable are replaced)
        assert enc.put(key(41), block(41)) is Status.OK and enc.put(key(41), block(41)) is Status.OK
        assert enc.get_many([key(41)], poisoned(1)) == [Status.OK]
    finally:
        enc.close()
