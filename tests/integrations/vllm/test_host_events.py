"""The connector's KV events of its host tier (medium "CPU"), without an engine.

vLLM's scheduler publishes its GPU pool's events and whatever the connector's ``take_events()``
returns (vllm/v1/core/sched/scheduler.py). A router credits a worker's host DRAM only from
``BlockStored``/``BlockRemoved`` of medium "CPU" (``kvtier route``: kvtier/router/index.py's CPU
bit): without them, once vLLM evicts a page, the router forgets the worker's host tier still
serves the block. Here: the worker's record of what its host tier holds (a real store: host
pool, write-behind to disk), the scheduler's queue (ranks, resets, bounds), the events' fields
against vLLM's own GPU events of the same pages, and both connectors in one process feeding the
router's real index. The end-to-end test with a real engine publishing on ZMQ is in
test_embedded.py.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import numpy as np
import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

import torch  # noqa: E402

from kvtier.core.keys import BlockKey  # noqa: E402
from kvtier.integrations.vllm.host_events import (  # noqa: E402
    HostBlock, HostEvents, HostResidency, Removed, host_tier, merge_reports,
)
from kvtier.store.config import StoreConfig, build_store  # noqa: E402
from kvtier.tiers.base import Status  # noqa: E402
from tests.integrations.vllm.test_connector_steps import new_req, short_dir  # noqa: E402,F401
from tests.integrations.vllm.test_scheduler_side import output  # noqa: E402
from tests.integrations.vllm.test_worker_loads import engine  # noqa: E402,F401

NBYTES = 64 << 10   # the test layout's block (test_worker_loads.engine): 2 layers x 2 x 2 heads x 64 x 32 x fp32


def _key(i: int) -> BlockKey:
    return BlockKey(bytes([7, i]).ljust(32, b"k"))


def _data(i: int) -> np.ndarray:
    return np.full(NBYTES, i % 251, dtype=np.uint8)


def _id(i: int) -> bytes:
    return bytes([9, i]).ljust(32, b"b")


@pytest.fixture
def stores(engine, tmp_path):  # noqa: F811
    made = []

    def make(**config):
        store = build_store(StoreConfig(**config), engine.layout)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close(flush_timeout_s=0)


def _save(residency: HostResidency, store, indexes, epoch=""):
    keys = [_key(i) for i in indexes]
    residency.saving(keys, [_id(i) for i in indexes], epoch)
    residency.saved(keys, store.put(keys, [_data(i) for i in indexes]))


# -- the worker: what its host tier holds ---------------------------------------------------
def test_a_saved_block_is_reported_held_and_its_eviction_gone_after_the_demotion_hook(stores, tmp_path):
    """Host pool of 4 blocks over a disk tier (write-behind: the host tier's on_evict demotes): the
    residency's hook runs after the demotion, which still lands the block on disk."""
    store = stores(host_bytes=4 * NBYTES, disk_path=str(tmp_path / "d"), disk_bytes="16MiB")
    residency = HostResidency(host_tier(store.tiers), rank=0, limit_blocks=5)
    _save(residency, store, [0, 1, 2])
    assert residency.take() == {("", _id(i)): (1, 0) for i in range(3)}
    assert residency.take() == {}, "a report is taken once"
    _save(residency, store, [3, 4, 5])           # two of blocks 0-2 go (which: the LRU order the
    gone = [i for i in range(3) if not store.tiers[0].contains(_key(i))]   # write-behind's reads left)
    assert len(gone) == 2
    assert residency.take() == {**{("", _id(i)): (0, 1) for i in gone},
                                **{("", _id(i)): (1, 0) for i in (3, 4, 5)}}
    assert all(store.tiers[1].contains(_key(i)) for i in gone), "the demotion hook it had still ran"
    assert residency.held() == 4


def test_an_eviction_during_the_save_wins_and_a_failed_put_is_never_held(stores):
    store = stores(host_bytes=4 * NBYTES)
    residency = HostResidency(host_tier(store.tiers), rank=2, limit_blocks=5)
    keys = [_key(0), _key(1)]
    residency.saving(keys, [_id(0), _id(1)], "")
    statuses = store.put(keys, [_data(0), _data(1)])
    store.tiers[0].on_evict(_key(0), memoryview(b""), None)   # evicted before the put's report
    residency.saved(keys, statuses)
    assert residency.take() == {("", _id(0)): (0, 4), ("", _id(1)): (4, 0)}   # rank 2's bit
    # a put that raised, and an OK that the host tier does not hold (write-through: another tier took it)
    residency.saving([_key(2), _key(3)], [_id(2), _id(3)], "")
    residency.saved([_key(2)], None)
    residency.saved([_key(3)], [Status.OK])
    assert residency.take() == {("", _id(2)): (0, 4), ("", _id(3)): (0, 4)}


def test_a_new_epoch_forgets_the_old_one_and_the_held_blocks_stay_under_the_host_tiers_count(stores):
    store = stores(host_bytes=8 * NBYTES)
    residency = HostResidency(host_tier(store.tiers), rank=0, limit_blocks=3)
    _save(residency, store, [0, 1, 2, 3])        # the tier holds 4, but at most 3 are told held
    report = residency.take()
    assert report[("", _id(0))] == (0, 1) and all(report[("", _id(i))] == (1, 0) for i in (1, 2, 3))
    assert residency.forgotten == 1 and residency.held() == 3
    _save(residency, store, [4], epoch="e1")     # a reset: the old epoch's blocks are the scheduler's no more
    assert residency.take() == {("e1", _id(4)): (1, 0)} and residency.held() == 1
    store.delete([_key(1)])
    residency.evicted(_key(1))
    assert residency.take() == {}, "an old epoch's block leaves silently"


def test_a_store_without_a_host_tier_has_no_residency(stores, tmp_path):
    assert host_tier(stores(host_bytes=0, disk_path=str(tmp_path / "d"), disk_bytes="16MiB").tiers) is None
    assert host_tier(stores(host_bytes=4 * NBYTES).tiers) is not None


def test_reports_of_two_ranks_merge_bit_by_bit():
    a = {("", b"x"): (1, 0), ("", b"y"): (0, 1)}
    b = {("", b"x"): (0, 2), ("", b"z"): (2, 0)}
    assert merge_reports(a, b) == {("", b"x"): (1, 2), ("", b"y"): (0, 1), ("", b"z"): (2, 0)}
    assert a == {("", b"x"): (1, 0), ("", b"y"): (0, 1)}, "the reports merged are left as they were"


def test_a_steps_reports_from_every_rank_reach_the_scheduler_as_one():
    """vLLM's KVOutputAggregator folds the workers' metadata with ``aggregate`` (tensor and pipeline
    ranks, each its own host tier)."""
    from kvtier.integrations.vllm.metadata import KvtierWorkerMetadata

    rank0 = KvtierWorkerMetadata(5, {("", b"x"): (1, 0)})
    rank1 = KvtierWorkerMetadata(5, {("", b"x"): (2, 0), ("", b"y"): (0, 2)})
    both = rank0.aggregate(rank1)
    assert (both.step, both.host) == (5, {("", b"x"): (3, 0), ("", b"y"): (0, 2)})
    assert KvtierWorkerMetadata(5).host == {}, "none without KV events or a host tier"


# -- the scheduler: the queue ----------------------------------------------------------------
def _block(index: int) -> HostBlock:
    return HostBlock((b"p%d" % (2 * index), b"p%d" % (2 * index + 1)), b"p%d" % (2 * index - 1) if index else None,
                     array("q", range(index * 64, index * 64 + 64)))


def _queue(workers=1, limit=100, pending=4096) -> HostEvents:
    return HostEvents(workers, lambda request, index: _block(index), limit, pending_blocks=pending)


def test_a_block_every_rank_holds_is_stored_once_and_removed_when_one_rank_loses_it():
    q = _queue(workers=2)
    q.planned(None, [(0, b"b0"), (1, b"b1")])
    q.report({("", b"b0"): (1, 0), ("", b"b1"): (1, 0)}, "")
    assert q.take() == [], "rank 1 does not hold them yet"
    q.report({("", b"b0"): (2, 0)}, "")
    assert q.take() == [_block(0)]
    q.report({("", b"b0"): (2, 0)}, "")
    assert q.take() == [], "stored once"
    q.report({("", b"b0"): (0, 1), ("", b"b1"): (0, 1)}, "")   # rank 0 lost both; b1 was never whole
    assert q.take() == [Removed(_block(0).page_hashes)]
    q.report({("", b"b1"): (2, 0), ("", b"b0"): (1, 0)}, "")
    assert q.take() == [], "a rank lost them: a save planned anew must come first"
    assert q.announced() == 0


def test_no_description_no_credit_and_an_older_epoch_is_ignored():
    q = _queue()
    q.report({("", b"b9"): (1, 0)}, "")                    # never planned here (or forgotten)
    q.planned(None, [(0, b"b0")])
    q.report({("", b"b0"): (1, 0)}, "e1")                  # its save was of the epoch before the reset
    assert q.take() == [] and q.announced() == 0


def test_a_reset_removes_every_block_announced():
    q = _queue()
    q.planned(None, [(i, b"b%d" % i) for i in range(3)])
    q.report({("", b"b%d" % i): (1, 0) for i in range(3)}, "")
    assert len(q.take()) == 3
    q.planned(None, [(3, b"b3")])
    q.reset()
    (removed,) = q.take()
    assert sorted(removed.page_hashes) == sorted(h for i in range(3) for h in _block(i).page_hashes)
    q.report({("", b"b3"): (1, 0)}, "e1")
    assert q.take() == [], "a description from before the reset is gone"


def test_the_queue_is_bounded_by_removing_never_by_forgetting_an_announced_block():
    q = _queue(limit=2, pending=3)
    q.planned(None, [(i, b"b%d" % i) for i in range(5)])   # 3 descriptions kept: b2, b3, b4
    q.report({("", b"b%d" % i): (1, 0) for i in range(5)}, "")
    assert q.take() == [_block(2), _block(3), _block(4), Removed(_block(2).page_hashes)]
    assert q.announced() == 2


# -- the events' fields: those of vLLM's own GPU events of the same pages -----------------------
def _vllm_request(tokens, **kw):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request("r", tokens, SamplingParams(max_tokens=4), None, block_hasher=get_request_block_hasher(32, sha256),
                   **kw)


def test_a_cpu_block_stored_says_what_vllms_gpu_events_of_its_pages_say(engine):  # noqa: F811
    """Page hashes, parent, tokens, LoRA, extra keys (the tenant's salt on the first page), group
    and spec kind as vLLM's BlockPool publishes them for the same pages, medium CPU."""
    from vllm.lora.request import LoRARequest
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvtier.integrations.vllm.connector import _block_describer, _vllm_events

    request = _vllm_request(list(range(100, 300)), cache_salt="tenant-a", lora_request=LoRARequest("ad", 7, "/x"))
    pool = BlockPool(16, True, 32, enable_kv_cache_events=True)
    pool.cache_full_blocks(request, pool.get_new_blocks(6), 0, 6, 32, 0)
    (gpu,) = pool.take_events()
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    describe = _block_describer(engine)       # 64-token blocks: two pages each
    first, second = _vllm_events([describe(request, 0), describe(request, 2)], engine, config)
    for event, pages in ((first, slice(0, 2)), (second, slice(4, 6))):
        assert event.medium == "CPU" and event.block_size == 32 and event.group_idx == 0
        assert event.kv_cache_spec_kind == "full_attention"
        assert event.block_hashes == gpu.block_hashes[pages]
        assert event.token_ids == gpu.token_ids[pages.start * 32:pages.stop * 32]
        assert event.extra_keys == gpu.extra_keys[pages]
        assert (event.lora_id, event.lora_name) == (gpu.lora_id, gpu.lora_name) == (7, "ad")
    assert first.parent_block_hash is None and second.parent_block_hash == gpu.block_hashes[3]
    assert first.extra_keys[0] == ("ad", "tenant-a")
    (removed,) = _vllm_events([Removed(describe(request, 2).page_hashes)], engine, config)
    assert (removed.medium, removed.block_hashes, removed.group_idx) == ("CPU", gpu.block_hashes[4:6], 0)


# -- both connectors in one process, into the router's index -------------------------------------
@pytest.fixture
def connectors(monkeypatch, short_dir):  # noqa: F811
    """``make(extra, events=True)``: a worker and a scheduler KvtierConnector in one process, sharing
    their store, with vLLM's KV events on or off."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import vllm.distributed.parallel_state as parallel_state
    from kvtier.integrations.vllm import connector as connector_mod
    from tests.integrations.vllm.test_integration_hostile import _kv_cache_config, _layers, _vllm_config

    monkeypatch.setenv("XDG_RUNTIME_DIR", short_dir)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=0))
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    made = []

    def make(extra: dict, events: bool = True):
        def config():
            c = _vllm_config(model_dtype=torch.float32)
            c.kv_transfer_config = SimpleNamespace(
                engine_id=f"engine-events-{len(made)}", kv_role="kv_both", kv_load_failure_policy="recompute",
                kv_connector_extra_config={"block_tokens": 64, "encrypt": False, **extra})
            c.kv_events_config = SimpleNamespace(enable_kv_cache_events=events)
            return c

        worker = connector_mod.KvtierConnector(config(), KVConnectorRole.WORKER,
                                               _kv_cache_config(spec, _layers((0, 1))))
        scheduler = connector_mod.KvtierConnector(config(), KVConnectorRole.SCHEDULER,
                                                  _kv_cache_config(spec, _layers((0, 1))))
        worker.register_kv_caches({name: torch.randn(16, 2, 32, 64) for name in _layers((0, 1))})
        made.append((scheduler, worker))
        return scheduler, worker

    yield make
    for scheduler, worker in made:
        scheduler.shutdown()
        worker.shutdown()


def _step(scheduler, worker, new=()):
    """One engine step as vLLM 0.32 runs it: build, load, save, report; then the events it publishes."""
    from vllm.v1.outputs import KVConnectorOutput

    meta = scheduler.build_connector_meta(output(new))
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    assert worker.worker.flush(10)
    report = KVConnectorOutput(finished_recving=worker.get_finished(set())[1],
                               invalid_block_ids=worker.get_block_ids_with_load_errors(),
                               kv_connector_worker_meta=worker.build_connector_worker_meta())
    worker.clear_connector_metadata()
    scheduler.update_connector_output(report)
    return list(scheduler.take_events())


def _admit(scheduler, req_id, tokens):
    request = _vllm_request(tokens)
    request.request_id = req_id
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    return request


def _gpu_events(request, pages: int):
    """vLLM's own GPU BlockStored of the request's first ``pages`` pages."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(64, True, 32, enable_kv_cache_events=True)
    pool.cache_full_blocks(request, pool.get_new_blocks(pages), 0, pages, 32, 0)
    return pool.take_events()


def test_the_connector_publishes_its_host_tier_and_the_router_credits_it_after_the_gpu_evicts(connectors):
    """The audit's E1: a GPU store then a GPU removal left the router believing the worker holds
    nothing, while its kvtier host tier held every block. Now the connector's CPU events keep the
    worker's CPU bit until the host tier itself evicts the block."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvtier.integrations.vllm.connector import KvtierConnector
    from kvtier.router.index import CPU, GPU, BlockIndex, worker_bit

    assert KvtierConnector.take_events is not KVConnectorBase_V1.take_events, "the connector publishes"
    scheduler, worker = connectors({"host_bytes": 3 * NBYTES})   # the host tier holds 3 blocks
    tokens = list(range(100, 300))
    request = _admit(scheduler, "a", tokens)
    events = _step(scheduler, worker, [new_req("a", list(range(1, 8)), 0, 200)])   # 3 blocks computed, saved
    assert [e.medium for e in events] == ["CPU"] * 3
    (gpu,) = _gpu_events(request, 6)
    index = BlockIndex(32)

    def apply(event):
        if type(event).__name__ == "BlockStored":
            index.stored(0, event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                         event.medium, lora_name=event.lora_name, extra_keys=event.extra_keys)
        else:
            index.removed(0, event.block_hashes, event.medium)

    keys = index.keys_of(tokens)
    apply(gpu)
    for event in events:
        apply(event)
    assert index.masks(keys)[:6] == [worker_bit(0, GPU) | worker_bit(0, CPU)] * 6
    index.removed(0, gpu.block_hashes, "GPU")                     # vLLM evicts the pages
    assert index.masks(keys)[:6] == [worker_bit(0, CPU)] * 6, "the host tier's copies stay credited"
    scheduler.request_finished(request, [])

    # another request's 3 blocks evict the first's from the 3-block host tier
    other = _admit(scheduler, "b", list(range(1000, 1200)))
    events = _step(scheduler, worker, [new_req("b", list(range(8, 15)), 0, 200)])
    removed = [h for e in events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    assert sorted(removed) == sorted(gpu.block_hashes), "every page of the evicted blocks, medium CPU"
    assert all(e.medium == "CPU" for e in events) and sum(type(e).__name__ == "BlockStored" for e in events) == 3
    for event in events:
        apply(event)
    assert index.masks(keys) == [], "evicted from the host tier too: nothing credited"
    scheduler.request_finished(other, [])

    # a reset: the host tier's blocks are unreachable (a new key epoch): all removed
    assert scheduler.reset_cache() is True
    (reset,) = list(scheduler.take_events())
    assert reset.medium == "CPU" and len(reset.block_hashes) == 6


def test_no_cpu_events_without_a_host_tier_or_without_kv_events(connectors, tmp_path):
    for extra, events in (({"host_bytes": 0, "disk_path": str(tmp_path / "d"), "disk_bytes": "16MiB"}, True),
                          ({"host_bytes": 3 * NBYTES}, False)):
        scheduler, worker = connectors(extra, events=events)
        assert scheduler.host_events is None and worker.worker.residency is None
        request = _admit(scheduler, "a", list(range(100, 300)))
        meta_saves = _step(scheduler, worker, [new_req("a", list(range(1, 8)), 0, 200)])
        assert meta_saves == [] and worker.worker.stats.saved_blocks == 3, "saved, not published"
        scheduler.request_finished(request, [])
