"""A sealed read torn under way by a delete, over a real Mooncake Store.

The Mooncake tier reads an EncryptedTier's blocks unhashed (their AES-GCM tags are the check). A
forced delete breaks the lease of a read under way and the engine reuses the freed memory at once:
the read delivers the block's genuine header and then another object's bytes, and by the time it
is judged the name may hold the block again (a later put, answered OK). Nobody tampered with
anything: the read is no verification failure, and that later block must stay.

The tear is made at the end of the read's engine call: the block is deleted and put again (real
engine calls, by this tier or by another process's tier of the tenant), and the second half of the
bytes the call delivered are overwritten, as a reuse of the freed memory mid-transfer delivers.

A real ``mooncake_master`` and holder processes on loopback (tests/tiers/mooncake_harness.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvtier.tiers.base import Status
from tests.tiers.mooncake_harness import both_transfer_paths, fresh_secret, make_tier, mooncake_available
from tests.tiers.test_mooncake_races import Hooked, once

pytestmark = pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))

BLOCK = 256 * 1024


@pytest.fixture(autouse=True, params=["batch calls", "sessions"])
def transfer_path(request, monkeypatch) -> str:
    return both_transfer_paths(request, monkeypatch)


def key(i: int) -> bytes:
    return (i + 9300).to_bytes(4, "big") * 8


def block(i: int) -> np.ndarray:
    return np.random.default_rng(9300 + i).integers(0, 256, BLOCK, dtype=np.uint8)


def sealed(tmp_path, secret: bytes):
    """An EncryptedTier over a MooncakeTier of tenant acme; two made with one ``secret`` (and one
    key store) are two processes of the tenant."""
    from kvtier.crypto.keyring import Keyring
    from kvtier.crypto.providers import StaticMasterKey
    from kvtier.tiers.encrypted import EncryptedTier

    keyring = Keyring(StaticMasterKey(b"m" * 32), tmp_path / "keys")
    inner = make_tier(tenant="acme", secret=secret, timeout_s=10.0)
    return EncryptedTier(inner, keyring, "acme", chunk_bytes=64 * 1024)


@pytest.fixture
def tiers(tmp_path):
    """(reader, another process's tier of the tenant); the reader's engine is hooked."""
    secret = fresh_secret()
    reader, other = sealed(tmp_path, secret), sealed(tmp_path, secret)
    real = reader.inner._engine
    reader.inner._engine = Hooked(real)
    yield reader, other
    reader.inner._engine = real
    reader.close()
    other.close()


def _tear(deleter, k: int, data: np.ndarray, torn: list[bool]):
    """A hook for the end of a read call: the block is deleted and put again, and the second half of
    the bytes the call delivered are another object's."""

    def tear(codes, names, ptrs, lens, offsets=None):
        assert deleter.delete(key(k)) is True
        assert deleter.put(key(k), data) is Status.OK  # stored again: OK
        total = sum(lens[0])
        starts = offsets[0] if offsets is not None else np.cumsum([0, *lens[0][:-1]]).tolist()
        for p, n, at in zip(ptrs[0], lens[0], starts):
            first = max(total // 2 - at, 0)
            if n > first:
                ctypes.memset(p + first, 0x5A, n - first)
        torn.append(True)

    return tear


@pytest.mark.parametrize("by", ["this tier", "another process"])
def test_a_sealed_read_torn_by_a_delete_is_no_verification_failure_and_keeps_the_block_put_since(
        tiers, by, transfer_path):
    reader, other = tiers
    deleter = reader if by == "this tier" else other
    k, data = 1, block(1)
    assert reader.put(key(k), data) is Status.OK
    torn: list[bool] = []
    call = "batch_get_into_multi_buffer_ranges" if transfer_path == "sessions" else "batch_get_into_multi_buffers"
    reader.inner._engine.after[call] = once(_tear(deleter, k, data, torn))
    out = np.zeros_like(data)
    first = reader.get_many([key(k)], [out])[0]  # (get_many reads unhashed; get reads hashed)
    assert torn, "premise: the read was not torn"
    assert first is not Status.CORRUPT and reader.stats.verify_failures == 0, \
        f"a read torn by a delete was judged a bad block ({first.name})"
    if first is Status.OK:  # (read again: the block put since)
        assert np.array_equal(out, data), "a torn read was served"
    out[:] = 0
    assert reader.get_many([key(k)], [out]) == [Status.OK] and np.array_equal(out, data), \
        "the block a put stored (OK) after the delete was removed on the torn read's word"
    assert other.get(key(k), out) is Status.OK and np.array_equal(out, data)


def test_a_sealed_block_its_tags_refuse_read_hashed_too_is_corrupt_and_removed(tiers):
    """The control: what the tier below serves whole and tagged (a holder of its secret stored it)
    but the AES-GCM tags refuse is bad, torn by nobody: CORRUPT, counted, and removed."""
    reader, _ = tiers
    assert reader.put_many([key(10), key(11)], [block(10), block(11)]) == [Status.OK] * 2
    # key 11's sealed block, stored by the tier below (its keyed tag valid) under key 10's name: only
    # the AES-GCM tags, which bind the block to its name, refuse it
    moved = np.empty(reader._sealed_size(BLOCK), np.uint8)
    assert reader.inner.get(reader.storage_name(key(11)), moved) is Status.OK
    name = reader.storage_name(key(10))
    assert reader.inner.delete(name) is True and reader.inner.put(name, moved) is Status.OK
    out = np.zeros(BLOCK, np.uint8)
    assert reader.get_many([key(10)], [out]) == [Status.CORRUPT]
    assert reader.stats.verify_failures == 1
    assert not np.array_equal(out, block(11)), "another block's bytes were returned"
    assert not reader.inner.contains(name), "a block that can never open was kept"
