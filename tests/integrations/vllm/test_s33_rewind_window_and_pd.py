"""A failed synchronous load makes the worker drop every save of its step (s33 a9 D1, D2).

D1: the scheduler rewound those saves and planned them again from its own copy of the request's
page ids, which a sliding window's manager had freed meanwhile and given to another request: that
request's KV was stored under the rewound request's keys. D2: a prefill request that finished in
that step announced the dropped blocks (vLLM frees it before it hands over the step's report), and
a decode instance waited ``pd_wait_s`` for blocks never stored.

Scheduler side, one worker and a real store, without an engine; scheduler outputs are built as
vLLM's scheduler hands them over.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtier.core.layout import KVLayout  # noqa: E402
from kvtier.core.namespace import Namespace  # noqa: E402
from kvtier.integrations.vllm.config import ConnectorConfig, EngineKV  # noqa: E402
from kvtier.integrations.vllm.scheduler_side import PD_PARAM, SchedulerSide  # noqa: E402
from kvtier.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvtier.store.config import StoreConfig, build_store  # noqa: E402

PAGE, BLOCK, LAYERS, PAGES = 32, 64, 2, 64
PAGE_SHAPE = (2, PAGE, 64)
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=2, head_dim=32, dtype="float32", block_tokens=BLOCK)
SLIDING_TAG = "vllm-page/1 " + json.dumps({"engine": "vllm", "spec": "SlidingWindowSpec"}, sort_keys=True)
FULL_TAG = "vllm-page/1 " + json.dumps({"engine": "vllm", "spec": "FullAttentionSpec"}, sort_keys=True)


def _engine(tag: str = "t") -> EngineKV:
    return EngineKV(Namespace("m", LAYOUT), page_tokens=PAGE, hash_tokens=PAGE, num_layers=LAYERS, format_tag=tag)


def _request(req_id: str, tokens: int, params: dict | None = None):
    return SimpleNamespace(request_id=req_id, num_tokens=tokens, kv_transfer_params=params,
                           block_hashes=[f"{req_id}:{i}".encode().ljust(32, b".") for i in range(tokens // PAGE)])


def _output(new=(), running=()):
    """A vLLM ``SchedulerOutput``: ``new`` and ``running`` as (id, new page ids, tokens computed
    before the step, tokens scheduled)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(p,), num_computed_tokens=c) for r, p, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, *_ in running], resumed_req_ids=set(),
                                              new_block_ids=[(p,) for _, p, _, _ in running],
                                              num_computed_tokens=[c for _, _, c, _ in running]),
        num_scheduled_tokens={r: s for r, _, _, s in (*new, *running)},
        total_num_scheduled_tokens=1)


def _evicted_since_lookup(engine: EngineKV, request, store=None):
    """A lookup that finds 2 blocks of ``request`` (evicted before its load: the load fails), and
    the store's own prefix of any other request."""
    keys_of_request = set(engine.keys(engine.block_hashes(request.block_hashes, request.num_tokens)))
    return lambda keys: 2 if keys[0] in keys_of_request else (store.lookup(keys).hit_blocks if store else 0)


@pytest.fixture
def store(tmp_path):
    store = build_store(StoreConfig(host_bytes="8MiB"), LAYOUT)
    yield store
    store.close(flush_timeout_s=0)


def _worker(engine: EngineKV, store, fill: float):
    worker = WorkerSide(engine, store)
    caches = {f"model.layers.{i}.self_attn.attn": torch.full((PAGES, *PAGE_SHAPE), fill) for i in range(LAYERS)}
    worker.register(caches)
    return worker, list(caches.values())


def _run(worker, meta):
    """One step on the worker as vLLM runs it: loads, forward (done by the caller), saves, report."""
    worker.start_loads(meta)
    worker.save(meta)
    return worker.take_load_errors()


def _stored_values(engine: EngineKV, store, request, index: int) -> set[float] | None:
    """The values block ``index`` of ``request`` holds in the store; None where it is not stored."""
    key = engine.keys(engine.block_hashes(request.block_hashes, request.num_tokens))[index]
    buf = np.empty(LAYOUT.block_nbytes, np.uint8)
    if store.get([key], [buf]).loaded != 1:
        return None
    return set(np.unique(buf.view(np.float32)).tolist())


