"""The worker side's save path on real tensors and a real store (host pool + disk), without an engine.

A save copies a block's pages out of vLLM's paged cache (in any page order, runs of
consecutive ids or not) into the store; what the store then holds must be exactly
those pages, layer-major. Staging buffers are poisoned before use, so a gather that
skips a layer or a page shows as NaN in the stored block.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

import torch  # noqa: E402

from kvtier.integrations.vllm.metadata import BlockTransfer, KvtierMetadata, SaveJob  # noqa: E402
from tests.integrations.vllm.test_worker_loads import LAYERS, PAGES, PAGE_SHAPE, engine, pages_of, store  # noqa: E402,F401
from kvtier.integrations.vllm.worker_side import WorkerSide  # noqa: E402


def filled_worker(engine, store) -> tuple[WorkerSide, list[torch.Tensor]]:
    side = WorkerSide(engine, store, poison=True)  # poison: staging buffers start as NaN
    gen = torch.Generator().manual_seed(7)
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(PAGES, *PAGE_SHAPE, generator=gen)
              for i in range(LAYERS)}
    side.register(caches)
    return side, [caches[f"model.layers.{i}.self_attn.attn"] for i in range(LAYERS)]


@pytest.mark.parametrize("page_ids", [[[4, 5], [6, 7], [8, 9]], [[9, 2], [30, 31], [17, 3]]],
                         ids=["consecutive", "scattered"])
def test_saved_blocks_hold_exactly_the_pages_of_their_transfers(engine, store, page_ids):
    side, kv = filled_worker(engine, store)
    hashes = [bytes([1, i]).ljust(32, b"s") for i in range(len(page_ids))]
    job = SaveJob("r", hashes, [BlockTransfer(i, 0, ids) for i, ids in enumerate(page_ids)])
    side.save(KvtierMetadata(saves=[job]))
    assert side.flush(10)
    assert side.stats.saved_blocks == len(page_ids) and side.stats.save_failures == 0
    keys = engine.keys(hashes)
    for i, ids in enumerate(page_ids):
        out = np.full(engine.layout.block_nbytes, 0xFF, dtype=np.uint8)
        assert store.get([keys[i]], [out]).loaded == 1
        got = pages_of(out)
        for layer in range(LAYERS):
            for k, page in enumerate(ids):
                assert torch.equal(torch.from_numpy(got[layer, k].copy()), kv[layer][page]), (i, layer, page)


def test_a_save_after_the_pages_change_stores_what_they_held_at_the_save(engine, store):
    """The copy happens in ``save`` (vLLM may reuse the pages once ``wait_for_save`` returns)."""
    side, kv = filled_worker(engine, store)
    before = [kv[layer][[11, 12]].clone() for layer in range(LAYERS)]
    hashes = [b"x".ljust(32, b"s")]
    side.save(KvtierMetadata(saves=[SaveJob("r", hashes, [BlockTransfer(0, 0, [11, 12])])]))
    for layer in range(LAYERS):
        kv[layer][11:13] = 0.0  # vLLM hands the pages to another request
    assert side.flush(10)
    out = np.empty(engine.layout.block_nbytes, dtype=np.uint8)
    assert store.get(engine.keys(hashes), [out]).loaded == 1
    for layer in range(LAYERS):
        assert torch.equal(torch.from_numpy(pages_of(out)[layer].copy()), before[layer])
