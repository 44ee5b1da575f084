"""A disk tier sharing its directory with another instance (the peer) that removes a block this one
still indexes (deletes, evicts or expires it): the index is a cache of the directory, so a put,
put_many or contains of that block looks at its name (one lstat) before trusting the entry. A put
writes the block again (a put that said OK over nothing would tell write-behind, a demotion or the
server's spill that the block is on disk when no one can read it); contains answers False. A block
the peer left alone is still deduplicated without a read."""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import PAGE
from kvtier.tiers.disk import DiskTier

NB = 8192


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, NB, dtype=np.uint8)


def store(tier: DiskTier, how: str) -> None:
    """k(1) as a file of its own, or packed with k(2) in one extent."""
    if how == "packed":
        assert tier.put_many([k(1), k(2)], [data(1), data(2)]) == [Status.OK] * 2
    else:
        assert tier.put(k(1), data(1)) is Status.OK


def files(root) -> set[tuple[str, int]]:
    """(name, inode) of every file under ``root``: what a put that writes nothing leaves alone."""
    return {(name, os.lstat(os.path.join(d, name)).st_ino) for d, _, names in os.walk(root) for name in names}


def readable_elsewhere(root, key: bytes, want: np.ndarray) -> bool:
    fresh = DiskTier(root, 1 << 24, direct_io=False)
    try:
        got = np.empty(NB, np.uint8)
        return fresh.get(key, got) is Status.OK and np.array_equal(got, want)
    finally:
        fresh.close()


@pytest.mark.parametrize("call", ["put", "put_many"])
@pytest.mark.parametrize("how", ["file_of_its_own", "packed"])
@pytest.mark.parametrize("removal", ["delete", "eviction"])
def test_a_put_of_a_block_a_peer_removed_writes_it_again(tmp_path, call, how, removal):
    writer = DiskTier(tmp_path, 1 << 24, direct_io=False)
    # the peer is small, so that its own puts evict (its LRU victim: the adopted block)
    peer = DiskTier(tmp_path, 3 * (PAGE + NB), direct_io=False)
    try:
        store(writer, how)
        out = np.empty(NB, np.uint8)
        assert peer.get(k(1), out) is Status.OK  # adopted by the peer
        if removal == "delete":
            assert peer.delete(k(1))
        else:
            for i in (10, 11, 12):
                assert peer.put(k(i), data(i)) is Status.OK
        assert not os.path.exists(writer.path_of(k(1))), "setup: the peer removed the block"

        # the block is written again (the writer's index entry is stale)
        if call == "put":
            assert writer.put(k(1), data(1)) is Status.OK
        else:
            assert writer.put_many([k(1), k(3)], [data(1), data(3)]) == [Status.OK] * 2
        assert os.path.exists(writer.path_of(k(1))), "put said OK but nothing was written"
        assert writer.contains(k(1))
        writer.check_integrity(deep=True)
        assert readable_elsewhere(tmp_path, k(1), data(1))
        got = np.empty(NB, np.uint8)
        assert writer.get(k(1), got) is Status.OK and np.array_equal(got, data(1))
    finally:
        writer.close()
        peer.close()


@pytest.mark.parametrize("how", ["file_of_its_own", "packed"])
def test_contains_does_not_claim_a_block_a_peer_removed(tmp_path, how):
    """The same stale index answers contains() and contains_many() (the server's SIGTERM check of
    what is on disk, an encrypted tier's "already stored"): the entry is forgotten, its bytes with it."""
    writer = DiskTier(tmp_path, 1 << 24, direct_io=False)
    peer = DiskTier(tmp_path, 1 << 24, direct_io=False)
    try:
        store(writer, how)
        assert peer.delete(k(1))
        assert not writer.contains(k(1))
        assert writer.contains_many([k(1), k(2), k(1)]) == [False, how == "packed", False]
        writer.check_integrity(deep=True)
        assert writer.used_bytes == (PAGE + NB) * (2 if how == "packed" else 0)  # k(2) and k(1)'s dead place
        assert writer.put(k(1), data(1)) is Status.OK
        assert writer.contains_many([k(1)]) == [True]
        assert readable_elsewhere(tmp_path, k(1), data(1))
    finally:
        writer.close()
        peer.close()