@pytest.mark.parametrize("window", [
    pytest.param({"window_tokens": 128, "tag": "t"}, id="window-given"),
    pytest.param({"window_tokens": None, "tag": SLIDING_TAG}, id="window-from-page-format"),
])
def test_rewound_saves_are_never_planned_from_pages_the_window_freed(store, window):
    """Step 0: A computes tokens 0..511 in pages 10..25 (chunks longer than a 128-token window), B's
    synchronous load fails, so the worker drops A's saves. Step 1: vLLM has freed A's pages of
    tokens more than the window behind (10..21) and gives 10, 11 to a new request C. A's rewound
    blocks in those pages are not saved again (a miss); the others hold A's KV."""
    engine = _engine(window["tag"])
    a, b = _request("A", 1024), _request("B", 256)
    given = {"window_tokens": window["window_tokens"]} if window["window_tokens"] else {}
    sched = SchedulerSide(ConnectorConfig(block_tokens=BLOCK, async_load=False), engine,
                          _evicted_since_lookup(engine, b), loads=True, saves=True, **given)
    worker, kv = _worker(engine, store, 0.0)
    assert sched.num_new_matched_tokens(a, 0) == (0, False)
    sched.after_alloc(a, list(range(10, 26)), 0)
    assert sched.num_new_matched_tokens(b, 0) == (128, False)
    sched.after_alloc(b, list(range(50, 58)), 128)
    meta0 = sched.build(_output(new=[("A", list(range(10, 26)), 0, 512), ("B", list(range(50, 58)), 128, 128)]))
    # no failure seen yet: every block A computes is planned, its first pages still in the window
    assert [t.index for job in meta0.saves if job.req_id == "A" for t in job.blocks] == list(range(8))
    for layer in kv:
        layer[10:26] = 1.0   # A's forward
    errors = _run(worker, meta0)
    assert errors == {50, 51, 52, 53} and worker.stats.saves_dropped
    sched.update(set(), errors, step=meta0.step)

    meta1 = sched.build(_output(new=[("C", [10, 11], 0, 64)], running=[("A", list(range(26, 42)), 512, 512)]))
    for layer in kv:
        layer[10:12] = -7.0   # C's forward in the pages vLLM freed of A's
        layer[26:42] = 1.0
    _run(worker, meta1)
    assert worker.flush(10)

    pages = {p for job in meta1.saves if job.req_id == "A" for t in job.blocks for p in t.page_ids}
    assert not pages & set(range(10, 22)), "a rewound save planned from pages vLLM freed"
    for index in range(16):
        held = _stored_values(engine, store, a, index)
        assert held in (None, {1.0}), f"A's block {index} holds another request's KV: {held}"
    assert _stored_values(engine, store, a, 0) is None
    assert _stored_values(engine, store, a, 15) == {1.0}


def test_window_from_the_engine_page_format():
    """Without the window, a sliding-window cache plans as if it were the narrowest the connector
    accepts (a block); full attention and other page formats keep every page."""
    config = ConnectorConfig(block_tokens=BLOCK)
    side = lambda tag: SchedulerSide(config, _engine(tag), lambda keys: 0, loads=True, saves=True)  # noqa: E731
    assert side(SLIDING_TAG).window_tokens == BLOCK
    assert side(FULL_TAG).window_tokens is None
    assert side("t").window_tokens is None


def _prefill_beside_a_failing_sync_load(store, *, with_load: bool):
    # (A request finishing beside a synchronous load that then FAILS still announces the saves the
    # worker drops, and its decode instance waits pd_wait_s for them: capping every request that
    # finishes beside any synchronous load announced none of the blocks of loads that succeed,
    # the common case: audit s33 r10 D2.)
    """A prefill request R (300 tokens) computed in one step with B, whose synchronous load fails
    (``with_load``); R stops there (``max_tokens=1``). Returns R's ``kv_transfer_params``, as vLLM
    takes them before it hands over the step's report, and the worker."""
    engine = _engine()
    r, b = _request("R", 300), _request("B", 256)
    sched = SchedulerSide(ConnectorConfig(block_tokens=BLOCK, async_load=False), engine,
                          _evicted_since_lookup(engine, b, store), loads=True, saves=True)
    worker, _ = _worker(engine, store, 1.0)
    assert sched.num_new_matched_tokens(r, 0) == (0, False)
    sched.after_alloc(r, list(range(10, 20)), 0)
    new = [("R", list(range(10, 20)), 0, 300)]
    if with_load:
        assert sched.num_new_matched_tokens(b, 0) == (128, False)
        sched.after_alloc(b, list(range(40, 48)), 128)
        new.append(("B", list(range(40, 48)), 128, 128))
    meta = sched.build(_output(new=new))
    errors = _run(worker, meta)
    assert worker.flush(10)
    _, params = sched.finished(r)   # vLLM: request_finished, then update_connector_output
    sched.update(set(), errors, step=meta.step)
    return engine, r, params, worker


def test_request_finishing_in_a_step_without_sync_load_still_announces_its_saves(store):
    """The normal P/D flow: the step's saves go, and the decode instance waits for them."""
    engine, r, params, worker = _prefill_beside_a_failing_sync_load(store, with_load=False)
    assert params[PD_PARAM] == 4
    assert worker.stats.saves_dropped == 0
    assert store.lookup(engine.keys(engine.block_hashes(r.block_hashes, r.num_tokens))).hit_blocks == 4


def test_the_connector_takes_a_window_only_from_a_group_that_frees_pages():
    """A pure sliding-window model's group frees what falls out of its window: that window is
    taken. A hybrid model (Gemma 2/3) under a connector has its sliding layers unified into a
    full-attention group that still names a window but frees nothing: taken as a window, the
    blocks vLLM held were never saved, a prefix miss for good (audit s33 r10 D1)."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.core.kv_cache_utils import unify_hybrid_kv_cache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvtier.integrations.vllm.connector import _smallest_window

    def config_of(spec):
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0"])])

    def sliding():
        return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32,
                                 sliding_window=4 * BLOCK)

    assert _smallest_window(config_of(sliding())) == 4 * BLOCK
    hybrid = {"l0": FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32),
              "l1": sliding()}
    unify_hybrid_kv_cache_specs(hybrid)
    assert getattr(hybrid["l1"], "sliding_window", None) == 4 * BLOCK  # (the premise: it still names one)
    assert _smallest_window(config_of(hybrid["l1"])) is None
    assert _smallest_window(SimpleNamespace(kv_cache_groups=[])) is None
