"""``TieredStore.get(on_ready=...)`` and ``Tier.get_many_as_ready``: a caller learns which blocks
hold their verified data as each tier verifies them, so that it can use them (the transformers
loader places them in the model's cache) while later blocks are still read.

The disk tier reports each request's blocks from the helper that verified them, while it reads
the next request; other tiers report once, at the end. Never a block that failed its checks,
every served block exactly once, in the caller's indices."""

from __future__ import annotations

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


@pytest.fixture
def slow_reads(monkeypatch):
    """Every request but the first takes SLOW_READ_S longer; logs when each read ends."""
    ends: list[float] = []
    real = BlockIO._read_run

    def read_run(self, *args, **kwargs):
        if ends:
            time.sleep(SLOW_READ_S)
        try:
            return real(self, *args, **kwargs)
        finally:
            ends.append(time.perf_counter())

    monkeypatch.setattr(BlockIO, "_read_run", read_run)
    return ends


class Reports:
    """What ``ready`` was told, when, and whether each block's buffer held its data by then."""

    def __init__(self, outs, want):
        self.outs, self.want = outs, want
        self.calls: list[tuple[float, list[int]]] = []
        self.right: dict[int, bool] = {}
        self.lock = threading.Lock()

    def __call__(self, ready: list[int]) -> None:
        with self.lock:
            self.calls.append((time.perf_counter(), list(ready)))
            for i in ready:
                self.right[i] = bool(np.array_equal(self.outs[i], self.want[i]))

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
