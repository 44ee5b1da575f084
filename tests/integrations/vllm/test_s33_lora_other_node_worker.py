"""A worker on another host than the scheduler (multi-node tensor or pipeline parallelism: vLLM
loads the adapter from the same path on every node) holds its own copy of the adapter's files:
the same bytes, other identities (inode, times). It compared those with the scheduler host's and
dropped every LoRA save, while the scheduler announced them. It keeps its own baseline now: its
files hashed once, taken where they name the job's version and held since before the worker
started, or since before the job's request began.

The scheduler's host is told apart by its file view (``lora_digest.file_view``: boot and mount
namespace), which its metadata carries; here the step's metadata is given another host's view as
it would arrive from there. The worker's own copy is a copy of the directory (other inodes, same
bytes), renamed to the adapter's path while the worker saves and back after, so that each side
sees its own host's files. Scheduler side and one worker, without an engine.
"""
from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager

import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

from kvtier.integrations.vllm import lora_digest  # noqa: E402
from tests.integrations.vllm import test_lora_adapter_versions as versions  # noqa: E402
from tests.integrations.vllm.test_lora_adapter_versions import _lora, _one_lora_request, _write_adapter  # noqa: E402
from tests.integrations.vllm.test_lora_keys import _new, _next_chunk, _request  # noqa: E402
from tests.integrations.vllm.test_worker_saves import filled_worker  # noqa: E402

engine = versions.engine   # the fixture: a 2-layer float32 engine, 32-token pages, 64-token blocks

MARGIN_S = 0.05


@pytest.fixture(autouse=True)
def short_margin(monkeypatch):
    """File times a tick behind the clock: a short margin keeps the test fast."""
    monkeypatch.setattr(lora_digest, "WORKER_START_MARGIN_S", MARGIN_S, raising=False)


def _from_the_schedulers_host(meta):
    """The step's metadata as it arrives from the scheduler's host: files named on its file view."""
    for job in meta.saves:
        if hasattr(job.adapter_files, "view"):
            job.adapter_files = job.adapter_files._replace(view="the scheduler host's boot:mounts")
    return meta


def _copy_for_the_workers_host(path: str, version: bytes | None = None) -> None:
    """The worker host's own files for ``path``: the same bytes (or ``version``'s), other inodes and
    times; at ``path`` only inside :func:`_on_the_workers_host`."""
    shutil.copytree(path, path + ".worker-host")
    if version is not None:
        _write_adapter(path + ".worker-host", version)


@contextmanager
def _on_the_workers_host(path: str):
    """``path`` holds the worker host's copy while inside, the scheduler host's files outside
    (directories renamed: each keeps its files, inodes and times)."""
    os.rename(path, path + ".scheduler-host")
    os.rename(path + ".worker-host", path)
    try:
        yield
    finally:
        os.rename(path, path + ".worker-host")
        os.rename(path + ".scheduler-host", path)


def _settle() -> None:
    time.sleep(3 * MARGIN_S)


def _stored(engine, store, request, adapter: str) -> int:
    return store.lookup(engine.keys(engine.block_hashes(request.block_hashes, 320), "", adapter)).hit_blocks


def test_a_worker_on_another_node_saves_the_blocks_of_its_own_copy_of_the_same_bytes(engine, tmp_path):
    path, sched, request, store = _one_lora_request(engine, tmp_path)
    try:
        _copy_for_the_workers_host(path)
        _settle()
        worker, _ = filled_worker(engine, store)                        # the other node's worker
        meta = sched.build(_new("r", list(range(10, 20)), 0, 320))      # named from the scheduler node's files
        with _on_the_workers_host(path):
            worker.save(_from_the_schedulers_host(meta))
        assert worker.flush(10)
        assert worker.stats.adapter_saves_dropped == 0, "the other node's worker dropped every LoRA save"
        assert _stored(engine, store, request, meta.saves[0].adapter) == 5
        assert worker.report().adapter_dropped == {}
    finally:
        store.close(flush_timeout_s=0)


