"""A synchronous load that fails on one worker of a tensor- or pipeline-parallel engine stops the
saves of that step on every worker whose forward it spoiled.

Two processes, each a worker with its own store and ``WorkerSide``, joined by vLLM's own parallel
state on gloo (``init_distributed_environment`` + ``initialize_model_parallel``, as vLLM's workers
do; no engine). In each step both run a synchronous load of block 0 of a request and the save of
its block 1, which the step's forward completes. One worker's store lacks block 0 (its own host
tier lost it), so its pages stay unfilled and the forward over them is wrong where it reaches:

* tensor parallel: every rank of the stage (attention outputs are all-reduced);
* pipeline parallel: the stages after the failing one (they compute on its hidden states), not
  those before it;

and a step with no failure (the scheduler having taken the failed step's report) saves on both.
The workers agree in ``start_load_kv``, which vLLM calls on every worker in every step: vLLM's V1
model runner with speculative decoding calls ``wait_for_save`` on the last pipeline stage only,
and that stage must neither wait for the others nor miss their failures. A step with no
synchronous load involves no other worker.
"""

from __future__ import annotations

import multiprocessing
import queue
import socket
from typing import NamedTuple

import numpy as np
import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

pytestmark = pytest.mark.timeout(300)

PAGE, BLOCK, LAYERS, PAGES = 32, 64, 2, 16
PAGE_SHAPE = (1, PAGE, 64)
FIRST_PORT, LAST_PORT = 23900, 23999
#: two processes importing vLLM on a busy machine, then a few steps
START_TIMEOUT_S = 240
#: a few steps: a worker that ends this long after the other hangs
SCENARIO_TIMEOUT_S = 30
BOTH = (0, 1)
#: what a worker imports: a fork server imports it once, and every worker forks from it (each
#: spawned worker imported torch and vLLM anew, ~9 CPU-s: most of a test's ~10 s on 2 cores)
WORKER_IMPORTS = ["torch", "vllm.config", "vllm.distributed.parallel_state",
                  "kvtier.integrations.vllm.worker_side", "kvtier.store.config"]


class Step(NamedTuple):
    """One engine step: a load of ``request``'s block 0 (pages 2, 3) and the save of its block 1
    (pages 4, 5), computed by the step's forward."""
    step: int
    reported_step: int
    request: str
    #: the worker whose store lacks the request's block 0 (-1: none)
    lacking_rank: int = -1
    #: the workers that run the step at all (vLLM's ``start_load_kv``)
    runners: tuple[int, ...] = BOTH
    #: the workers that save it (vLLM's ``wait_for_save``)
    savers: tuple[int, ...] = BOTH
    #: whether the load is synchronous (in the step of its request's forward)
    sync: bool = True


def _free_port() -> int:
    for port in range(FIRST_PORT, LAST_PORT + 1):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip(f"no free port in {FIRST_PORT}-{LAST_PORT}")


def _hashes(request: str) -> list[bytes]:
    return [f"{request}{i}".encode().ljust(32, b"h") for i in range(2)]


def _step(step: int, reported_step: int, request: str, *, sync: bool = True):
    """The metadata of a :class:`Step`."""
    from kvtier.integrations.vllm.metadata import BlockTransfer, KvtierMetadata, LoadJob, SaveJob

    hashes = _hashes(request)
    return KvtierMetadata(loads=[LoadJob(request, hashes[:1], [BlockTransfer(0, 0, [2, 3])], is_async=not sync)],
                          saves=[SaveJob(request, hashes, [BlockTransfer(1, 0, [4, 5])])],
                          step=step, reported_step=reported_step)


def _join_engine(rank: int, port: int, tp: int, pp: int) -> None:
    """Join the two workers' world and split it ``tp`` x ``pp``, as a vLLM worker starts."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo",
                                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
        parallel_state.initialize_model_parallel(tp, pp, backend="gloo")


def _worker(rank: int, port: int, tp: int, pp: int, steps: list[Step], results, released) -> None:
    """Run ``steps`` as worker ``rank`` of an engine split ``tp`` x ``pp``; put the blocks saved
    in each step on ``results``; end once ``released``. (A stage does not wait for its last send
    downstream: vLLM's workers live on. A forked worker ends at once, unlike a spawned one's
    interpreter shutdown, and its connection was reset before the next stage had read that send.)"""
    try:
        import torch

        from kvtier.core.layout import KVLayout
        from kvtier.core.namespace import Namespace
        from kvtier.integrations.vllm.config import EngineKV
        from kvtier.integrations.vllm.worker_side import WorkerSide
        from kvtier.store.config import StoreConfig, build_store

        _join_engine(rank, port, tp, pp)
        layout = KVLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=32, dtype="float32", block_tokens=BLOCK)
        engine = EngineKV(Namespace("m", layout), page_tokens=PAGE, hash_tokens=PAGE, num_layers=LAYERS,
                          format_tag="t")
        store = build_store(StoreConfig(host_bytes="4MiB"), layout)
        side = WorkerSide(engine, store)
        side.register({f"model.layers.{i}.self_attn.attn": torch.zeros(PAGES, *PAGE_SHAPE) for i in range(LAYERS)})
        saved = []
        for step in steps:
            before = side.stats.saved_blocks
            if rank in step.runners:
                if rank != step.lacking_rank:
                    block = np.ones(layout.block_nbytes, dtype=np.uint8)
                    store.put(engine.keys(_hashes(step.request))[:1], [block])
                meta = _step(step.step, step.reported_step, step.request, sync=step.sync)
                side.start_loads(meta)      # vLLM: start_load_kv, the forward, then wait_for_save
                if rank in step.savers:
                    side.save(meta)
                assert side.flush(10)
                side.finished_loads()
                side.take_load_errors()     # the step's report
            saved.append(side.stats.saved_blocks - before)
        side.shutdown(5)
        store.close()
        results.put((rank, saved))
        released.wait(START_TIMEOUT_S)
    except BaseException as exc:        # the parent reports it, rather than waiting out a timeout
        results.put((rank, repr(exc)))
        raise


@pytest.fixture(scope="module", autouse=True)
def fork_server():
    """The module's workers come from a fork server that has done their imports (it starts with
    the first worker); stopped at the module's end, not to hold torch and vLLM for the session."""
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(WORKER_IMPORTS)
    yield
    forkserver._forkserver._stop()   # (private: the standard library's own tests call it)


