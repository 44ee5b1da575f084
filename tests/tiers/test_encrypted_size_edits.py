"""A sealed block whose stored size was edited below the encryption is a miss, removed, and the next
tier serves the block (audit s26, D3).

The disk header, record check and xxh3 are unkeyed: someone who can write the disk directory cuts,
extends or drops a chunk of a sealed block and rewrites the header to the new size. The disk tier
then answers ``BAD_SIZE`` ("the caller's buffer differs"), which a store takes for the caller's
mistake, the same in every tier: it asked no lower tier, and the file was kept, so the block stayed
unloadable for good. A sealed reader derives the size it asks from the block's key: an inner
``BAD_SIZE`` is tampering, a ``CORRUPT`` miss.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import xxhash

from kvtier.core.payload import FLAG_CHECKSUM, FLAG_SEALED, pack_header, unpack_header
from kvtier.crypto import aead
from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import PAGE, round_up
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_records import FLAG_RECORD, BlockRecord, pack_record
from kvtier.tiers.encrypted import EncryptedTier
from kvtier.tiers.faulty import FaultyTier
from kvtier.tiers.streams import StreamingTier

BLOCK = 3 * 16384 + 100
CHUNK = 16384


def _key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "little")).digest()


def _plain(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


def _sealed_payload(disk: DiskTier, name: bytes) -> bytes:
    with open(disk.path_of(name), "rb") as f:
        raw = f.read()
    return raw[PAGE:PAGE + unpack_header(raw).payload_nbytes]


def _rewrite_sealed_file(disk: DiskTier, name: bytes, payload: bytes) -> None:
    """What a disk attacker does: a well-formed block file (header check, record check and xxh3 are
    all unkeyed) holding ``payload`` under ``name``."""
    head = pack_header(name, len(payload), xxhash.xxh3_128_digest(payload),
                       flags=FLAG_CHECKSUM | FLAG_SEALED | FLAG_RECORD) + pack_record(name, BlockRecord())
    body = head.ljust(PAGE, b"\0") + payload.ljust(round_up(len(payload)), b"\0")
    path = disk.path_of(name)
    with open(path + ".tmp", "wb") as f:
        f.write(body)
    os.replace(path + ".tmp", path)


EDITS = {
    "cut by one byte": lambda sealed: sealed[:-1],
    "extended": lambda sealed: sealed + b"\0" * 100,
    "last chunk dropped": lambda sealed: sealed[:aead.sealed_nbytes(2 * CHUNK, CHUNK)],
}


@pytest.fixture(params=["streamed", "staged"])
def two_sealed_disks(tmp_path, request):
    """A store of two sealed disk tiers, write-through: every block in both. The upper one sealed
    chunk by chunk as the disk streams them, or (over a tier that does not stream) staged whole,
    a batch in groups."""
    keyring = Keyring(StaticMasterKey(b"k" * 32), tmp_path / "keys", refresh_s=0.0)
    upper_disk = DiskTier(str(tmp_path / "upper"), 64 << 20)
    lower_disk = DiskTier(str(tmp_path / "lower"), 64 << 20)
    below = upper_disk if request.param == "streamed" else FaultyTier(upper_disk)  # (no faults: not streaming)
    upper = EncryptedTier(below, keyring, "acme", chunk_bytes=CHUNK, threads=1)
    lower = EncryptedTier(lower_disk, keyring, "acme", chunk_bytes=CHUNK, threads=1)
    upper.name, lower.name = "upper", "lower"
    store = TieredStore([upper, lower], write_mode="write-through", promote=False)
    keys = [_key(i) for i in range(3)]
    assert store.put(keys, [_plain(i) for i in range(3)]) == [Status.OK] * 3
    store.flush()
    assert all(upper.contains(k) and lower.contains(k) for k in keys)
    assert isinstance(upper.inner, StreamingTier) == (request.param == "streamed")
    yield store, upper, upper_disk, lower
    store.close()


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_sealed_block_whose_size_was_edited_is_a_miss_and_the_next_tier_serves_it(two_sealed_disks, edit):
    store, upper, upper_disk, lower = two_sealed_disks
    name = upper.storage_name(_key(0))
    sealed = _sealed_payload(upper_disk, name)
    assert len(sealed) == aead.sealed_nbytes(BLOCK, CHUNK)
    _rewrite_sealed_file(upper_disk, name, EDITS[edit](sealed))
    failures = upper.stats.verify_failures
    lower_hits = lower.stats.hits

    outs = [np.full(BLOCK, 0xAB, np.uint8) for _ in range(3)]
    result = store.get([_key(i) for i in range(3)], outs)
    assert result.statuses == [Status.OK] * 3, f"store answered {result.statuses} for blocks the lower tier holds"
    assert all(np.array_equal(out, _plain(i)) for i, out in enumerate(outs))
    assert not os.path.exists(upper_disk.path_of(name)), "the tampered file is kept"
    assert upper.stats.verify_failures == failures + 1  # counted as what it is
    # the control: only the tampered block came from below; the others were served by the upper tier
    assert lower.stats.hits == lower_hits + 1
    assert upper.contains(_key(1)) and upper.contains(_key(2))


@pytest.mark.parametrize("edit", list(EDITS))
def test_the_sealed_tier_itself_answers_corrupt_for_an_edited_size(two_sealed_disks, edit):
    """Every read path of the sealed tier: a batch (streamed lanes, or staged groups) and one block."""
    _, upper, upper_disk, _ = two_sealed_disks
    for i, read in enumerate((lambda k, o: upper.get_many([k], [o])[0], upper.get)):
        name = upper.storage_name(_key(i))
        _rewrite_sealed_file(upper_disk, name, EDITS[edit](_sealed_payload(upper_disk, name)))
        out = np.full(BLOCK, 0xAB, np.uint8)
        assert read(_key(i), out) is Status.CORRUPT
        assert not os.path.exists(upper_disk.path_of(name))
    out = np.full(BLOCK, 0xAB, np.uint8)  # the control: an untouched block still reads
    assert upper.get(_key(2), out) is Status.OK and np.array_equal(out, _plain(2))
