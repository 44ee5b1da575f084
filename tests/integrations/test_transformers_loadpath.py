"""The transformers loader's fast paths: host runs pinned at once and copied per pool-adjacent run,
lower-tier runs through staging that each read gets fresh (poisoned) and promoted in the background."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.core.layout import KVLayout  # noqa: E402
from kvtier.integrations.poison import BYTE  # noqa: E402
from kvtier.integrations.transformers.cache_io import KVStorage, Staging, gather_blocks, load_blocks  # noqa: E402
from kvtier.store.tiered import TieredStore  # noqa: E402
from kvtier.tiers.base import Status  # noqa: E402
from kvtier.tiers.disk import DiskTier  # noqa: E402
from kvtier.tiers.host import HostTier  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="float32")
NB = LAYOUT.block_nbytes


def keys_of(n):
    return [hashlib.sha256(b"load" + i.to_bytes(4, "little")).digest() for i in range(n)]


def blocks_of(n):
    rng = np.random.default_rng(5)
    return [rng.standard_normal(NB // 4).astype(np.float32) for _ in range(n)]


def placed(storage: KVStorage, i: int) -> np.ndarray:
    """Block i of the storage, back in canonical layout."""
    bt = LAYOUT.block_tokens
    return np.ascontiguousarray(storage.tensor[:, :, 0, :, i * bt : (i + 1) * bt, :].numpy()).reshape(-1)


def test_a_load_mixing_host_runs_in_any_pool_order_and_disk_runs_places_every_block(tmp_path):
    n = 10
    keys, blocks = keys_of(n), blocks_of(n)
    host = HostTier(32 * NB, NB)
    disk = DiskTier(tmp_path / "disk", 64 << 20)
    in_host = [0, 1, 2, 3, 8, 9]
    # Put in reverse order: the pool holds block 3 before block 2, so the loader's
    # adjacent-run copies must split there; blocks 4..7 are on disk only.
    for i in reversed(in_host):
        assert host.put(keys[i], blocks[i]) is Status.OK
    assert disk.put_many(keys[4:8], blocks[4:8]) == [Status.OK] * 4
    store = TieredStore([host, disk], write_mode="write-through")
    storage = KVStorage(LAYOUT, 256, torch.float32, poison=True)
    try:
        report = load_blocks(store, keys, storage, Staging(poison=True))
        assert report.blocks == n
        assert report.bytes_by_tier == {"host": 6 * NB, "disk": 4 * NB}
        for i in range(n):
            assert np.array_equal(placed(storage, i), blocks[i]), f"block {i} placed wrong"
        assert not torch.isnan(storage.tensor[:, :, :, :, : n * LAYOUT.block_tokens]).any()
        # the disk blocks reach the host tier after the load, from disk (not from staging)
        assert store.wait_promotions(10.0)
        assert host.lookup_prefix(keys) == n
    finally:
        store.close()


def test_adjacent_host_blocks_are_copied_as_one_run_and_land_right(tmp_path):
    n = 12
    keys, blocks = keys_of(n), blocks_of(n)
    host = HostTier(32 * NB, NB)
    store = TieredStore([host])
    assert store.put(keys, blocks) == [Status.OK] * n
    storage = KVStorage(LAYOUT, 512, torch.float32, poison=True)
    try:
        with host.borrow_many(keys, NB) as views:
            addresses = [v.__array_interface__["data"][0] for v in views]
        assert addresses == [addresses[0] + k * NB for k in range(n)], "put_many no longer lays out in order"
        assert load_blocks(store, keys, storage).blocks == n
        for i in range(n):
            assert np.array_equal(placed(storage, i), blocks[i])
        host.check_integrity()  # every pin of the batch was released
    finally:
        store.close()


def test_borrow_many_pins_the_leading_run_only_and_releases_every_pin():
    keys, blocks = keys_of(4), blocks_of(4)
    host = HostTier(8 * NB, NB)
    for i in (0, 1, 3):
        host.put(keys[i], blocks[i])
    hits_before, read_before = host.stats.hits, host.stats.bytes_read
    with host.borrow_many(keys, NB) as views:
        assert len(views) == 2
        assert not views[0].flags.writeable
        # loaders read through borrow_many: the tier's counters must see what they take
        assert (host.stats.hits - hits_before, host.stats.bytes_read - read_before) == (2, 2 * NB)
        assert host.delete(keys[0]) and not host.contains(keys[0])  # deleted while pinned: hidden at once
    assert host.used_bytes == 2 * NB  # its memory went with the batch's last unpin
    host.check_integrity()
    with host.borrow_many(keys[1:], 2 * NB) as views:
        assert views == []  # a size other than asked for ends the run
    host.close()


def test_staging_hands_each_read_fresh_poisoned_bytes_within_a_load_and_after_poison():
    staging = Staging(poison=True)
    staging.reserve(4 * NB)
    a = staging.take(2 * NB)
    b = staging.take(2 * NB)
    assert not np.shares_memory(a, b), "two reads of one load share staging"
    assert (a == BYTE).all() and (b == BYTE).all()
    a[:] = 1
    b[:] = 2
    staging.rewind()
    staging.poison()  # the session's untimed refill before the next request
    c = staging.take(4 * NB)
    assert (c == BYTE).all(), "a region came back holding an earlier load's bytes"
    c[:] = 3
    staging.rewind()  # a caller that does not poison between loads: take refills
    assert (staging.take(NB) == BYTE).all()
    bigger = staging.take(16 * NB)  # past the reserve: a fresh buffer, poisoned too
    assert (bigger == BYTE).all()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 33, 82, 214])
def test_read_spans_cover_every_block_once_in_whole_requests_sharing_the_lanes_evenly(n):
    from kvtier.integrations.transformers.cache_io import read_spans

    unit = 4  # blocks per request of the disk tier (256 KiB blocks, ~1 MiB requests)
    spans = read_spans(n, 16, 2, unit)
    assert [a for a, _ in spans] == [0] + [b for _, b in spans[:-1]] and spans[-1][1] == n
    sizes = [b - a for a, b in spans]
    assert max(sizes) <= 16 and all(size % unit == 0 for size in sizes[:-1]), "a span costs an extra request"
    requests = [-(-size // unit) for size in sizes]
    assert sum(requests) == -(-n // unit), "more requests than cutting in 16s makes"
    assert max(requests) - min(requests) <= 1 and requests == sorted(requests, reverse=True)
    assert -(-n // unit) < 2 or len(spans) % 2 == 0  # no lane is left reading alone at the end


def _disk_store(tmp_path, n, monkeypatch, per_request):
    """``n`` blocks on a disk tier, read ``per_request`` blocks a request, behind an empty host tier."""
    from kvtier.tiers import direct_io
    from kvtier.tiers.direct_io import PAGE

    monkeypatch.setattr(direct_io, "RUN_REQUEST_BYTES", per_request * (PAGE + NB))
    keys, blocks = keys_of(n), blocks_of(n)
    disk = DiskTier(tmp_path / "disk", 64 << 20)
    assert disk.put_many(keys, blocks) == [Status.OK] * n
    return keys, blocks, disk, TieredStore([HostTier(4 * n * NB, NB), disk])


def _load(store, keys):
    """``load_blocks`` of ``keys`` into fresh poisoned storage, then the store closed."""
    storage = KVStorage(LAYOUT, 256, torch.float32, poison=True)
    try:
        return load_blocks(store, keys, storage, Staging(poison=True)), storage
    finally:
        store.close()


def test_blocks_are_placed_while_later_requests_of_their_span_are_still_read(tmp_path, monkeypatch):
    """Placing hides behind the reads: a block is placed once its tier verified it, not once its
    whole span is read. Two spans here (one a lane), each read in two requests; every request
    after the first is slowed."""
    import time

    from kvtier.integrations.transformers import cache_io
    from tests.store.test_get_on_ready import slow_staged_reads

    n, per_request, slow_s = 12, 3, 0.15
    keys, blocks, disk, store = _disk_store(tmp_path, n, monkeypatch, per_request)
    monkeypatch.setattr(cache_io, "READ_CHUNK_BYTES", 64 * NB)  # spans as large as the lanes allow
    read_ends = slow_staged_reads(monkeypatch, slow_s)
    placings = []
    real_place = cache_io._place_run

    def place_run(raw, first, run, count, layout):
        placings.append((time.perf_counter(), first, count))
        real_place(raw, first, run, count, layout)

    monkeypatch.setattr(cache_io, "_place_run", place_run)
    report, storage = _load(store, keys)
    assert report.blocks == n and report.bytes_by_tier == {"disk": n * NB}
    for i in range(n):
        assert np.array_equal(placed(storage, i), blocks[i]), f"block {i} placed wrong"
    assert len(read_ends) == n // per_request
    assert sorted((first, count) for _, first, count in placings) == [(a, 1) for a in range(n)]  # from the staging
    # the first request's blocks were in place before the last request was read
    assert min(t for t, _, _ in placings) < read_ends[-1] - slow_s / 2


def test_a_block_that_fails_in_an_early_span_ends_the_load_there_whatever_later_spans_read(tmp_path, monkeypatch):
    """Spans are read (and placed) out of order; the load still ends at the first bad block and
    counts only the blocks before it."""
    from kvtier.integrations.transformers import cache_io
    from tests.tiers.test_disk import _flip
    from kvtier.tiers.direct_io import PAGE

    n = 16
    keys, blocks, disk, store = _disk_store(tmp_path, n, monkeypatch, 2)
    monkeypatch.setattr(cache_io, "READ_CHUNK_BYTES", 4 * NB)  # four spans of four blocks
    path, base = disk.locate(keys[2])
    _flip(path, base + PAGE + NB // 3)
    report, storage = _load(store, keys)
    assert report.blocks == 2 and report.bytes_by_tier == {"disk": 2 * NB}
    for i in range(2):
        assert np.array_equal(placed(storage, i), blocks[i])
    # the positive control of the cut: a clean load of the same blocks serves them all
    keys2, _, _, store2 = _disk_store(tmp_path / "clean", n, monkeypatch, 2)
    report2, _ = _load(store2, keys2)
    assert report2.blocks == n and report2.bytes_by_tier == {"disk": n * NB}


def test_a_large_loads_staging_and_a_large_saves_gather_are_huge_page_buffers():
    """Direct reads land in the loader's staging and writes leave from the gather buffer: both on
    huge pages when large (a 1 MiB direct read into small pages is 256 device segments)."""
    from kvtier.tiers.direct_io import HUGE_PAGE

    staging = Staging()
    staging.reserve(8 << 20)
    region = staging.take(8 << 20)
    assert region.__array_interface__["data"][0] % HUGE_PAGE == 0
    n = (4 << 20) // NB
    storage = KVStorage(LAYOUT, n * LAYOUT.block_tokens, torch.float32)
    gathered = gather_blocks(storage, 0, n)
    assert gathered[0].__array_interface__["data"][0] % HUGE_PAGE == 0


def _load_checked(host, disk, keys, blocks):
    """``load_blocks`` of every key through ``[host, disk]`` into poisoned storage; every block
    must be served and placed right. The report."""
    store = TieredStore([host, disk], write_mode="write-through")
    storage = KVStorage(LAYOUT, 256, torch.float32, poison=True)
    try:
        report = load_blocks(store, keys, storage, Staging(poison=True))
    finally:
        store.close()
    assert report.blocks == len(keys)
    for i, block in enumerate(blocks):
        assert np.array_equal(placed(storage, i), block), f"block {i} placed wrong"
    return report


def test_lower_tier_reads_start_before_the_host_runs_are_copied_and_run_beside_them(tmp_path):
    """A load whose first blocks sit in DRAM and the rest on disk: the disk's reads are handed to
    the store's I/O threads first and run while this thread copies the host runs, so the load
    takes about the longer of the two, not their sum. Seen here as order: the disk tier's get
    starts before the host copy ends (a host copy slowed to 0.3 s leaves it no excuse)."""
    import contextlib
    import time

    n, in_host = 12, 6
    keys, blocks = keys_of(n), blocks_of(n)
    events: list[tuple[str, float]] = []

    class SlowCopyHost(HostTier):  # a test wrapper: the host copy takes long enough to see overlap
        def borrow_runs(self, keys, nbytes):
            events.append(("host copy starts", time.monotonic()))
            with super().borrow_runs(keys, nbytes) as runs:
                time.sleep(0.3)
                yield runs
            events.append(("host copy ends", time.monotonic()))

    SlowCopyHost.borrow_runs = contextlib.contextmanager(SlowCopyHost.borrow_runs)

    class WatchedDisk(DiskTier):
        def get_many_as_ready(self, keys, outs, ready):
            events.append(("disk get starts", time.monotonic()))
            return super().get_many_as_ready(keys, outs, ready)

    host = SlowCopyHost(32 * NB, NB)
    disk = WatchedDisk(tmp_path / "disk", 64 << 20)
    for i in range(in_host):
        assert host.put(keys[i], blocks[i]) is Status.OK
    assert disk.put_many(keys[in_host:], blocks[in_host:]) == [Status.OK] * (n - in_host)
    report = _load_checked(host, disk, keys, blocks)
    assert report.bytes_by_tier == {"host": in_host * NB, "disk": (n - in_host) * NB}
    when = {name: t for name, t in events}
    assert {"host copy starts", "host copy ends", "disk get starts"} <= set(when), events
    assert when["disk get starts"] < when["host copy ends"], \
        f"the disk's reads waited for the host copy: {[(e, round(t - events[0][1], 3)) for e, t in events]}"


def test_a_host_block_evicted_after_the_load_planned_is_read_from_below(tmp_path):
    """The loader plans which blocks the host holds, then copies them: a block evicted between the
    two is read through the store (from disk here), not lost or left poisoned. Control: without the
    eviction every block comes from the host."""
    n = 10
    keys, blocks = keys_of(n), blocks_of(n)

    def run(evict: bool):
        class EvictingHost(HostTier):  # a test wrapper: evicts block 4 as the first copy begins
            armed = evict

            def borrow_runs(self, keys_, nbytes):
                if self.armed:
                    self.armed = False
                    self.delete(keys[4])
                return super().borrow_runs(keys_, nbytes)

        host = EvictingHost(32 * NB, NB)
        disk = DiskTier(tmp_path / f"disk-{evict}", 64 << 20)
        for i in range(n):
            assert host.put(keys[i], blocks[i]) is Status.OK
        assert disk.put_many(keys, blocks) == [Status.OK] * n
        return _load_checked(host, disk, keys, blocks).bytes_by_tier

    assert run(False) == {"host": n * NB}
    assert run(True) == {"host": (n - 1) * NB, "disk": NB}
