"""The transformers loader keeps the store's I/O threads reading: spans are queued ahead of them, so
a thread that finishes one starts the next without waiting for the loader's thread to wake, while
the reads in flight stay as many as the store has I/O threads (what the demo's disk limit reads)."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.core.layout import KVLayout  # noqa: E402
from kvtier.integrations.transformers import cache_io  # noqa: E402
from kvtier.store.tiered import TieredStore  # noqa: E402
from kvtier.tiers.base import Status  # noqa: E402
from kvtier.tiers.disk import DiskTier  # noqa: E402
from kvtier.tiers.host import HostTier  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="float32")
NB = LAYOUT.block_nbytes
N = 24  # six spans of four blocks
SLOW_WAKE_S = 0.1  # the loader's thread, once woken, runs only this much later (a busy machine)


def keys_of(n):
    return [hashlib.sha256(b"queue" + i.to_bytes(4, "little")).digest() for i in range(n)]


def blocks_of(n):
    rng = np.random.default_rng(7)
    return [rng.standard_normal(NB // 4).astype(np.float32) for _ in range(n)]


def _load_with_a_slow_loader(tmp_path, monkeypatch):
    """Load N disk blocks in spans of 4 with the loader's thread slow to run after each wake-up;
    (blocks placed right, most gets at once, gets started while the loader's thread slept)."""
    keys, blocks = keys_of(N), blocks_of(N)
    disk = DiskTier(tmp_path / "disk", 64 << 20)
    for a in range(0, N, 8):
        assert disk.put_many(keys[a : a + 8], blocks[a : a + 8]) == [Status.OK] * 8
    store = TieredStore([HostTier(64 * NB, NB), disk], io_threads=cache_io.READS_IN_FLIGHT)
    monkeypatch.setattr(cache_io, "READ_CHUNK_BYTES", 4 * NB)

    lock = threading.Lock()
    active, most, starts, sleeps, handed = [0], [0], [], [], []
    real_get, real_wait, real_async = store.get, cache_io.wait, store.get_async

    def get_async(*args, **kwargs):
        handed.append(len(sleeps))  # how many times the loader had woken when it handed this span
        return real_async(*args, **kwargs)

    def get(*args, **kwargs):
        with lock:
            starts.append(time.perf_counter())
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            return real_get(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    def slow_wait(*args, **kwargs):
        result = real_wait(*args, **kwargs)
        t0 = time.perf_counter()
        time.sleep(SLOW_WAKE_S)
        sleeps.append((t0, time.perf_counter()))
        return result

    monkeypatch.setattr(store, "get", get)
    monkeypatch.setattr(store, "get_async", get_async)
    monkeypatch.setattr(cache_io, "wait", slow_wait)
    storage = cache_io.KVStorage(LAYOUT, 1024, torch.float32, poison=True)
    try:
        report = cache_io.load_blocks(store, keys, storage, cache_io.Staging(poison=True))
        store.wait_promotions(10.0)
    finally:
        store.close()
    assert report.blocks == N and report.bytes_by_tier == {"disk": N * NB}
    bt = LAYOUT.block_tokens
    for i in range(N):
        got = np.ascontiguousarray(storage.tensor[:, :, 0, :, i * bt : (i + 1) * bt, :].numpy()).reshape(-1)
        assert np.array_equal(got, blocks[i]), f"block {i} placed wrong"
    during = sum(1 for s in starts if any(a <= s <= b for a, b in sleeps))
    return most[0], during, handed.count(0)


def test_io_threads_start_queued_spans_while_the_loader_sleeps_and_reads_in_flight_stay_bounded(
        tmp_path, monkeypatch):
    most, _, before_first_wake = _load_with_a_slow_loader(tmp_path, monkeypatch)
    assert most <= cache_io.READS_IN_FLIGHT  # the demo's disk limit reads this many at once
    # spans the I/O threads can go on to without the loader's thread (whether one starts during
    # a sleep depends on how fast the reads are against the thread's wake-up: not asserted)
    assert before_first_wake == cache_io.READS_IN_FLIGHT + cache_io.SPANS_AHEAD


def test_positive_control_without_spans_ahead_every_span_waits_for_the_loader(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_io, "SPANS_AHEAD", 0)
    most, _, before_first_wake = _load_with_a_slow_loader(tmp_path, monkeypatch)
    assert most <= cache_io.READS_IN_FLIGHT
    # (a span handed over before a wake-up may still start during the next one on a busy machine:
    # what tells the two apart is what the loader hands over before it first waits)
    assert before_first_wake == cache_io.READS_IN_FLIGHT
