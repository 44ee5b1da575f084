"""The disk tier's streamed (sealed) payloads: written as sealed, read as opened, kept apart from plain reads."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier.crypto.keyring import Keyring
from kvtier.crypto.providers import StaticMasterKey
from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import CHUNK, PAGE, round_up
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.encrypted import EncryptedTier

#: several staging chunks and a partial page: the helper-overlapped path, not the inline one
BIG = 2 * CHUNK + 3 * PAGE + 123
SMALL = 40 * 1024 + 7


def data(i: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
def keyring(tmp_path):
    return Keyring(StaticMasterKey(os.urandom(32)), tmp_path / "keys", refresh_s=0.0)


class Source:
    """A payload made of given pieces (claiming ``nbytes``, which may be a lie)."""

    def __init__(self, pieces: list[bytes], nbytes: int | None = None) -> None:
        self._pieces = pieces
        self.nbytes = sum(map(len, pieces)) if nbytes is None else nbytes

    def pieces(self):
        for p in self._pieces:
            yield memoryview(p)


class Sink:
    """Takes the stored bytes in views of ``step`` bytes (no verification)."""

    def __init__(self, nbytes: int, step: int = 4096, stop_after: int | None = None) -> None:
        self.nbytes = nbytes
        self.data = bytearray(nbytes if stop_after is None else stop_after)
        self._step = step

    def pieces(self):
        view = memoryview(self.data)
        for off in range(0, len(view), self._step):
            yield view[off : off + self._step]
        return None


@pytest.mark.parametrize("nbytes", [SMALL, BIG])
def test_sealed_blocks_round_trip_and_files_hold_only_ciphertext(tmp_path, keyring, nbytes):
    disk = DiskTier(tmp_path / "d", 64 << 20)
    tier = EncryptedTier(disk, keyring, "acme", chunk_bytes=64 * 1024)
    keys = [key(i) for i in range(3)]
    assert tier.put_many(keys, [data(i, nbytes) for i in range(3)]) == [Status.OK] * 3
    outs = [np.zeros(nbytes, np.uint8) for _ in keys]
    assert tier.get_many(keys, outs) == [Status.OK] * 3
    assert all(np.array_equal(o, data(i, nbytes)) for i, o in enumerate(outs))
    for i, k in enumerate(keys):
        path = disk.path_of(tier.storage_name(k))
        assert os.path.getsize(path) == PAGE + round_up(tier._sealed_size(nbytes))
        assert data(i, nbytes).tobytes()[:512] not in open(path, "rb").read()
    disk.check_integrity(deep=True)


def test_a_plain_read_refuses_a_sealed_file_and_a_sink_rejects_a_plain_one(tmp_path, keyring):
    disk = DiskTier(tmp_path / "d", 64 << 20)
    tier = EncryptedTier(disk, keyring, "acme", chunk_bytes=64 * 1024)
    assert tier.put(key(1), data(1, SMALL)) is Status.OK
    name = tier.storage_name(key(1))
    failures = disk.stats.verify_failures
    assert disk.get(name, np.zeros(tier._sealed_size(SMALL), np.uint8)) is Status.CORRUPT
    assert disk.stats.verify_failures == failures + 1 and not disk.contains(name)

    # A plain block under a name the encrypted tier reads: the AEAD turns it away.
    plain = data(2, tier._sealed_size(SMALL))
    assert disk.put(tier.storage_name(key(2)), plain) is Status.OK
    assert tier.get(key(2), np.zeros(SMALL, np.uint8)) is Status.CORRUPT
    assert not disk.contains(tier.storage_name(key(2)))


def test_a_tampered_sealed_file_is_a_miss_and_is_removed(tmp_path, keyring):
    disk = DiskTier(tmp_path / "d", 64 << 20)
    tier = EncryptedTier(disk, keyring, "acme", chunk_bytes=64 * 1024)
    assert tier.put_many([key(1), key(2)], [data(1, BIG), data(2, BIG)]) == [Status.OK] * 2
    path = disk.path_of(tier.storage_name(key(1)))
    with open(path, "r+b") as f:
        f.seek(PAGE + BIG // 2)
        byte = f.read(1)
        f.seek(PAGE + BIG // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    outs = [np.zeros(BIG, np.uint8) for _ in range(2)]
    assert tier.get_many([key(1), key(2)], outs) == [Status.CORRUPT, Status.OK]
    assert np.array_equal(outs[1], data(2, BIG))
    assert not os.path.exists(path)


@pytest.mark.parametrize("pieces, claimed", [([b"x" * 5000], 6000), ([b"x" * 5000, b"y" * 10], 5000)])
def test_a_source_that_breaks_its_word_publishes_nothing(tmp_path, pieces, claimed):
    disk = DiskTier(tmp_path / "d", 1 << 20)
    assert disk.put_streams([key(9)], [Source(pieces, claimed)]) == [Status.ERROR]
    assert not disk.contains(key(9)) and disk.used_bytes == 0
    assert not [p for p in (tmp_path / "d").rglob("*") if p.is_file()], "a temp file was left behind"
    disk.check_integrity(deep=True)
    # the tier goes on working
    assert disk.put_streams([key(9)], [Source([b"z" * 5000])]) == [Status.OK]


def test_streams_read_exactly_what_was_streamed_in(tmp_path):
    disk = DiskTier(tmp_path / "d", 64 << 20)
    blob = data(3, BIG).tobytes()
    pieces = [blob[i : i + 70_001] for i in range(0, len(blob), 70_001)]  # pieces across chunks and pages
    assert disk.put_streams([key(3)], [Source(pieces)]) == [Status.OK]
    sink = Sink(len(blob), step=100_003)
    assert disk.get_streams([key(3)], [sink]) == [Status.OK]
    assert bytes(sink.data) == blob
    # a sink that stops before the end of the block has not verified it
    assert disk.get_streams([key(3)], [Sink(len(blob), stop_after=len(blob) // 2)]) == [Status.CORRUPT]
    # ...nor one that expects another size (a miss, the file stays)
    assert disk.put_streams([key(4)], [Source(pieces)]) == [Status.OK]
    assert disk.get_streams([key(4)], [Sink(len(blob) + PAGE)]) == [Status.BAD_SIZE]
    assert disk.contains(key(4))
