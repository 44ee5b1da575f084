"""A block sealed under a key another process made: reload the key store once, else a miss -- never a delete.

Two writers/readers as two processes would be: separate ``Keyring`` objects over one
on-disk key store (or a reader whose store lacks the epoch), separate ``EncryptedTier``
objects over a shared disk directory, one real ``kvtier serve``, or one host pool.
"""

from __future__ import annotations

import shutil
import uuid

import numpy as np
import pytest

from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.remote import RemoteTier
from tests.server.harness import TOKENS, shared_server

B = 256 * 1024
MASTER = StaticMasterKey(bytes(range(32)))
TENANT = "acme"
STALE = 3600.0  # a reader that would not look at its key store again for an hour on its own


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, B, dtype=np.uint8)


class Shared:
    """What two processes share: a disk directory, a server namespace, or (one process) a host pool."""

    def __init__(self, kind: str, tmp_path) -> None:
        self.kind = kind
        self.tmp_path = tmp_path
        self.namespace = f"elsewhere-{uuid.uuid4().hex[:12]}"
        self.host = HostTier(16 * (B + 8192), B + 8192) if kind == "host" else None

    def tier(self):
        """A fresh view of the shared storage, as a process of its own would open it."""
        if self.kind == "disk":
            return DiskTier(self.tmp_path / "blocks", 64 * B)
        if self.kind == "remote":
            return RemoteTier(shared_server().tcp_url, TOKENS["acme"], namespace=self.namespace, timeout_s=5)
        return self.host


@pytest.fixture(params=["disk", "remote", "host"])
def shared(request, tmp_path):
    return Shared(request.param, tmp_path)


def _encrypted(inner, keyring) -> EncryptedTier:
    return EncryptedTier(inner, keyring, TENANT, threads=1)


def test_a_key_rotated_elsewhere_is_loaded_and_the_block_hits(shared, tmp_path):
    store = tmp_path / "keys"
    writer_keys = Keyring(MASTER, store, refresh_s=STALE)
    reader_keys = Keyring(MASTER, store, refresh_s=STALE)
    writer_keys.key_for_write(TENANT)
    assert reader_keys.epochs(TENANT) == [0]  # the reader has loaded the store: epoch 0 only
    writer = _encrypted(shared.tier(), writer_keys)
    reader = _encrypted(shared.tier(), reader_keys)
    key = b"r" * 32

    assert writer_keys.rotate(TENANT) == 1  # elsewhere: a rotation, then a write under epoch 1
    assert writer.put(key, block(1)) is Status.OK
    out = np.zeros(B, np.uint8)
    assert reader.get(key, out) is Status.OK, "the reader should reload its key store and open the block"
    assert np.array_equal(out, block(1))
    assert reader_keys.missing_key_reloads == 1
    assert reader_keys.epochs(TENANT) == [0, 1]


def test_a_key_the_store_lacks_is_a_miss_and_the_block_is_kept(shared, tmp_path):
    writer_store, reader_store = tmp_path / "keys", tmp_path / "keys-copy"
    writer_keys = Keyring(MASTER, writer_store, refresh_s=0.0)
    writer_keys.key_for_write(TENANT)
    shutil.copytree(writer_store, reader_store)  # the reader's store stops before the rotation
    reader_keys = Keyring(MASTER, reader_store, refresh_s=0.0)
    writer = _encrypted(shared.tier(), writer_keys)
    reader = _encrypted(shared.tier(), reader_keys)
    old_key, new_key = b"o" * 32, b"n" * 32
    assert writer.put(old_key, block(0)) is Status.OK  # epoch 0: both stores hold it

    writer_keys.rotate(TENANT)
    assert writer.put(new_key, block(1)) is Status.OK  # epoch 1: only the writer's store
    out = np.zeros(B, np.uint8)
    for _ in range(5):
        assert reader.get(new_key, out) is Status.MISS
        assert reader.get_many([new_key], [out]) == [Status.MISS]
    assert reader_keys.missing_key_reloads == 1, "a missing key re-reads the store at most once a second"
    assert reader.stats.verify_failures == 0 and writer.stats.verify_failures == 0

    # the block is still there: the writer (and any reader with the key) opens it
    assert writer.inner.contains(writer.storage_name(new_key))
    assert writer.get(new_key, out) is Status.OK and np.array_equal(out, block(1))
    # positive control for the reader: a block under a key it holds opens
    assert reader.get(old_key, out) is Status.OK and np.array_equal(out, block(0))


def test_a_block_tampered_under_a_key_we_hold_is_still_deleted(tmp_path):
    """The one case that deletes: the tag fails under a key this process has."""
    keys = Keyring(MASTER, tmp_path / "keys", refresh_s=0.0)
    disk = DiskTier(tmp_path / "blocks", 64 * B)
    tier = _encrypted(disk, keys)
    key = b"t" * 32
    assert tier.put(key, block(3)) is Status.OK
    name = tier.storage_name(key)
    path = disk.path_of(name)
    raw = bytearray(open(path, "rb").read())
    raw[-B // 2] ^= 0x01  # in the sealed payload, past the file's header
    with open(path, "r+b") as f:
        f.write(raw)
    out = np.zeros(B, np.uint8)
    assert tier.get(key, out) is Status.CORRUPT
    assert not disk.contains(name), "a block that can never verify is dropped"
    assert keys.missing_key_reloads == 0
