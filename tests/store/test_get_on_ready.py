"""``TieredStore.get(on_ready=...)`` and ``Tier.get_many_as_ready``: a caller is handed each block's
verified bytes as each tier verifies them, so that it can use them (the transformers loader places
them in the model's cache) while later blocks are still read.

The disk tier reads each request into one of its two reused staging chunks and hands the blocks
over from there, on the helper that verified them, while it reads the next request (the caller's
buffers stay untouched); other tiers hand over their ``outs`` once, at the end. Never a block that
failed its checks, every served block exactly once, in the caller's indices."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from kvtier.store.tiered import TieredStore
from kvtier.tiers import direct_io
from kvtier.tiers.base import Status
from kvtier.tiers.direct_io import PAGE, BlockIO, aligned_buffer
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier
from tests.tiers.test_disk import _flip

NB = 16 << 10
N = 12
PER_REQUEST = 3  # blocks of a run read with one request here (RUN_REQUEST_BYTES patched)
SLOW_READ_S = 0.15  # every request after the first: the helper's report must come before they end


def k(i: int) -> bytes:
    return (i + 1).to_bytes(32, "big")


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, NB, dtype=np.uint8)


def poisoned_outs(n: int) -> list[np.ndarray]:
    buf = aligned_buffer(n * NB)
    buf.fill(0xA5)
    return [buf[i * NB : (i + 1) * NB] for i in range(n)]


@pytest.fixture
def disk(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_io, "RUN_REQUEST_BYTES", PER_REQUEST * (PAGE + NB))
    tier = DiskTier(tmp_path / "disk", 64 << 20)
    assert tier.put_many([k(i) for i in range(N)], [data(i) for i in range(N)]) == [Status.OK] * N
    yield tier
    tier.close()


def slow_staged_reads(monkeypatch, slow_s: float) -> list[float]:
    """Every staged request but the first takes ``slow_s`` longer; returns when each read ends."""
    ends: list[float] = []
    real = BlockIO._read_image  # a request read into the tier's staging

    def read_image(self, *args, **kwargs):
        if ends:
            time.sleep(slow_s)
        try:
            return real(self, *args, **kwargs)
        finally:
            ends.append(time.perf_counter())

    monkeypatch.setattr(BlockIO, "_read_image", read_image)
    return ends


@pytest.fixture
def slow_reads(monkeypatch):
    return slow_staged_reads(monkeypatch, SLOW_READ_S)


class Reports:
    """What ``ready`` was told, when, where each payload was, and whether it held the block's bytes."""

    def __init__(self, outs, want):
        self.outs, self.want = outs, want
        self.calls: list[tuple[float, list[int]]] = []
        self.right: dict[int, bool] = {}
        self.places: dict[int, int] = {}  # index -> the payload's address
        self.lock = threading.Lock()

    def __call__(self, ready: list[int], payloads: list) -> None:
        with self.lock:
            self.calls.append((time.perf_counter(), list(ready)))
            for i, payload in zip(ready, payloads):
                self.right[i] = bool(np.array_equal(np.asarray(payload).view(np.uint8), self.want[i]))
                self.places[i] = np.asarray(payload).__array_interface__["data"][0]

    def in_outs(self) -> set[int]:
        """Indices handed over in the caller's own buffer."""
        return {i for i, at in self.places.items() if at == self.outs[i].__array_interface__["data"][0]}

    def indices(self) -> list[int]:
        return sorted(i for _, got in self.calls for i in got)


def test_the_disk_tier_reports_a_requests_blocks_while_it_reads_the_next(disk, slow_reads):
    outs = poisoned_outs(N)
    reports = Reports(outs, [data(i) for i in range(N)])
    statuses = disk.get_many_as_ready([k(i) for i in range(N)], outs, reports)
    assert statuses == [Status.OK] * N
    assert reports.indices() == list(range(N))  # every block once
    assert all(reports.right.values()) and len(reports.right) == N  # its data was there when told
    assert len(slow_reads) == N // PER_REQUEST
    # The first request's blocks were reported before the last request was read: the caller
    # could use them meanwhile. (A tier that reports at the end only fails this.)
    first_report = reports.calls[0][0]
    assert first_report < slow_reads[-1] - SLOW_READ_S / 2
    assert len(reports.calls) == N // PER_REQUEST
    # Handed over from two reused staging chunks, never through the caller's buffers (poisoned still)
    assert not reports.in_outs()
    assert max(reports.places.values()) - min(reports.places.values()) < 2 * direct_io.CHUNK  # one lease's staging
    assert all((out == 0xA5).all() for out in outs)


