"""Write-behind in the embedded store: copies behind the caller, clean evictions without I/O,
a bounded backlog, a bounded flush at close, and what survives into a new process."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest

from kvtier.core.keys import block_keys
from kvtier.core.layout import KVLayout
from kvtier.core.namespace import Namespace
from kvtier.core.payload import BlockMeta
from kvtier.store.context import ContextCache
from kvtier.store.tiered import FlushReport, TieredStore, WriteMode
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.faulty import Faults, FaultyTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.wrapper import WrappingTier

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POISON = 0xA5
FLUSHER = "kvtier-writebehind"


class Recording(WrappingTier):
    """The lower tier, watched: every put counted per key; ``gate`` (when set) holds the
    write-behind flusher's puts -- and only its -- until opened, as a stalled tier would."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.name = inner.name
        self.put_keys: Counter = Counter()
        self.gate: threading.Event | None = None
        self.flusher_waiting = threading.Event()
        self._count = threading.Lock()

    def put(self, key, data, *, parent=None, meta=None, **age):
        if self.gate is not None and threading.current_thread().name == FLUSHER:
            self.flusher_waiting.set()
            self.gate.wait()
        with self._count:
            self.put_keys[key] += 1
        return self.inner.put(key, data, parent=parent, meta=meta, **age)  # (created: the block's age)

    def contains(self, key):
        return self.inner.contains(key)

    def get(self, key, out):
        return self.inner.get(key, out)

    def delete(self, key):
        return self.inner.delete(key)

    def keys(self):
        return self.inner.keys()

    def lookup_prefix(self, keys):
        return self.inner.lookup_prefix(keys)


def host_of(blocks: int, layout: KVLayout, name: str = "host") -> HostTier:
    tier = HostTier(blocks * layout.block_nbytes, layout.block_nbytes)
    tier.name = name
    return tier


def content(i: int, layout: KVLayout) -> np.ndarray:
    """Block i's bytes: any reader can check them."""
    return np.random.default_rng(i).integers(0, 256, layout.block_nbytes, dtype=np.uint8)


def chain(ns: Namespace, n: int, start: int = 0) -> list[bytes]:
    tokens = np.arange(start, start + n * ns.layout.block_tokens) % 50_000
    return block_keys(ns, tokens)


def read_back(tier, key, nbytes) -> np.ndarray | None:
    out = np.full(nbytes, POISON, np.uint8)  # a get that writes nothing must not pass
    if isinstance(tier, TieredStore):
        return out if tier.get([key], [out]).loaded == 1 else None
    return out if tier.get(key, out) is Status.OK else None


def digests_in_new_process(directory, capacity: int, blocks: dict[bytes, int]) -> dict[str, str | None]:
    """Open ``directory`` as a lone DiskTier in another process and digest every block it returns."""
    request = json.dumps({"blocks": [[k.hex(), n] for k, n in blocks.items()]})
    done = subprocess.run(
        [sys.executable, "-m", "tests.store.disk_reader", str(directory), str(capacity)],
        input=request, capture_output=True, text=True, cwd=ROOT, timeout=120, check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])["digests"]


def sha(buf) -> str:
    return hashlib.sha256(np.ascontiguousarray(buf).view(np.uint8)).hexdigest()


# -- copies behind the caller ------------------------------------------------------------------
def test_puts_are_copied_down_behind_the_caller_without_any_eviction(tmp_path, small_ns):
    layout = small_ns.layout
    disk = DiskTier(tmp_path / "disk", 1 << 26)
    store = TieredStore([host_of(32, layout), disk])
    keys = chain(small_ns, 8)
    blocks = [content(i, layout) for i in range(8)]
    assert store.put(keys, blocks) == [Status.OK] * 8
    report = store.flush_dirty(30.0)
    assert isinstance(report, FlushReport)
    assert (report.flushed, report.dropped) == (8, 0)
    stats = store.stats()
    assert stats["tiers"]["host"]["evictions"] == 0  # nothing was demoted: the copies went behind
    assert stats["store"]["demotions"] == 0
    assert stats["store"]["writebehind_flushed"] == 8
    assert stats["store"]["dirty_blocks"] == 0
    assert stats["tiers"]["disk"]["puts"] == 8
    # the chain survives the copy: the disk tier records each block's parent
    parents = {r.key: r.parent for r in disk.records()}
    assert parents == dict(zip(keys, [None, *keys[:-1]]))
    for key, block in zip(keys, blocks):
        got = read_back(disk, key, layout.block_nbytes)
        assert got is not None and np.array_equal(got, block)
    store.close()


