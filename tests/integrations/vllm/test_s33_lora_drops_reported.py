"""A worker reports the LoRA saves it dropped (``KvtierWorkerMetadata.adapter_dropped``), and the
scheduler acts on the report: the scheduler inferred the drops from the adapter's files at its next
check, and some changes leave the files' stamps as they were (the adapter's path a link, flipped
to another version's directory and back: a common atomic-deploy layout). It then saved the next
chunk, computed over the dropped block's KV, under the old version's keys, and announced blocks
the store never held.

Scheduler side and one worker, without an engine; the worker's report goes to the scheduler as
the connector hands it (``WorkerSide.report`` → ``SchedulerSide.update``).
"""
from __future__ import annotations

import os

import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

from kvtier.integrations.vllm.lora_digest import AdapterKeys  # noqa: E402
from kvtier.integrations.vllm.metadata import KvtierWorkerMetadata  # noqa: E402
from kvtier.store.config import StoreConfig, build_store  # noqa: E402
from tests.integrations.vllm import test_lora_adapter_versions as versions  # noqa: E402
from tests.integrations.vllm.test_lora_adapter_versions import SETTINGS, _lora, _scheduler, _write_adapter  # noqa: E402
from tests.integrations.vllm.test_lora_keys import _new, _next_chunk, _request  # noqa: E402
from tests.integrations.vllm.test_s33_lora_rollback_seen_at_lookup import _admit_beside  # noqa: E402
from tests.integrations.vllm.test_worker_saves import filled_worker  # noqa: E402

engine = versions.engine   # the fixture: a 2-layer float32 engine, 32-token pages, 64-token blocks


def _point(link, target) -> None:
    """Flip the link ``link`` to ``target`` atomically (a new link renamed over it)."""
    os.symlink(target, f"{link}.new")
    os.replace(f"{link}.new", link)


@pytest.fixture
def linked(engine, tmp_path):
    """Adapter versions v1 and v2 in their own directories, ``current`` → v1; a scheduler, request
    ``r`` (320 tokens, ``load_inplace``) of ``current`` looked up, a host store and a worker."""
    _write_adapter(tmp_path / "v1", b"v1")
    _write_adapter(tmp_path / "v2", b"v2")
    link = tmp_path / "current"
    os.symlink(tmp_path / "v1", link)
    sched = _scheduler(engine, AdapterKeys(SETTINGS))
    request = _request("r", 320, _lora("x", 1, link, load_inplace=True))
    sched.num_new_matched_tokens(request, 0)
    store = build_store(StoreConfig(host_bytes="8MiB"), engine.layout)
    worker, _ = filled_worker(engine, store)
    yield tmp_path, link, sched, request, store, worker
    store.close(flush_timeout_s=0)


def _report(sched, worker, step: int) -> None:
    sched.update(set(), set(), step, adapter_dropped=worker.report().adapter_dropped)


def _stored_prefix(engine, store, request, adapter: str) -> int:
    return store.lookup(engine.keys(engine.block_hashes(request.block_hashes, 320), "", adapter)).hit_blocks


@pytest.mark.parametrize("flipped", [True, False], ids=["flipped away and back", "control: untouched"])
def test_a_drop_the_files_do_not_show_stops_the_requests_saves_and_its_announcement(engine, linked, flipped):
    tmp_path, link, sched, request, store, worker = linked
    first = sched.build(_new("r", list(range(10, 20)), 0, 64))          # chunk 1: block 0, named v1
    if flipped:
        _point(link, tmp_path / "v2")                                   # vLLM runs chunk 1 with v2
    worker.save(first)                                                  # the worker drops block 0
    if flipped:
        _point(link, tmp_path / "v1")                                   # v1's very files again
    _report(sched, worker, 0)
    second = sched.build(_next_chunk("r", 64, 256))                     # chunk 2: blocks 1..4
    worker.save(second)
    _report(sched, worker, 1)
    assert worker.flush(10)
    _, params = sched.finished(request)
    v1 = first.saves[0].adapter
    if flipped:
        assert second.saves == [], "blocks computed over v2's KV planned under v1's keys"
        assert params["kvtier_blocks"] == _stored_prefix(engine, store, request, v1) == 0, \
            "blocks announced that the store does not hold"
    else:
        assert params["kvtier_blocks"] == _stored_prefix(engine, store, request, v1) == 5