def test_a_block_that_fails_its_check_is_never_reported_and_the_rest_are(disk):
    path, base = disk.locate(k(4))
    _flip(path, base + PAGE + NB // 2)  # a payload byte: the xxh3 check fails
    outs = poisoned_outs(N)
    reports = Reports(outs, [data(i) for i in range(N)])
    statuses = disk.get_many_as_ready([k(i) for i in range(N)], outs, reports)
    assert statuses[4] is Status.CORRUPT
    assert [s for i, s in enumerate(statuses) if i != 4] == [Status.OK] * (N - 1)
    assert reports.indices() == [i for i in range(N) if i != 4]
    assert all(reports.right.values())


def test_a_tier_without_its_own_reports_once_at_the_end_with_what_it_served():
    host = HostTier(N * NB, NB)
    for i in range(0, N, 2):
        assert host.put(k(i), data(i)) is Status.OK
    outs = poisoned_outs(N)
    reports = Reports(outs, [data(i) for i in range(N)])
    statuses = host.get_many_as_ready([k(i) for i in range(N)], outs, reports)
    assert [s is Status.OK for s in statuses] == [i % 2 == 0 for i in range(N)]
    assert len(reports.calls) == 1 and reports.indices() == list(range(0, N, 2))
    assert all(reports.right.values())
    assert reports.in_outs() == set(range(0, N, 2))  # its own buffers: the caller's
    host.close()


def test_the_store_reports_in_the_callers_indices_across_its_tiers(disk, slow_reads):
    host = HostTier(N * NB, NB)
    for i in (0, 1, 5):  # the host serves these; the disk the others (it holds all)
        assert host.put(k(i), data(i)) is Status.OK
    store = TieredStore([host, disk], promote=False)
    try:
        outs = poisoned_outs(N)
        reports = Reports(outs, [data(i) for i in range(N)])
        result = store.get([k(i) for i in range(N)], outs, on_ready=reports)
        assert result.loaded == N
        assert reports.indices() == list(range(N))
        assert all(reports.right.values()) and len(reports.right) == N
        host_calls = [got for _, got in reports.calls if set(got) <= {0, 1, 5}]
        assert host_calls == [[0, 1, 5]]
        assert reports.in_outs() == {0, 1, 5}  # the host tier's, in outs; the disk tier's, from its staging
        # a miss: the store still reports every served block (past the miss too), once
        outs = poisoned_outs(N + 1)
        keys = [k(i) for i in range(N)]
        keys.insert(6, k(999))
        want = [data(i) for i in range(6)] + [None] + [data(i) for i in range(6, N)]
        reports = Reports(outs, want)
        result = store.get(keys, outs, on_ready=reports)
        assert result.loaded == 6 and result.statuses[6] is Status.MISS
        assert reports.indices() == [i for i in range(N + 1) if i != 6]
        assert all(reports.right.values())
    finally:
        store.close()


def test_without_on_ready_nothing_changes(disk):
    store = TieredStore([HostTier(N * NB, NB), disk], promote=False)
    try:
        outs = poisoned_outs(N)
        result = store.get([k(i) for i in range(N)], outs)
        assert result.loaded == N
        assert all(np.array_equal(outs[i], data(i)) for i in range(N))
    finally:
        store.close()


def test_a_block_larger_than_the_staging_is_read_into_its_out_and_handed_over_from_there(tmp_path):
    big = 2 << 20  # a staging chunk: with its header page it does not fit
    tier = DiskTier(tmp_path / "big", 64 << 20)
    try:
        payload = np.random.default_rng(3).integers(0, 256, big, dtype=np.uint8)
        assert tier.put(k(0), payload) is Status.OK and tier.put(k(1), data(1)) is Status.OK
        outs = [aligned_buffer(big), poisoned_outs(1)[0]]
        reports = Reports(outs, [payload, data(1)])
        assert tier.get_many_as_ready([k(0), k(1)], outs, reports) == [Status.OK, Status.OK]
        assert reports.indices() == [0, 1] and all(reports.right.values())
        assert reports.in_outs() == {0}
    finally:
        tier.close()


def test_damaged_files_are_misses_or_corrupt_through_the_staging_and_the_rest_is_served(disk, tmp_path):
    """A truncated extent (blocks past the cut), a file of its own of another size: never handed over."""
    own = DiskTier(tmp_path / "own", 64 << 20)
    try:
        for i in range(3):
            assert own.put(k(i), data(i)) is Status.OK  # a file each
        path, _ = own.locate(k(1))
        os.truncate(path, PAGE + NB // 2)
        outs = poisoned_outs(3)
        reports = Reports(outs, [data(i) for i in range(3)])
        statuses = own.get_many_as_ready([k(i) for i in range(3)], outs, reports)
        assert statuses[0] is Status.OK and statuses[2] is Status.OK and statuses[1] is not Status.OK
        assert reports.indices() == [0, 2] and all(reports.right.values())
    finally:
        own.close()
    path, base = disk.locate(k(N - 2))
    os.truncate(path, base + PAGE + NB // 2)  # the extent ends inside block N - 2
    outs = poisoned_outs(N)
    reports = Reports(outs, [data(i) for i in range(N)])
    statuses = disk.get_many_as_ready([k(i) for i in range(N)], outs, reports)
    assert statuses[: N - 2] == [Status.OK] * (N - 2)
    assert all(status is not Status.OK for status in statuses[N - 2 :])
    assert reports.indices() == list(range(N - 2)) and all(reports.right.values())


def test_an_error_in_ready_reaches_the_caller_and_the_tier_serves_the_next_get(disk):
    calls = []

    def failing(ready, payloads):
        calls.append(list(ready))
        raise RuntimeError("the caller's copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        disk.get_many_as_ready([k(i) for i in range(N)], poisoned_outs(N), failing)
    assert calls  # it was called, and the reads stopped behind it
    outs = poisoned_outs(N)
    reports = Reports(outs, [data(i) for i in range(N)])
    for _ in range(3):  # every staging lease came back
        assert disk.get_many_as_ready([k(i) for i in range(N)], outs, reports) == [Status.OK] * N


def test_a_load_larger_than_the_staging_reuses_it_and_every_block_arrives_whole(tmp_path):
    """Ten 1 MiB requests through a staging that holds three: places are taken again once the
    requests there are judged, and no block is handed over torn or overwritten (each payload is
    compared while the caller holds it, and the caller holds it a while)."""
    nb, n = 256 << 10, 40
    tier = DiskTier(tmp_path / "many", 256 << 20)
    try:
        want = [np.random.default_rng(100 + i).integers(0, 256, nb, dtype=np.uint8) for i in range(n)]
        keys = [k(i) for i in range(n)]
        assert tier.put_many(keys, want) == [Status.OK] * n
        outs = [aligned_buffer(nb) for _ in range(n)]

        class Slow(Reports):
            def __call__(self, ready, payloads):
                time.sleep(0.01)  # the caller's copy takes a while: later reads must not overwrite it
                super().__call__(ready, payloads)

        reports = Slow(outs, want)
        assert tier.get_many_as_ready(keys, outs, reports) == [Status.OK] * n
        assert reports.indices() == list(range(n)) and all(reports.right.values())
        firsts = [reports.places[got[0]] for _, got in reports.calls]  # where each request landed
        assert len(firsts) == 10 and len(set(firsts)) < len(firsts)  # places taken again
        assert max(reports.places.values()) - min(reports.places.values()) < 2 * direct_io.CHUNK
    finally:
        tier.close()