def test_a_worker_on_another_node_holding_another_version_saves_nothing(engine, tmp_path):
    path, sched, request, store = _one_lora_request(engine, tmp_path)
    try:
        _copy_for_the_workers_host(path, b"v2")
        _settle()
        worker, _ = filled_worker(engine, store)
        meta = sched.build(_new("r", list(range(10, 20)), 0, 320))
        with _on_the_workers_host(path):
            worker.save(_from_the_schedulers_host(meta))
        assert worker.flush(10)
        assert worker.stats.adapter_saves_dropped == 5
        assert worker.report().adapter_dropped == {"r": 0}
    finally:
        store.close(flush_timeout_s=0)


def test_a_worker_on_another_node_saves_nothing_of_a_step_its_first_sight_cannot_vouch_for(engine, tmp_path):
    """The node's copy written while the step ran (another version, then the same bytes back: they
    hash as the version named): nothing the worker saw says which version vLLM read then."""
    path, sched, request, store = _one_lora_request(engine, tmp_path, load_inplace=True)
    try:
        worker, _ = filled_worker(engine, store)                        # up before the files are written
        _settle()
        meta = sched.build(_new("r", list(range(10, 20)), 0, 320))
        _copy_for_the_workers_host(path, b"v2")                         # vLLM on that node reads v2
        with _on_the_workers_host(path):
            _write_adapter(path, b"v1")                                 # v1's bytes back
            worker.save(_from_the_schedulers_host(meta))
        assert worker.flush(10)
        assert worker.stats.adapter_saves_dropped == 5
        assert _stored(engine, store, request, meta.saves[0].adapter) == 0
    finally:
        store.close(flush_timeout_s=0)


def test_a_worker_on_another_node_checks_later_steps_against_its_own_baseline(engine, tmp_path):
    """Once its copy is known, a rollback on that node within a step drops the step, and the steps
    after it (the files unwritten since the worker saw them) are saved again."""
    path, sched, request, store = _one_lora_request(engine, tmp_path, load_inplace=True)
    try:
        across = _request("u", 320, _lora("x", 1, path, load_inplace=True))
        sched.num_new_matched_tokens(across, 0)                         # waits for pages meanwhile
        _copy_for_the_workers_host(path)
        _settle()
        worker, _ = filled_worker(engine, store)
        s0 = sched.build(_new("r", list(range(10, 20)), 0, 64))         # block 0
        with _on_the_workers_host(path):
            worker.save(_from_the_schedulers_host(s0))
        s1 = sched.build(_next_chunk("r", 64, 64))                      # block 1
        with _on_the_workers_host(path):
            _write_adapter(path, b"v2")                                 # on the worker's node only
            _write_adapter(path, b"v1")
            worker.save(_from_the_schedulers_host(s1))
        assert worker.report().adapter_dropped == {"r": 1}
        sched.update(set(), set(), 1)                                   # (the drop's report taken)
        later = _request("t", 320, _lora("x", 1, path, load_inplace=True))
        sched.num_new_matched_tokens(later, 0)                          # begins after the rollback
        s2 = sched.build(_new("t", list(range(30, 40)), 0, 320))
        with _on_the_workers_host(path):
            worker.save(_from_the_schedulers_host(s2))
        assert worker.report().adapter_dropped == {}
        sched.update(set(), set(), 2)
        s3 = sched.build(_new("u", list(range(40, 50)), 0, 320))        # began before the rollback
        with _on_the_workers_host(path):
            worker.save(_from_the_schedulers_host(s3))
        assert worker.flush(10)
        assert worker.report().adapter_dropped == {"u": 0}, "a request that ran across the rollback saved"
        assert worker.stats.saved_blocks == 1 + 5
    finally:
        store.close(flush_timeout_s=0)