def test_schedule_writeback_copies_blocks_written_straight_into_the_host_pool(tmp_path, small_ns):
    """The server's path: reserve → receive into the slot → commit, then schedule_writeback."""
    layout = small_ns.layout
    host = host_of(16, layout)
    disk = DiskTier(tmp_path / "disk", 1 << 26)
    store = TieredStore([host, disk])
    keys = chain(small_ns, 4)
    meta = BlockMeta.of_layout(layout)
    for i, key in enumerate(keys):
        status, res = host.reserve(key, layout.block_nbytes, meta=meta)
        assert status is Status.OK and res is not None
        res.view[:] = content(i, layout)
        host.commit(res)
    assert not any(disk.contains(k) for k in keys)  # control: nothing goes down by itself
    store.schedule_writeback(keys, parents=[None, *keys[:-1]], metas=[meta] * 4)
    report = store.flush_dirty(30.0)
    assert (report.flushed, report.dropped) == (4, 0)
    assert {r.key: r.parent for r in disk.records()} == dict(zip(keys, [None, *keys[:-1]]))
    headers = {r.key: r.header for r in disk.records()}
    assert all(tuple(headers[k].shape) == tuple(layout.block_shape) for k in keys)
    for i, key in enumerate(keys):
        assert np.array_equal(read_back(disk, key, layout.block_nbytes), content(i, layout))
    with pytest.raises(ValueError, match="parents"):
        store.schedule_writeback(keys, parents=[None])
    store.close()


def test_copies_cascade_down_a_chain_of_tiers(tmp_path, small_ns):
    """host → disk → a third tier: a block that reaches the disk, copied behind or demoted by
    an eviction, is dirty there for the tier below, so a flush leaves it in every tier."""
    layout = small_ns.layout
    disk = DiskTier(tmp_path / "disk", 1 << 26)
    far = Recording(host_of(64, layout, "far"))
    store = TieredStore([host_of(4, layout), disk, far])
    keys = chain(small_ns, 12)  # 8 of them are evicted from the host on the way
    store.put(keys, [content(i, layout) for i in range(12)])
    report = store.flush_dirty(30.0)
    assert report.dropped == 0
    assert far.put_keys == Counter({k: 1 for k in keys})
    for i, key in enumerate(keys):
        assert np.array_equal(read_back(far, key, layout.block_nbytes), content(i, layout))
    assert store.stats()["store"]["dirty_blocks"] == 0
    store.close()


# -- shutdown and restart -------------------------------------------------------------------------
def test_close_flushes_and_a_new_process_on_the_disk_dir_recovers_every_block(tmp_path, small_ns):
    layout = small_ns.layout
    directory = tmp_path / "disk"
    store = TieredStore([host_of(64, layout), DiskTier(directory, 1 << 26)])
    keys = chain(small_ns, 24)
    blocks = [content(100 + i, layout) for i in range(24)]
    store.put(keys, blocks)
    report = store.close()
    assert report.dropped == 0 and report.flushed == 24
    digests = digests_in_new_process(directory, 1 << 26, {k: layout.block_nbytes for k in keys})
    assert digests == {k.hex(): sha(b) for k, b in zip(keys, blocks)}