def _run_engine(tp: int, pp: int, steps: list[Step]) -> dict[int, list[int]]:
    """The blocks each worker of a two-worker engine saved in each of ``steps``. A worker that
    does not finish within SCENARIO_TIMEOUT_S of the other hangs: the test fails."""
    context = multiprocessing.get_context("forkserver")
    results, released = context.Queue(), context.Event()
    port = _free_port()
    workers = [context.Process(target=_worker, args=(rank, port, tp, pp, steps, results, released))
               for rank in BOTH]
    for proc in workers:
        proc.start()
    saved: dict = {}
    try:
        rank, result = results.get(timeout=START_TIMEOUT_S)
        saved[rank] = result
        rank, result = results.get(timeout=SCENARIO_TIMEOUT_S)
        saved[rank] = result
    except queue.Empty:
        pytest.fail(f"worker {1 - rank} did not end {SCENARIO_TIMEOUT_S} s after worker {rank} (hung): {saved}")
    finally:
        released.set()
        for proc in workers:
            proc.join(10)
            if proc.is_alive():     # a worker stuck in a collective: end it, the test fails
                proc.kill()
    for rank, result in saved.items():
        assert isinstance(result, list), f"worker {rank} failed: {result}"
    return saved


def test_tensor_parallel_ranks_drop_the_step_of_a_load_that_failed_on_either():
    saved = _run_engine(tp=2, pp=1, steps=[
        Step(5, 4, "A", lacking_rank=1),    # rank 1 lacks A's block 0: both ranks' forward read its unfilled pages
        Step(6, 5, "B"),                    # the scheduler has taken step 5's report; no load fails
    ])
    assert saved == {0: [0, 1], 1: [0, 1]}


def test_pipeline_stages_after_a_failed_load_drop_its_step_and_those_before_it_save():
    saved = _run_engine(tp=1, pp=2, steps=[
        Step(5, 4, "A", lacking_rank=0),    # stage 0 lacks A's block 0: stage 1 computed on its hidden states
        Step(6, 5, "B"),                    # no load fails: both save
        Step(7, 6, "C", lacking_rank=1),    # stage 1 lacks C's block 0: stage 0's layers never read its pages
    ])
    assert saved == {0: [0, 1, 1], 1: [0, 1, 0]}


def test_the_last_stage_saves_alone_without_waiting_and_drops_what_an_earlier_stage_spoiled():
    """vLLM's V1 model runner with speculative decoding: a stage before the last returns from the
    step without ``wait_for_save`` (its connector's finalize waits for the draft model, which runs
    on the last stage only). The last stage must neither hang nor save over stage 0's failure."""
    last_only = (1,)
    saved = _run_engine(tp=1, pp=2, steps=[
        Step(5, 4, "A", lacking_rank=0, savers=last_only),     # stage 0's load fails: stage 1 drops its save
        Step(6, 5, "B", savers=last_only),                     # no load fails: stage 1 saves
        Step(7, 6, "C", lacking_rank=1, savers=last_only),     # its own load fails: it drops its save
    ])
    assert saved == {0: [0, 0, 0], 1: [0, 1, 0]}


def test_a_step_without_a_synchronous_load_involves_no_other_worker():
    """The agreement's round trip is for steps with a synchronous load: stage 1 runs steps whose
    load is asynchronous while stage 0 runs none (it would wait for ever for stage 0's send)."""
    saved = _run_engine(tp=1, pp=2, steps=[
        Step(5, 4, "A", runners=(1,), sync=False),
        Step(6, 5, "B", runners=(1,), sync=False),
        Step(7, 6, "C"),                    # then a step with one, run by both: nothing left over
    ])
    assert saved == {0: [0, 0, 1], 1: [1, 1, 1]}
