"""The connector with more than one batch in flight, and its cache reset.

vLLM builds step N+1's metadata before it takes step N's report when batches overlap (async
scheduling, its default on GPU; pipeline parallelism: ``EngineCore.step_with_batch_queue``).
A failed synchronous load then taints the saves of the steps already built, and a report must
be matched to the loads and saves of its own step. ``reset_cache`` (vLLM's
``reset_prefix_cache(reset_connector=True)``) must make every block stored before miss.

Both sides are driven in the order vLLM 0.32 calls them, without an engine (the fakes of the
scheduler-side and worker-load tests); the worker side on real tensors and a real store.
"""

from __future__ import annotations

import shutil
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

import torch  # noqa: E402

from kvtier.integrations.vllm.config import ConnectorConfig  # noqa: E402
from kvtier.integrations.vllm.scheduler_side import SchedulerSide  # noqa: E402
from kvtier.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvtier.tiers.base import Status  # noqa: E402
from tests.integrations.vllm import test_scheduler_side, test_worker_loads  # noqa: E402
from tests.integrations.vllm.test_scheduler_side import FakeStore, output, request, side  # noqa: E402
from tests.integrations.vllm.test_worker_loads import LAYERS, PAGE_SHAPE  # noqa: E402

# the fixtures of those modules, under the names the tests below take
sched_engine = test_scheduler_side.engine
engine, store = test_worker_loads.engine, test_worker_loads.store

BLOCK = 64
PAGES = 64


def step_output(new=(), running=(), total=1):
    """A SchedulerOutput: ``new`` as in test_scheduler_side.output; ``running``: (req_id,
    num_computed_tokens, scheduled) of requests already running (no new pages)."""
    out = output(new, total)
    out.scheduled_cached_reqs = SimpleNamespace(
        req_ids=[r for r, _, _ in running], resumed_req_ids=set(), new_block_ids=[None] * len(running),
        num_computed_tokens=[c for _, c, _ in running])
    out.num_scheduled_tokens.update({r: s for r, _, s in running})
    return out


def new_req(req_id, pages, computed, scheduled):
    return SimpleNamespace(req_id=req_id, block_ids=(pages,), num_computed_tokens=computed, scheduled=scheduled)


def real_worker(engine, store) -> WorkerSide:
    worker = WorkerSide(engine, store, poison=True)
    worker.register({f"model.layers.{i}.self_attn.attn": torch.zeros(PAGES, *PAGE_SHAPE) for i in range(LAYERS)})
    return worker