@pytest.mark.parametrize("how", ["file_of_its_own", "packed"])
def test_a_block_the_peer_left_alone_is_deduplicated_without_a_write(tmp_path, how):
    """Control: the peer read the block (adopted it) but kept it: a put is OK and writes nothing,
    contains is True."""
    writer = DiskTier(tmp_path, 1 << 24, direct_io=False)
    peer = DiskTier(tmp_path, 1 << 24, direct_io=False)
    try:
        store(writer, how)
        out = np.empty(NB, np.uint8)
        assert peer.get(k(1), out) is Status.OK
        before, puts, used = files(tmp_path), writer.stats.puts, writer.used_bytes
        assert writer.put(k(1), data(1)) is Status.OK
        assert writer.put_many([k(1)] * 2, [data(1)] * 2) == [Status.OK] * 2
        assert writer.contains(k(1)) and writer.contains_many([k(1)]) == [True]
        assert files(tmp_path) == before, "a second copy was written"
        assert (writer.stats.puts, writer.used_bytes) == (puts, used)
        writer.check_integrity(deep=True)
    finally:
        writer.close()
        peer.close()


def test_a_block_a_peer_published_anew_is_adopted_not_written(tmp_path):
    """The peer removed the block and published it again (another inode at the name): the stale
    entry is forgotten and the name's block adopted; nothing is written a second time."""
    writer = DiskTier(tmp_path, 1 << 24, direct_io=False)
    peer = DiskTier(tmp_path, 1 << 24, direct_io=False)
    try:
        store(writer, "file_of_its_own")
        assert peer.delete(k(1))
        assert peer.put(k(1), data(1)) is Status.OK
        before, puts = files(tmp_path), writer.stats.puts
        assert writer.put(k(1), data(1)) is Status.OK
        assert files(tmp_path) == before and writer.stats.puts == puts
        assert writer.used_bytes == PAGE + NB
        writer.check_integrity(deep=True)
        got = np.empty(NB, np.uint8)
        assert writer.get(k(1), got) is Status.OK and np.array_equal(got, data(1))
    finally:
        writer.close()
        peer.close()


@pytest.mark.parametrize("packed", [False, True])
def test_confirming_held_blocks_costs_one_lstat_each_and_no_read(tmp_path, monkeypatch, packed):
    """put_many / contains_many of many held blocks: one lstat per key, no file opened; a get does
    not lstat an indexed block at all (reads trust the index and find a removed file when opening)."""
    n = 64
    tier = DiskTier(tmp_path, 1 << 26, direct_io=False, pack_batches=packed)
    try:
        keys, datas = [k(i) for i in range(n)], [data(i) for i in range(n)]
        assert tier.put_many(keys, datas) == [Status.OK] * n
        calls: dict[str, int] = {"lstat": 0, "open": 0, "readlink": 0}

        def counting(name):
            real = getattr(os, name)

            def call(*args, **kwargs):
                calls[name] += 1
                return real(*args, **kwargs)
            return call

        for name in calls:
            monkeypatch.setattr(os, name, counting(name))
        assert tier.put_many(keys, datas) == [Status.OK] * n
        assert calls == {"lstat": n, "open": 0, "readlink": 0}
        calls.update(lstat=0)
        assert tier.contains_many(keys) == [True] * n
        assert tier.lookup_prefix(keys) == n
        assert calls == {"lstat": n, "open": 0, "readlink": 0}  # lookup_prefix: none
        calls.update(lstat=0, open=0)
        outs = [np.empty(NB, np.uint8) for _ in keys]
        assert tier.get_many(keys, outs) == [Status.OK] * n
        assert calls["lstat"] == 0
    finally:
        tier.close()
