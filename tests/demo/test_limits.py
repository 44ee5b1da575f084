"""The demo's limits are measured the way kvtier reads: block-shaped requests, reads in flight."""

import os

import pytest

from kvtier.demo import limits


def test_disk_limit_reads_block_shaped_requests_with_reads_in_flight(tmp_path, monkeypatch):
    seen = []
    preadv = os.preadv

    def spy(fd, buffers, offset):
        seen.append((sum(memoryview(b).nbytes for b in buffers), offset, buffers[0].__array_interface__["data"][0]))
        return preadv(fd, buffers, offset)

    direct = limits.probe_direct_io(str(tmp_path))  # the probe's own read is not the limit's
    monkeypatch.setattr(limits, "probe_direct_io", lambda directory: direct)
    monkeypatch.setattr(limits.os, "preadv", spy)
    gib_s = limits.disk_read_gib_s(str(tmp_path), 256 << 10, in_flight=2, total_bytes=4 << 20, repeats=1)
    assert gib_s > 0
    request = 4096 + (256 << 10)  # a block file: header page + payload
    assert {size for size, _, _ in seen} == {request}
    kinds = len(limits.DESTINATIONS)
    assert len(seen) == 16 * kinds
    for k in range(kinds):  # each kind of memory in turn, every block once
        assert sorted(offset for _, offset, _ in seen[16 * k : 16 * (k + 1)]) == [b * request for b in range(16)]
    reused, huge_reused, region = (seen[16 * k : 16 * (k + 1)] for k in range(kinds))
    assert len({address for _, _, address in reused}) == 2  # a buffer per read in flight
    assert len({address for _, _, address in huge_reused}) == 2
    assert len({address for _, _, address in region}) == 16  # a place per read, as a load's staging
    assert not list(tmp_path.iterdir()), "the scratch file is removed"


def test_disk_limit_takes_one_kind_of_memory_when_asked_and_refuses_unknown_kinds(tmp_path):
    one = limits.disk_read_gib_s(str(tmp_path), 256 << 10, in_flight=2, total_bytes=4 << 20, repeats=1,
                                 destinations=("huge pages, a place per read",))
    assert one > 0
    with pytest.raises(ValueError, match="destinations"):
        limits.disk_read_gib_s(str(tmp_path), 256 << 10, in_flight=2, destinations=("the page cache",))


def test_host_limit_copies_block_sized_pieces():
    assert limits.host_copy_gib_s(256 << 10, total_bytes=4 << 20, repeats=1) > 0
    with pytest.raises(TypeError):
        limits.disk_read_gib_s("/tmp", 4096, 2)  # in_flight is keyword-only: say it


def test_disk_limit_is_the_fastest_of_block_run_and_span_requests(tmp_path, monkeypatch):
    """A packed span is read in ~1 MiB requests (DiskTier.get_many): the limit measures that shape,
    whole spans and a request per block, and keeps the fastest (never only kvtier's own choice)."""
    shapes = []
    real = limits.disk_read_gib_s

    def spy(directory, block_nbytes, *, in_flight, blocks_per_read=1, total_bytes):
        shapes.append(blocks_per_read)
        return {1: 1.0, 4: 3.0, 16: 2.0}[blocks_per_read]

    monkeypatch.setattr(limits, "disk_read_gib_s", spy)
    assert limits.disk_limit_gib_s(str(tmp_path), 256 << 10, in_flight=2, span_blocks=16) == 3.0
    assert sorted(shapes) == [1, 4, 16]
    monkeypatch.setattr(limits, "disk_read_gib_s", real)
    seen = []
    preadv = os.preadv

    def count(fd, buffers, offset):
        seen.append(sum(memoryview(b).nbytes for b in buffers))
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(limits.os, "preadv", count)
    assert limits.disk_read_gib_s(str(tmp_path), 256 << 10, in_flight=2, blocks_per_read=4,
                                  total_bytes=4 << 20, repeats=1) > 0
    assert set(seen) - {4096} == {4 * (4096 + (256 << 10))}  # (the probe's own page read aside)