def test_readme_store_of_three_models_survives_close_into_a_new_process(tmp_path):
    """The issue's scenario, with only the README's API: host + disk, default write mode,
    1,500 tokens of three different models, ``close()``, a new process on the disk directory.
    Before write-behind the new process found 0 blocks (close discarded the host pool)."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)
    directory = tmp_path / "nvme"
    store = TieredStore([
        HostTier(capacity_bytes=64 << 20, slot_bytes=layout.block_nbytes),
        DiskTier(directory, capacity_bytes=1 << 30),
    ])
    rng = np.random.default_rng(7)
    expected: dict[bytes, str] = {}
    for model in ("org/model-a", "org/model-b", "org/model-c"):
        cache = ContextCache(store, Namespace(model, layout, weights_revision="r1", tenant="acme"))
        tokens = rng.integers(0, 32_000, 500)  # 3 x 500 = 1,500 tokens
        keys = cache.keys(tokens)
        blocks = [rng.standard_normal(layout.block_shape).astype(np.float16) for _ in keys]
        assert cache.save(keys, blocks) == [Status.OK] * len(keys)
        expected.update({k: sha(b) for k, b in zip(keys, blocks)})
    assert len(expected) == 3 * (500 // 16)
    store.close()
    digests = digests_in_new_process(directory, 1 << 30, {k: layout.block_nbytes for k in expected})
    recovered = sum(digests[k.hex()] == d for k, d in expected.items())
    assert recovered == len(expected), f"{recovered} of {len(expected)} blocks recovered"


# -- evictions: clean costs nothing, dirty is demoted at once ---------------------------------------
def test_evicting_a_clean_block_writes_nothing_below(tmp_path, small_ns):
    layout = small_ns.layout
    lower = Recording(DiskTier(tmp_path / "disk", 1 << 26))
    store = TieredStore([host_of(4, layout), lower])
    first, second = chain(small_ns, 4), chain(small_ns, 4, start=10_000)
    store.put(first, [content(i, layout) for i in range(4)])
    assert store.flush_dirty(30.0).flushed == 4
    store.put(second, [content(10 + i, layout) for i in range(4)])  # evicts every block of the first chain
    store.flush_dirty(30.0)
    stats = store.stats()
    assert stats["tiers"]["host"]["evictions"] == 4
    assert stats["store"]["clean_evictions"] == 4 and stats["store"]["demotions"] == 0
    assert lower.put_keys == Counter({k: 1 for k in first + second})  # each block written below once
    for i, key in enumerate(first):
        assert np.array_equal(read_back(store, key, layout.block_nbytes), content(i, layout))
    store.close()


def test_evicting_a_dirty_block_demotes_it_at_once(tmp_path, small_ns):
    layout = small_ns.layout
    lower = Recording(DiskTier(tmp_path / "disk", 1 << 26))
    lower.gate = threading.Event()  # the flusher stalls on its first copy
    store = TieredStore([host_of(4, layout), lower], writebehind_batch_blocks=1)
    first = chain(small_ns, 4)
    store.put(first, [content(i, layout) for i in range(4)])
    assert lower.flusher_waiting.wait(10)
    store.put(chain(small_ns, 3, start=10_000), [content(10 + i, layout) for i in range(3)])
    # blocks 1..3 were still dirty (block 0 is pinned by its copy in flight): evicted, so demoted now
    assert all(lower.contains(k) for k in first[1:])
    assert store.stats()["store"]["demotions"] == 3
    lower.gate.set()
    assert store.flush_dirty(30.0).dropped == 0
    for i, key in enumerate(first):
        assert np.array_equal(read_back(lower, key, layout.block_nbytes), content(i, layout))
    store.close()


# -- bounds -------------------------------------------------------------------------------------------
def test_the_dirty_backlog_is_bounded_and_a_full_one_never_blocks_the_caller(tmp_path, small_ns):
    layout = small_ns.layout
    lower = Recording(DiskTier(tmp_path / "disk", 1 << 26))
    lower.gate = threading.Event()
    host = host_of(64, layout)
    store = TieredStore([host, lower], dirty_limit_blocks=5, writebehind_batch_blocks=1)
    keys = chain(small_ns, 20)
    store.put(keys[:1], [content(0, layout)])
    assert lower.flusher_waiting.wait(10)  # block 0 is in flight, stalled
    start = time.monotonic()
    assert store.put(keys[1:], [content(i, layout) for i in range(1, 20)]) == [Status.OK] * 19
    assert time.monotonic() - start < 1.0  # the stall did not reach the caller
    stats = store.stats()["store"]
    assert stats["dirty_blocks"] == 1 + 5  # in flight + the backlog's bound
    assert stats["writebehind_dropped"] == 14  # the oldest marks went
    lower.gate.set()
    report = store.flush_dirty(30.0)
    assert (report.flushed, report.dropped) == (6, 0)
    # a dropped mark loses no block: it is not clean, so its eviction still demotes it
    dropped = keys[1:15]
    assert not any(lower.contains(k) for k in dropped)
    store.put(chain(small_ns, 64, start=20_000), [content(1000 + i, layout) for i in range(64)])
    for i, key in enumerate(keys):
        assert np.array_equal(read_back(lower, key, layout.block_nbytes), content(i, layout)), i
    store.close()


def test_a_flush_against_a_stalled_tier_returns_in_time_and_reports_what_is_left(small_ns, caplog):
    layout = small_ns.layout
    lower = FaultyTier(host_of(64, layout, "slow"), Faults(delay_s=0.3))
    store = TieredStore([host_of(64, layout), lower])
    store.put(chain(small_ns, 10), [content(i, layout) for i in range(10)])
    report = store.flush_dirty(0.2)
    assert report.dropped > 0 and report.seconds < 0.2 + 0.25
    assert store.stats()["store"]["dirty_blocks"] > 0  # still queued: a flush is not a close
    caplog.set_level(logging.INFO, logger="kvtier.store.tiered")
    start = time.monotonic()
    report = store.close(flush_timeout_s=0.1)
    assert time.monotonic() - start < 3.0  # bounded even though the flusher is stuck in a put
    assert report.dropped > 0
    assert store.stats()["store"]["writebehind_dropped"] > 0
    assert any("dropped" in r.getMessage() for r in caplog.records if r.name == "kvtier.store.tiered")
    assert store.close() == report  # a second close does nothing more: it returns the first close's report


# -- the other modes ------------------------------------------------------------------------------------
def test_write_through_and_a_single_tier_have_nothing_dirty(tmp_path, small_ns):
    layout = small_ns.layout
    keys = chain(small_ns, 3)
    blocks = [content(i, layout) for i in range(3)]
    lower = Recording(host_of(16, layout, "slow"))
    through = TieredStore([host_of(16, layout), lower], write_mode="write-through")
    through.put(keys, blocks)
    assert all(lower.contains(k) for k in keys)  # at once, by the caller's put
    assert through.stats()["store"]["dirty_blocks"] == 0
    assert through.close() == (0, 0, 0.0)
    assert lower.put_keys == Counter({k: 1 for k in keys})

    single = TieredStore([host_of(2, layout)])
    assert single.put(keys, blocks)[-1] is Status.OK
    single.schedule_writeback(keys)  # nothing below: nothing to do
    stats = single.stats()["store"]
    assert stats["dirty_blocks"] == 0 and stats["demotions"] == 0 and stats["writebehind_dropped"] == 0
    assert single.flush_dirty(1.0) == (0, 0, 0.0)
    assert single.close() == (0, 0, 0.0)

    assert TieredStore([host_of(1, layout, "a"), host_of(1, layout, "b")],
                       write_mode="write-back").write_mode is WriteMode.WRITE_BEHIND


# -- concurrency -------------------------------------------------------------------------------------
def test_puts_evictions_pins_deletes_and_write_behind_race_without_a_wrong_byte(tmp_path, small_ns):
    """A working set of 4x the host's capacity put by several threads while others read, pin
    and delete: afterwards the accounting holds, every block put is readable with its own
    bytes (the disk below has room for all: nothing may be lost), every deleted one is gone."""
    layout = small_ns.layout
    host = host_of(16, layout)
    disk = DiskTier(tmp_path / "disk", 1 << 26)
    store = TieredStore([host, disk], dirty_limit_blocks=8, writebehind_batch_blocks=4)
    chains = [chain(small_ns, 8, start=1000 * c) for c in range(8)]  # 64 keys
    index = {k: c * 8 + i for c, ks in enumerate(chains) for i, k in enumerate(ks)}
    doomed = chain(small_ns, 16, start=30_000)
    doomed_index = {k: 5000 + i for i, k in enumerate(doomed)}
    stored: set[bytes] = set()
    wrong: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def putter(seed):
        r = random.Random(seed)
        for _ in range(30):
            ks = chains[r.randrange(8)]
            statuses = store.put(ks, [content(index[k], layout) for k in ks])
            with lock:
                stored.update(k for k, s in zip(ks, statuses) if s is Status.OK)

    def reader(seed):
        r = random.Random(seed)
        while not stop.is_set():
            key = r.choice(list(index))
            out = np.full(layout.block_nbytes, POISON, np.uint8)
            if store.get([key], [out]).loaded and not np.array_equal(out, content(index[key], layout)):
                wrong.append(key.hex())

    def pinner(seed):
        r = random.Random(seed)
        while not stop.is_set():
            key = r.choice(list(index))
            if host.pin(key):
                time.sleep(0.001)
                host.unpin(key)

    def deleter():
        for key in doomed:  # put, then delete at once: races its own write-behind copy
            store.put([key], [content(doomed_index[key], layout)], parents=[None])
            store.delete([key])

    workers = [threading.Thread(target=putter, args=(s,)) for s in range(3)]
    workers.append(threading.Thread(target=deleter))
    watchers = [threading.Thread(target=reader, args=(s,)) for s in range(2)]
    watchers.append(threading.Thread(target=pinner, args=(9,)))
    for t in workers + watchers:
        t.start()
    for t in workers:
        t.join(120)
    stop.set()
    for t in watchers:
        t.join(30)
    assert store.flush_dirty(60.0).dropped == 0
    store.check_integrity()
    assert not wrong, f"wrong bytes returned for {wrong[:3]}"
    assert host.stats.evictions >= 3 * 16  # the race was real
    assert len(stored) == 64
    for key in stored:
        out = read_back(store, key, layout.block_nbytes)
        assert out is not None and np.array_equal(out, content(index[key], layout)), key.hex()
    for key in doomed:
        assert not host.contains(key) and not disk.contains(key), "a deleted block came back"
    store.check_integrity()
    store.close()