def test_a_reported_drop_marks_the_pages_computed_for_the_requests_served_them_later(engine, linked):
    """The dropped step's pages sit in vLLM's prefix cache under the adapter's name and path: a
    request served them once the report is taken is not saved."""
    tmp_path, link, sched, request, store, worker = linked
    first = sched.build(_new("r", list(range(10, 20)), 0, 64))
    _point(link, tmp_path / "v2")
    worker.save(first)
    _point(link, tmp_path / "v1")
    _report(sched, worker, 0)
    other = _request("s", 320, _lora("x", 1, link, load_inplace=True))
    sched.num_new_matched_tokens(other, 64)                             # block 0 from vLLM's prefix cache
    assert sched.build(_new("s", [10, 11] + list(range(30, 38)), 64, 256)).saves == [], \
        "R1's v2 pages saved under v1's keys"


def test_a_finished_requests_reported_drop_marks_its_pages(engine, linked):
    """vLLM frees a request that finishes in a step before it hands over the step's report: the
    drop still marks the pages it computed."""
    tmp_path, link, sched, request, store, worker = linked
    meta = sched.build(_new("r", list(range(10, 20)), 0, 320))          # the whole prompt in one step
    _point(link, tmp_path / "v2")
    worker.save(meta)
    _point(link, tmp_path / "v1")
    sched.finished(request)                                             # before the step's report
    _report(sched, worker, 0)
    other = _request("s", 320, _lora("x", 1, link, load_inplace=True))
    sched.num_new_matched_tokens(other, 64)
    assert sched.build(_new("s", [10, 11] + list(range(30, 38)), 64, 256)).saves == [], \
        "the finished request's v2 pages saved under v1's keys"


def test_steps_built_before_the_drops_report_save_nothing_of_the_adapter(engine, linked):
    """Async scheduling: step 1 is built before step 0's report. Its saves of the adapter (R1's next
    chunk, over the dropped block; R2, served R1's pages) are dropped by the worker too."""
    tmp_path, link, sched, request, store, worker = linked
    first = sched.build(_new("r", list(range(10, 20)), 0, 64))
    other = _request("s", 320, _lora("x", 1, link, load_inplace=True))
    other.block_hashes = request.block_hashes
    sched.num_new_matched_tokens(other, 64)                             # R1's chunk-1 pages, local
    second = sched.build(_admit_beside("s", [10, 11] + list(range(30, 38)), 64, "r", 64, 256))
    assert {job.req_id for job in second.saves} == {"r", "s"}
    _point(link, tmp_path / "v2")
    worker.save(first)                                                  # step 0: dropped
    _point(link, tmp_path / "v1")
    worker.save(second)                                                 # built before step 0's report
    assert worker.flush(10)
    assert _stored_prefix(engine, store, other, first.saves[0].adapter) == 0
    assert store.lookup(engine.keys(engine.block_hashes(request.block_hashes, 320), "",
                                    first.saves[0].adapter)[1:]).hit_blocks == 0, "blocks over v2's KV stored"
    assert worker.report().adapter_dropped == {"r": 0, "s": 0}


def test_the_ranks_reports_merge_each_requests_first_dropped_block():
    rank0 = KvtierWorkerMetadata(4, {}, {"a": 2, "b": 1})
    rank1 = KvtierWorkerMetadata(4, {}, {"a": 0, "c": 3})
    assert rank0.aggregate(rank1).adapter_dropped == {"a": 0, "b": 1, "c": 3}
    assert KvtierWorkerMetadata(4).adapter_dropped == {}
