"""The worker side's load path on real tensors and a real store (host pool + disk), without an engine.

A load writes vLLM's pages straight from the host pool where the pool holds a
block, through the store (staging, verified) where only the disk does, and
stops at the first block no tier holds. Pages are poisoned first, so a page
the load claims without writing shows as NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

import torch  # noqa: E402

from kvtier.core.layout import KVLayout  # noqa: E402
from kvtier.core.namespace import Namespace  # noqa: E402
from kvtier.integrations.vllm.config import EngineKV  # noqa: E402
from kvtier.integrations.vllm.metadata import BlockTransfer, LoadJob  # noqa: E402
from kvtier.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvtier.store.config import StoreConfig, build_store  # noqa: E402
from kvtier.tiers.base import Status  # noqa: E402

PAGE, BLOCK, LAYERS, PAGES = 32, 64, 2, 40
PAGE_SHAPE = (2, PAGE, 64)  # heads, tokens, K and V of head_dim 32


@pytest.fixture
def engine() -> EngineKV:
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=2, head_dim=32, dtype="float32", block_tokens=BLOCK)
    return EngineKV(Namespace("m", layout), page_tokens=PAGE, hash_tokens=PAGE, num_layers=LAYERS, format_tag="t")


@pytest.fixture
def store(engine, tmp_path):
    store = build_store(StoreConfig(host_bytes="8MiB", disk_path=str(tmp_path), disk_bytes="64MiB"), engine.layout)
    yield store
    store.close(flush_timeout_s=0)


def worker(engine, store) -> tuple[WorkerSide, list[torch.Tensor]]:
    side = WorkerSide(engine, store, poison=True)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(PAGES, *PAGE_SHAPE) for i in range(LAYERS)}
    side.register(caches)
    return side, [caches[f"model.layers.{i}.self_attn.attn"] for i in range(LAYERS)]


def blocks(engine, n: int, seed: int = 0) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    hashes = [bytes([seed, i]).ljust(32, b"h") for i in range(n)]
    data = [rng.standard_normal(engine.layout.block_nbytes // 4).astype(np.float32).view(np.uint8) for _ in range(n)]
    return hashes, data


def pages_of(data: np.ndarray) -> np.ndarray:
    return data.view(np.float32).reshape(LAYERS, BLOCK // PAGE, *PAGE_SHAPE)


def test_a_load_mixes_host_pool_and_disk_blocks_and_stops_at_the_first_miss(engine, store):
    side, kv = worker(engine, store)
    hashes, data = blocks(engine, 5)
    keys = engine.keys(hashes)
    host, disk = store.tiers
    for i in (0, 2, 4):  # block 3 is nowhere: block 4 is useless without it
        assert host.put(keys[i], data[i]) is Status.OK
    assert disk.put(keys[1], data[1]) is Status.OK  # only on disk
    # pages in no particular order, a run of consecutive ids, and a load starting mid-block
    transfers = [BlockTransfer(0, 1, [7]), BlockTransfer(1, 0, [3, 9]), BlockTransfer(2, 0, [10, 11]),
                 BlockTransfer(3, 0, [20, 21]), BlockTransfer(4, 0, [22, 23])]
    failed = side._load(LoadJob("r", hashes, transfers, is_async=False))
    assert failed == {20, 21, 22, 23}
    for t in transfers[:3]:
        want = pages_of(data[t.index])
        for layer in range(LAYERS):
            for k, page in enumerate(t.page_ids):
                assert torch.equal(kv[layer][page], torch.from_numpy(want[layer, t.first + k])), (t, layer, page)
    for page in (20, 21, 22, 23):
        assert torch.isnan(kv[0][page]).all(), "pages of unloaded blocks stay poisoned (vLLM recomputes them)"
    assert side.stats.loaded_blocks == 3
    # the disk block is promoted into the pool (in the background, after the load)
    assert store.wait_promotions(10)
    assert host.contains(keys[1])


def test_a_host_block_of_another_size_is_not_borrowed(engine, store):
    """A wrong-size entry under a block's key is a miss for the pool's zero-copy path, as for its get."""
    side, kv = worker(engine, store)
    hashes, data = blocks(engine, 1, seed=3)
    key = engine.keys(hashes)[0]
    assert store.tiers[0].put(key, data[0][: len(data[0]) // 2]) is Status.OK
    failed = side._load(LoadJob("r", hashes, [BlockTransfer(0, 0, [5, 6])], is_async=False))
    assert failed == {5, 6} and torch.isnan(kv[1][5]).all()


@pytest.mark.parametrize("page_shape", [(PAGE, 576), (1, PAGE, 576)], ids=["gpu-3d", "cpu-4d"])
def test_latent_pages_round_trip_through_a_block_in_both_shapes_vllm_gives_them(page_shape):
    """A latent-attention (MLA) cache has one 576-wide row a token and no V. vLLM's GPU backends
    register ``[pages, tokens, latent]``, its CPU backend ``[pages, 1, tokens, latent]``; only the
    second runs in the suite's real engines. Saved pages come back, page for page, into other
    page ids; a K/V-shaped cache of the same bytes is refused (the layout says one part)."""
    from kvtier.errors import LayoutError
    from kvtier.integrations.vllm.paged_layout import PagedKV

    layout = KVLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=576, dtype="float32", block_tokens=BLOCK,
                      kv_parts=1)
    engine = EngineKV(Namespace("m", layout), page_tokens=PAGE, hash_tokens=PAGE, num_layers=LAYERS, format_tag="t")
    gen = torch.Generator().manual_seed(1)
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(PAGES, *page_shape, generator=gen) for i in range(LAYERS)}
    paged = PagedKV(caches, engine)
    buf = np.empty(layout.block_nbytes, np.uint8)
    paged.gather(BlockTransfer(0, 0, [7, 3]), buf)
    before = [c.clone() for c in caches.values()]
    paged.scatter(buf, BlockTransfer(0, 0, [20, 21]))
    for layer, (kv, old) in enumerate(zip(caches.values(), before)):
        assert torch.equal(kv[20], old[7]) and torch.equal(kv[21], old[3]), f"layer {layer}"
        assert not torch.equal(kv[22], old[7]), "control: only the pages asked for are written"
    with pytest.raises(LayoutError, match="needs"):
        PagedKV({name: t.view(PAGES, 2, PAGE, 288) for name, t in caches.items()}, engine)


def test_disk_blocks_are_scattered_from_the_disk_tiers_staging_as_they_are_verified(engine, store):
    """A run of blocks only the disk holds: each block's pages are written from the disk tier's
    reused staging ring once verified (while the next request is read), not copied through the
    connector's own staging buffers first."""
    side, kv = worker(engine, store)
    hashes, data = blocks(engine, 6, seed=3)
    keys = engine.keys(hashes)
    disk = store.tiers[1]
    assert disk.put_many(keys, data) == [Status.OK] * 6
    staged, sources = [], []
    take, scatter = side._buffers.take, side.paged.scatter

    def taking(n):
        got = take(n)
        staged.extend(b.__array_interface__["data"][0] for b in got)
        return got

    def scattering(src, transfer):
        sources.append(src.__array_interface__["data"][0])
        scatter(src, transfer)

    side._buffers.take = taking
    side.paged.scatter = scattering
    transfers = [BlockTransfer(i, 0, [2 * i, 2 * i + 1]) for i in range(6)]
    assert side._load(LoadJob("d", hashes, transfers, is_async=False)) == set()
    for t in transfers:
        want = pages_of(data[t.index])
        for layer in range(LAYERS):
            for k, page in enumerate(t.page_ids):
                assert torch.equal(kv[layer][page], torch.from_numpy(want[layer, k])), (t, layer, page)
    assert len(sources) == 6 and staged  # the connector still lends staging (other tiers read into it)
    assert not set(sources) & set(staged)


def test_the_stats_count_loads_run_between_steps_apart(engine, store):
    """``async_load_jobs``: how many loads kept their request out of the batch for a step."""
    from kvtier.integrations.vllm.metadata import KvtierMetadata

    side, _ = worker(engine, store)
    hashes, data = blocks(engine, 2, seed=3)
    for key, block in zip(engine.keys(hashes), data):
        assert store.tiers[0].put(key, block) is Status.OK
    jobs = [LoadJob("sync", hashes, [BlockTransfer(0, 0, [1, 2])], is_async=False),
            LoadJob("async", hashes, [BlockTransfer(0, 0, [3, 4])], is_async=True)]
    side.start_loads(KvtierMetadata(loads=jobs))
    assert side.finished_loads(wait_s=10) == {"async"}
    assert (side.stats.load_jobs, side.stats.async_load_jobs) == (2, 1)
