"""The scheduler side's plans, without an engine: hits cut to pages, partial blocks, saves, P/D waits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

from kvtier.core.layout import KVLayout  # noqa: E402
from kvtier.core.namespace import Namespace  # noqa: E402
from kvtier.integrations.vllm.config import ConnectorConfig, EngineKV  # noqa: E402
from kvtier.integrations.vllm.scheduler_side import SchedulerSide  # noqa: E402
from kvtier.store.tiered import PrefixMatch  # noqa: E402

PAGE, BLOCK = 32, 64  # two vLLM pages per kvtier block


@pytest.fixture
def engine() -> EngineKV:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", block_tokens=BLOCK)
    return EngineKV(Namespace("m", layout), page_tokens=PAGE, hash_tokens=PAGE, num_layers=2, format_tag="test")


def request(req_id: str, num_tokens: int, params=None):
    hashes = [f"{req_id}:{i}".encode().ljust(32, b".") for i in range(num_tokens // PAGE)]
    return SimpleNamespace(request_id=req_id, num_tokens=num_tokens, block_hashes=hashes, kv_transfer_params=params)


class FakeStore:
    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def hold(self, engine: EngineKV, req, blocks: int) -> None:
        self.keys |= set(engine.keys(engine.block_hashes(req.block_hashes, req.num_tokens))[:blocks])

    def lookup(self, keys) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.keys:
            n += 1
        return n


def side(engine, store, **config) -> SchedulerSide:
    # Plans are the subject here: loads stay asynchronous even for a request alone
    # (the tests of sync_load_when_alone turn it back on).
    config.setdefault("sync_load_when_alone", False)
    return SchedulerSide(ConnectorConfig(block_tokens=BLOCK, **config), engine, store.lookup, loads=True, saves=True)


def output(new=(), total=1):
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
                           num_scheduled_tokens={n.req_id: n.scheduled for n in new}, total_num_scheduled_tokens=total)


def test_hit_starts_inside_a_block_after_vllms_local_pages(engine):
    store, req = FakeStore(), request("a", 1000)
    store.hold(engine, req, 10)
    sched = side(engine, store)
    assert sched.num_new_matched_tokens(req, 96) == (640 - 96, True)
    sched.after_alloc(req, list(range(100, 132)), 640 - 96)
    (job,) = sched.build(output(total=0)).loads
    assert job.is_async and len(job.hashes) == 10
    first = job.blocks[0]
    assert (first.index, first.first, first.page_ids) == (1, 1, [103])  # page 2 of block 1 is local
    assert [(t.index, t.first, len(t.page_ids)) for t in job.blocks[1:]] == [(i, 0, 2) for i in range(2, 10)]


@pytest.mark.parametrize("async_load", [True, False])
@pytest.mark.parametrize(("tokens", "hit"), [(640, 608), (641, 608), (642, 640)])
def test_a_hit_leaves_at_least_two_tokens_to_compute(engine, async_load, tokens, hit):
    store, req = FakeStore(), request("b", tokens)
    store.hold(engine, req, 10)
    sched = side(engine, store, async_load=async_load)
    assert sched.num_new_matched_tokens(req, 0) == (hit, async_load)
    sched.after_alloc(req, list(range(21)), hit)
    (job,) = sched.build(output()).loads
    last = job.blocks[-1]
    assert (last.index, last.first, len(last.page_ids)) == (hit // BLOCK - (hit % BLOCK == 0), 0, 2 - (hit % BLOCK) // PAGE)


def test_saves_follow_chunked_prefill_and_skip_what_the_store_has(engine):
    store, req = FakeStore(), request("c", 300)
    store.hold(engine, req, 1)
    sched = side(engine, store)
    assert sched.num_new_matched_tokens(req, 0) == (64, True)
    pages = list(range(50, 60))
    new = SimpleNamespace(req_id="c", block_ids=(pages,), num_computed_tokens=64, scheduled=100)
    meta = sched.build(output([new]))
    (save,) = meta.saves
    assert [(t.index, t.page_ids) for t in save.blocks] == [(1, [52, 53])]  # 164 computed: block 1 is full
    assert sched.stats.save_blocks == 1


def test_pages_out_of_a_sliding_window_are_never_saved_nor_loaded_into(engine):
    """vLLM's null page (block id 0) stands where a sliding window dropped a request's leading
    pages: a local hit's or external tokens'. Saving it would store zeros under a real block's
    key; loading into it would overwrite the zeros vLLM relies on."""
    from kvtier.integrations.vllm.scheduler_side import NULL_PAGE

    # a local (vLLM) prefix hit of 4 blocks whose first 5 pages fell out of the window, and
    # a store that holds none of it: the save must skip the blocks with the null page
    store, req = FakeStore(), request("w", 600)
    sched = side(engine, store)
    assert sched.num_new_matched_tokens(req, 256) == (0, False)
    pages = [NULL_PAGE] * 5 + list(range(70, 80))
    new = SimpleNamespace(req_id="w", block_ids=(pages,), num_computed_tokens=256, scheduled=200)
    (save,) = sched.build(output([new])).saves
    # 456 computed: 7 full blocks, of which 0-2 hold the null page
    assert [(t.index, t.page_ids) for t in save.blocks] == [(3, [71, 72]), (4, [73, 74]), (5, [75, 76]),
                                                            (6, [77, 78])]
    # as a prefill instance it announces no block to a decode instance: the store will hold
    # blocks 3-6 but not 0-2, so no prefix of them (announcing 7 made a decode instance wait
    # pd_wait_s for blocks that never come)
    assert sched.finished(req)[1]["kvtier_blocks"] == 0
    # control: the same plan without a window saves every block, and announces them
    store2, req2 = FakeStore(), request("f", 600)
    sched2 = side(engine, store2)
    sched2.num_new_matched_tokens(req2, 256)
    full = SimpleNamespace(req_id="f", block_ids=(list(range(100, 115)),), num_computed_tokens=256, scheduled=200)
    (save2,) = sched2.build(output([full])).saves
    assert [t.index for t in save2.blocks] == [0, 1, 2, 3, 4, 5, 6]
    assert sched2.finished(req2)[1]["kvtier_blocks"] == 7

    # external tokens whose leading pages are out of the window: the load starts after them
    store3, req3 = FakeStore(), request("x", 640)
    store3.hold(engine, req3, 10)
    sched3 = side(engine, store3)
    assert sched3.num_new_matched_tokens(req3, 0) == (608, True)
    sched3.after_alloc(req3, [NULL_PAGE] * 7 + list(range(200, 214)), 608)
    (job,) = sched3.build(output(total=0)).loads
    assert all(NULL_PAGE not in t.page_ids for t in job.blocks)
    assert (job.blocks[0].index, job.blocks[0].first, job.blocks[0].page_ids) == (3, 1, [200])
    assert sum(len(t.page_ids) for t in job.blocks) == 19 - 7
    # every external page out of the window: an empty job, so the asynchronous load still ends
    store4, req4 = FakeStore(), request("y", 640)
    store4.hold(engine, req4, 10)
    sched4 = side(engine, store4)
    sched4.num_new_matched_tokens(req4, 0)
    sched4.after_alloc(req4, [NULL_PAGE] * 19 + [300, 301], 608)
    (empty,) = sched4.build(output(total=0)).loads
    assert empty.blocks == [] and empty.hashes == []


def test_a_failed_load_is_never_offered_again(engine):
    store, req = FakeStore(), request("d", 400)
    store.hold(engine, req, 6)
    sched = side(engine, store)
    external, _ = sched.num_new_matched_tokens(req, 0)
    sched.after_alloc(req, list(range(13)), external)
    sched.build(output(total=0))
    sched.update({"d"}, {3})
    assert sched.num_new_matched_tokens(req, 0) == (0, False)
    delay, params = sched.finished(req)
    assert not delay and params["kvtier_loaded_tokens"] == 0


def test_decode_instance_waits_for_announced_blocks_then_gives_up(engine):
    store, req = FakeStore(), request("e", 400, params={"kvtier_blocks": 6})
    store.hold(engine, req, 2)
    waiting = side(engine, store, pd_wait_s=60)
    assert waiting.num_new_matched_tokens(req, 0) == (None, False)
    store.hold(engine, req, 6)
    assert waiting.num_new_matched_tokens(req, 0) == (384, True)
    impatient = side(engine, FakeStore(), pd_wait_s=0)
    assert impatient.num_new_matched_tokens(request("f", 400, params={"kvtier_blocks": 6}), 0) == (0, False)


def test_a_request_finished_mid_load_keeps_its_pages(engine):
    store, req = FakeStore(), request("g", 300)
    store.hold(engine, req, 4)
    sched = side(engine, store)
    external, _ = sched.num_new_matched_tokens(req, 0)
    sched.after_alloc(req, list(range(10)), external)
    delay, params = sched.finished(req)
    assert delay and params == {"kvtier_blocks": 4, "kvtier_loaded_tokens": 256}


def test_a_request_alone_loads_in_its_forward_step_and_one_beside_others_asynchronously(engine):
    store, alone, other, late = FakeStore(), request("alone", 640), request("other", 640), request("late", 640)
    for req in (alone, other, late):
        store.hold(engine, req, 10)
    sched = side(engine, store, sync_load_when_alone=True)
    assert sched.num_new_matched_tokens(alone, 0) == (608, False), "nothing else to compute: no idle step"
    sched.after_alloc(alone, list(range(21)), 608)
    (job,) = sched.build(output()).loads
    assert not job.is_async
    assert sched.num_new_matched_tokens(other, 0) == (608, True), "another request runs: do not stall it"
    sched.after_alloc(other, list(range(100, 121)), 608)
    (job,) = sched.build(output(total=0)).loads
    assert job.is_async
    assert sched.finished(alone)[0] is False, "a synchronous load holds no pages past the request"
    sched.finished(other)
    assert sched.num_new_matched_tokens(late, 0) == (608, False), "alone again once the others finished"


def test_async_load_off_means_synchronous_even_beside_others(engine):
    store, a, b = FakeStore(), request("a", 640), request("b", 640)
    store.hold(engine, a, 10)
    store.hold(engine, b, 10)
    sched = side(engine, store, async_load=False, sync_load_when_alone=True)
    assert sched.num_new_matched_tokens(a, 0) == (608, False)
    assert sched.num_new_matched_tokens(b, 0) == (608, False)


def test_a_small_load_from_tiers_with_bounded_reads_runs_in_its_forward_step_even_beside_others(engine):
    """An asynchronous load costs the request a whole engine step of waiting (its pages held
    meanwhile); a memcpy of a few hundred KiB from DRAM, or one call to a server with its
    deadline, costs the step far less. A disk read has no bound: it stays asynchronous."""
    store, first, small = FakeStore(), request("first", 640), request("small", 640)
    for req in (first, small):
        store.hold(engine, req, 10)
    where = {"tiers": ["host"] * 10}

    def lookup(keys):
        hit = store.lookup(keys)
        return PrefixMatch(hit, where["tiers"][:hit])

    def sched_with(lookup=lookup, **config):
        s = SchedulerSide(ConnectorConfig(block_tokens=BLOCK, sync_load_when_alone=False, **config), engine,
                          lookup, loads=True, saves=True, bounded_tiers=frozenset({"host", "remote"}))
        s.num_new_matched_tokens(first, 0)  # another request is in the engine
        return s

    sched = sched_with()  # default limit: 8 MiB; this load is 608 tokens x 1 KiB
    assert sched.num_new_matched_tokens(small, 0) == (608, False)
    sched.after_alloc(small, list(range(100, 121)), 608)
    (job,) = sched.build(output()).loads
    assert not job.is_async and sched.finished(small)[0] is False, "no pages held past the request"
    # a server's blocks (another worker computed them): one call with its deadline, not a step's wait
    where["tiers"] = ["host"] * 4 + ["remote"] * 6
    assert sched_with().num_new_matched_tokens(small, 0) == (608, False)
    # only the blocks the load reads count: those in vLLM's own pages may sit anywhere
    where["tiers"] = ["disk"] * 4 + ["remote"] * 6
    assert sched_with().num_new_matched_tokens(small, 4 * BLOCK) == (608 - 4 * BLOCK, False)
    # controls: a load over the limit, one with a block only the disk holds, or one whose
    # tiers are not known here (a lookup socket) stays asynchronous
    assert sched_with().num_new_matched_tokens(small, 0) == (608, True), "its first blocks are on disk"
    where["tiers"] = ["host"] * 9 + ["disk"]
    assert sched_with().num_new_matched_tokens(small, 0) == (608, True)
    where["tiers"] = ["host"] * 4 + ["remote"] * 6
    assert sched_with(sync_load_max_bytes="512KiB").num_new_matched_tokens(small, 0) == (608, True)
    assert sched_with(sync_load_max_bytes=0).num_new_matched_tokens(small, 0) == (608, True)
    assert sched_with(lookup=store.lookup).num_new_matched_tokens(small, 0) == (608, True), \
        "tiers unknown (a lookup socket)"


def test_sync_load_max_bytes_takes_sizes_and_refuses_nonsense():
    assert ConnectorConfig(sync_load_max_bytes="2MiB").sync_load_max_bytes == 2 << 20
    assert ConnectorConfig.from_extra_config({"sync_load_max_bytes": 4096}).sync_load_max_bytes == 4096
    with pytest.raises(Exception, match="sync_load_max_bytes"):
        ConnectorConfig(sync_load_max_bytes=-1)


def test_only_kv_caches_whose_pages_stay_until_saved_are_accepted():
    """A sliding window frees the pages behind it while the request runs: a block longer than
    the window could lose its first pages (to another request) before it is saved."""
    import torch
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, HiddenStateCacheSpec,
                                            MLAAttentionSpec, SlidingWindowSpec)

    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.config import check_kv_cache_kind

    geometry = dict(block_size=PAGE, num_kv_heads=2, head_size=32, dtype=torch.float32)
    check_kv_cache_kind(FullAttentionSpec(**geometry), 256)
    window = SlidingWindowSpec(**geometry, sliding_window=128)
    check_kv_cache_kind(window, 128)
    check_kv_cache_kind(window, PAGE)
    with pytest.raises(ConfigError, match="at most the window .e.g. 128"):
        check_kv_cache_kind(window, 256)
    with pytest.raises(ConfigError, match="pages .32 tokens. are longer"):
        check_kv_cache_kind(SlidingWindowSpec(**geometry, sliding_window=16), PAGE)
    latent = dict(geometry, num_kv_heads=1, head_size=576)
    check_kv_cache_kind(MLAAttentionSpec(**latent), 256)   # latent attention keeps its pages as full does
    for other in (ChunkedLocalAttentionSpec(**geometry, attention_chunk_size=256),
                  HiddenStateCacheSpec(**latent)):
        with pytest.raises(ConfigError, match=type(other).__name__):
            check_kv_cache_kind(other, PAGE)
    with pytest.raises(ConfigError, match="deepseek_v4.s sparse"):
        check_kv_cache_kind(MLAAttentionSpec(**latent, model_version="deepseek_v4"), PAGE)


def test_a_request_that_skips_the_prefix_cache_is_not_looked_up(engine):
    """vLLM reads no cached block for a request with prompt logprobs (``skip_reading_prefix_cache``)
    and zeroes the connector's answer after asking: the lookup (a round trip to the server) and
    any P/D wait were spent for nothing. Control: the same request otherwise is looked up and
    waits for the blocks its prefill instance announced."""
    store, req = FakeStore(), request("s", 1000, params={"kvtier_blocks": 20})
    store.hold(engine, req, 10)
    sched = side(engine, store)
    req.skip_reading_prefix_cache = True
    assert sched.num_new_matched_tokens(req, 0) == (0, False)
    assert sched.stats.lookups == 0 and sched.stats.pd_waits == 0
    req.skip_reading_prefix_cache = False   # control: looked up, and waits for the 20 announced blocks
    assert sched.num_new_matched_tokens(req, 0) == (None, False)
    assert sched.stats.lookups == 1 and sched.stats.pd_waits == 1