def put_blocks(engine, store, keys, indexes, seed=0):
    rng = np.random.default_rng(seed)
    for i in indexes:
        data = rng.standard_normal(engine.layout.block_nbytes // 4).astype(np.float32).view(np.uint8)
        assert store.tiers[0].put(keys[i], data) is Status.OK


def stored(store, keys, indexes):
    return [i for i in indexes if store.lookup([keys[i]]).hit_blocks]


# -- D1: the taint of a failed load lasts until the scheduler has taken its report ------------
def _two_overlapping_steps(engine, store, held: int):
    """A 1024-token request: the lookup saw 6 blocks, ``held`` are still there at the load.
    Step N loads blocks 0-5 synchronously and computes 384..639 (saves 6-9); step N+1, built
    before step N's report (overlapping batches), computes 640..895 (saves 10-13)."""
    req = request("r", 1024)
    keys = engine.keys(engine.block_hashes(req.block_hashes, req.num_tokens))
    put_blocks(engine, store, keys, range(held))
    sched = SchedulerSide(ConnectorConfig(block_tokens=BLOCK, async_load=False), engine, lambda ks: 6,
                          loads=True, saves=True)
    assert sched.num_new_matched_tokens(req, 0) == (384, False)
    pages = list(range(10, 42))
    sched.after_alloc(req, pages, 384)
    meta_n = sched.build(output([new_req("r", pages, 384, 256)]))
    meta_n1 = sched.build(step_output(running=[("r", 640, 256)]))
    assert [t.index for job in meta_n1.saves for t in job.blocks] == [10, 11, 12, 13]
    worker = real_worker(engine, store)
    worker.start_loads(meta_n)
    worker.save(meta_n)
    errors = worker.take_load_errors()
    worker.start_loads(meta_n1)       # ... its forward attends to pages 16..21 ...
    worker.save(meta_n1)
    assert worker.flush(10)
    return sched, worker, errors, pages, keys


def test_the_chunk_after_a_failed_sync_load_is_not_saved_under_overlapping_batches(engine, store):
    """Step N+1 ran over the pages step N's failed load left unfilled; its blocks were saved
    (the worker forgot the failure at the next step) and served under their real keys."""
    sched, worker, errors, pages, keys = _two_overlapping_steps(engine, store, held=3)
    assert errors == set(pages[6:12])
    assert stored(store, keys, range(6, 16)) == []
    assert worker.stats.saves_dropped == 8
    # once the scheduler has taken the reports, the taint is over: the next step saves, from
    # the failed load's first block on (vLLM recomputes them)
    sched.update(set(), errors)
    sched.update(set(), set())
    later = sched.build(step_output(running=[("r", 192, 768)]))
    assert later.reported_step == 1
    assert sorted(t.index for job in later.saves for t in job.blocks) == list(range(3, 15))
    worker.start_loads(later)
    worker.save(later)
    assert worker.flush(10)
    assert stored(store, keys, range(3, 15)) == list(range(3, 15))


def test_the_chunk_after_a_successful_sync_load_is_saved_under_overlapping_batches(engine, store):
    """Control: the load went well; both steps' blocks are saved."""
    _, worker, errors, _, keys = _two_overlapping_steps(engine, store, held=6)
    assert errors == set()
    assert stored(store, keys, range(6, 14)) == list(range(6, 14))
    assert worker.stats.saves_dropped == 0


# -- D2: a report clears the synchronous loads of its own step only ---------------------------
def _two_sync_loads(sched_engine):
    """Steps N (a's sync load) and N+1 (b's), both built before step N's report."""
    fake = FakeStore()
    a, b = request("a", 640), request("b", 640)
    fake.hold(sched_engine, a, 6)
    fake.hold(sched_engine, b, 6)
    sched = side(sched_engine, fake, async_load=False)
    assert sched.num_new_matched_tokens(a, 0) == (384, False)
    sched.after_alloc(a, list(range(100, 120)), 384)
    sched.build(output([new_req("a", list(range(100, 120)), 384, 256)]))
    b_pages = list(range(200, 220))
    assert sched.num_new_matched_tokens(b, 0) == (384, False)
    sched.after_alloc(b, b_pages, 384)
    sched.build(output([new_req("b", b_pages, 384, 256)]))
    return sched, b, b_pages


def test_a_sync_load_planned_before_the_previous_steps_report_is_charged_when_it_fails(sched_engine):
    """Step N's report cleared b's pending load too: b's failure in step N+1 matched no request,
    its recomputed blocks were never saved, and it announced 10 blocks stored."""
    sched, b, b_pages = _two_sync_loads(sched_engine)
    sched.update(set(), set())                  # step N: a's load went well
    sched.update(set(), set(b_pages[6:12]))     # step N+1: b's load of blocks 3-5 failed
    state = sched._requests["b"]
    assert state.load_failed and state.stored_blocks == 3
    _, params = sched.finished(b)
    assert params["kvtier_blocks"] == 3 and params["kvtier_loaded_tokens"] == 0, params


def test_a_report_naming_its_step_clears_the_steps_before_it(sched_engine):
    """vLLM skips an empty report; the workers name the step of theirs (KvtierWorkerMetadata):
    step N's skipped, step N+1's charges b's load, and no step is left pending."""
    from kvtier.integrations.vllm.metadata import KvtierWorkerMetadata

    sched, b, b_pages = _two_sync_loads(sched_engine)
    sched.update(set(), set(b_pages[6:12]), step=1)
    assert sched._requests["b"].load_failed and not sched._requests["a"].load_failed
    assert not sched._steps and sched._reported_step == 1
    assert KvtierWorkerMetadata(3).aggregate(KvtierWorkerMetadata(3)).step == 3


def test_a_sync_load_that_went_well_is_not_charged_for_another_steps_failure(sched_engine):
    """Control: b's load went well; a's failure in step N is charged to a alone."""
    sched, b, _ = _two_sync_loads(sched_engine)
    sched.update(set(), set(range(106, 112)))
    sched.update(set(), set())
    assert sched._requests["a"].load_failed and not sched._requests["b"].load_failed
    assert sched.finished(b)[1]["kvtier_loaded_tokens"] == 384


# -- D3: the saves a failed load dropped are planned again, for every request of the step ----
def _shared_step(engine, store, held: int):
    """Request o (5 blocks, nothing stored) and request r (a sync load of 6 blocks, ``held``
    still there) share a step; o saves blocks 0-4."""
    r, other = request("r", 640), request("o", 320)
    keys = engine.keys(engine.block_hashes(r.block_hashes, r.num_tokens))
    other_keys = engine.keys(engine.block_hashes(other.block_hashes, other.num_tokens))
    put_blocks(engine, store, keys, range(held))

    def lookup(ks):   # the lookup saw 6 of r's blocks, none of o's
        return 6 if ks[0] == keys[0] else 0

    sched = SchedulerSide(ConnectorConfig(block_tokens=BLOCK, async_load=False), engine, lookup,
                          loads=True, saves=True)
    assert sched.num_new_matched_tokens(other, 0) == (0, False)
    assert sched.num_new_matched_tokens(r, 0) == (384, False)
    r_pages, o_pages = list(range(10, 30)), list(range(40, 50))
    sched.after_alloc(other, o_pages, 0)
    sched.after_alloc(r, r_pages, 384)
    meta = sched.build(output([new_req("o", o_pages, 0, 320), new_req("r", r_pages, 384, 256)]))
    assert sorted(t.index for job in meta.saves if job.req_id == "o" for t in job.blocks) == [0, 1, 2, 3, 4]
    worker = real_worker(engine, store)
    worker.start_loads(meta)
    worker.save(meta)
    assert worker.flush(10)
    sched.update(set(), worker.take_load_errors())
    later = sched.build(step_output(running=[("o", 320, 1), ("r", 192, 448)]))
    return sched, worker, other, later, other_keys


def test_saves_dropped_with_a_failed_sync_load_are_planned_again(engine, store):
    """r's load failed: the worker dropped o's saves too, but o's save cursor had passed them,
    so they were never saved, and o announced them to a decode instance."""
    sched, worker, other, later, other_keys = _shared_step(engine, store, held=3)
    assert sorted(t.index for job in later.saves if job.req_id == "o" for t in job.blocks) == [0, 1, 2, 3, 4]
    worker.start_loads(later)
    worker.save(later)
    assert worker.flush(10)
    assert stored(store, other_keys, range(5)) == [0, 1, 2, 3, 4]
    assert sched.finished(other)[1]["kvtier_blocks"] == 5


def test_saves_of_a_step_whose_load_went_well_are_not_planned_again(engine, store):
    """Control: nothing failed; o's blocks were saved once and are not planned again."""
    sched, _, other, later, other_keys = _shared_step(engine, store, held=6)
    assert [job for job in later.saves if job.req_id == "o"] == []
    assert stored(store, other_keys, range(5)) == [0, 1, 2, 3, 4]
    assert sched.finished(other)[1]["kvtier_blocks"] == 5


# -- D4: reset_cache ---------------------------------------------------------------------------
@pytest.fixture
def short_dir():
    path = tempfile.mkdtemp(prefix="k", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def connectors(monkeypatch, short_dir):
    """A worker and a scheduler KvtierConnector in one process, sharing their store."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import vllm.distributed.parallel_state as parallel_state
    from kvtier.integrations.vllm import connector as connector_mod
    from tests.integrations.vllm.test_integration_hostile import _kv_cache_config, _layers, _vllm_config

    monkeypatch.setenv("XDG_RUNTIME_DIR", short_dir)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=0))
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)

    def config():
        c = _vllm_config(model_dtype=torch.float32)
        c.kv_transfer_config = SimpleNamespace(
            engine_id="engine-reset", kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"block_tokens": 64, "host_bytes": "4MiB", "encrypt": False})
        return c

    worker = connector_mod.KvtierConnector(config(), KVConnectorRole.WORKER, _kv_cache_config(spec, _layers((0, 1))))
    scheduler = connector_mod.KvtierConnector(config(), KVConnectorRole.SCHEDULER,
                                              _kv_cache_config(spec, _layers((0, 1))))
    worker.register_kv_caches({name: torch.randn(16, 2, 32, 64) for name in _layers((0, 1))})
    yield scheduler, worker
    scheduler.shutdown()
    worker.shutdown()


def _run_step(scheduler, worker, new=()):
    """One engine step: the scheduler builds, the worker loads and saves, the report goes back."""
    from vllm.v1.outputs import KVConnectorOutput

    meta = scheduler.build_connector_meta(output(new))
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    assert worker.worker.flush(10)
    finished = worker.get_finished(set())[1]
    report = KVConnectorOutput(finished_recving=finished, invalid_block_ids=worker.get_block_ids_with_load_errors(),
                               kv_connector_worker_meta=worker.build_connector_worker_meta())
    worker.clear_connector_metadata()
    scheduler.update_connector_output(report)
    return meta


def _request(req_id):
    return SimpleNamespace(request_id=req_id, num_tokens=200, kv_transfer_params=None,
                           block_hashes=[bytes([i]) * 32 for i in range(6)])


def test_a_connector_cache_reset_that_reports_success_drops_every_hit(connectors):
    """reset_cache() returned None (vLLM reads anything but False as done) and the old KV kept
    hitting: after an in-place weight update, every prompt seen before loaded the old KV."""
    scheduler, worker = connectors
    req = _request("q")
    assert scheduler.get_num_new_matched_tokens(req, 0)[0] == 0
    _run_step(scheduler, worker, [new_req("q", list(range(1, 8)), 0, 200)])    # computes and saves 3 blocks
    scheduler.request_finished(req, [])
    again = _request("q2")
    assert scheduler.get_num_new_matched_tokens(again, 0)[0] == 192, "control: the saved blocks hit"
    scheduler.request_finished(again, [])
    assert scheduler.reset_cache() is True
    after = _request("q3")
    assert scheduler.get_num_new_matched_tokens(after, 0)[0] == 0
    # the request computes again; its blocks are saved under the new epoch, and hit
    meta = _run_step(scheduler, worker, [new_req("q3", list(range(1, 8)), 0, 200)])
    assert meta.epoch == scheduler.scheduler.epoch != "" and meta.saves
    scheduler.request_finished(after, [])
    assert scheduler.get_num_new_matched_tokens(_request("q4"), 0)[0] == 192


def test_a_request_known_at_the_reset_saves_nothing_more(connectors):
    """Its pages may hold KV computed before the reset (the old weights): nothing of it is saved
    under the new epoch, unless it comes back with nothing computed."""
    scheduler, worker = connectors
    req = _request("old")
    assert scheduler.get_num_new_matched_tokens(req, 0)[0] == 0
    scheduler.reset_cache()
    meta = _run_step(scheduler, worker, [new_req("old", list(range(1, 8)), 0, 200)])
    assert meta.saves == []
    assert scheduler.get_num_new_matched_tokens(req, 0)[0] == 0      # back with nothing computed
    meta = _run_step(scheduler, worker, [new_req("old", list(range(1, 8)), 0, 200)])
    assert [t.index for job in meta.saves for t in job.blocks] == [0, 1, 2]


def test_every_reset_draws_an_epoch_no_restart_or_other_engine_reuses(sched_engine):
    """A counter would restart at 1 in a restarted engine or another engine sharing the store,
    and key the blocks of other weights alike."""
    epochs = set()
    for _ in range(3):
        sched = side(sched_engine, FakeStore())
        assert sched.epoch == "" and sched.reset()
        epochs.add(sched.epoch)
        sched.reset()
        epochs.add(sched.epoch)
    assert len(epochs) == 6
    assert sched_engine.keys([b"x" * 32], "") != sched_engine.keys([b"x" * 32], sched.epoch)
