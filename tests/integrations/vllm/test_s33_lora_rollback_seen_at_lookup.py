"""A ``load_inplace`` request's adapter rewritten while it runs (another version, then the old bytes
back: new stamps, the same digest) is a write, seen at the lookup of any other request of the same
adapter name and path: vLLM's prefix cache may serve that request the pages computed in between,
which hold the other version's KV. Those pages were saved under the old version's keys when the
other request was admitted before the running one was checked again (the very next step, or while
it completed no block).

Scheduler side and one worker, without an engine (vLLM's rule for reading the adapter: at every
step of a ``load_inplace`` request).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

from tests.integrations.vllm import test_lora_adapter_versions as versions  # noqa: E402
from tests.integrations.vllm.test_lora_adapter_versions import _lora, _one_lora_request, _write_adapter  # noqa: E402
from tests.integrations.vllm.test_lora_keys import _new, _next_chunk, _request  # noqa: E402
from tests.integrations.vllm.test_worker_saves import filled_worker  # noqa: E402

engine = versions.engine   # the fixture: a 2-layer float32 engine, 32-token pages, 64-token blocks


def _admit_beside(new_id: str, new_pages: list[int], local: int, running_id: str, running_computed: int,
                  scheduled: int):
    """A step that admits ``new_id`` (``local`` tokens from vLLM's prefix cache) and runs
    ``scheduled`` more tokens of each."""
    new = SimpleNamespace(req_id=new_id, block_ids=(new_pages,), num_computed_tokens=local)
    running = SimpleNamespace(req_ids=[running_id], resumed_req_ids=set(), new_block_ids=[None],
                              num_computed_tokens=[running_computed])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=running,
                           num_scheduled_tokens={new_id: scheduled, running_id: scheduled},
                           total_num_scheduled_tokens=2 * scheduled)


def _stored_under(engine, store, request, adapter: str) -> int:
    keys = engine.keys(engine.block_hashes(request.block_hashes, 320), "", adapter)
    return store.lookup(keys).hit_blocks


@pytest.mark.parametrize("rolled_back", [True, False], ids=["rolled back", "control: untouched"])
def test_a_request_admitted_the_step_after_a_rollback_saves_none_of_the_pages_computed_in_between(
        engine, tmp_path, rolled_back):
    """R1's chunk 1 is computed while v2 stands (v1's bytes back before its save; the worker drops
    it). The next step admits R2 with R1's chunk-1 pages as a local hit before the scheduler has
    taken step 0's report (async scheduling) and runs R1's chunk 2: R2 saved those pages (v2's KV)
    under v1's keys. Control: files left alone, R2 stores all 5 blocks."""
    path, sched, r1, store = _one_lora_request(engine, tmp_path, load_inplace=True)
    try:
        worker, _ = filled_worker(engine, store)
        first = sched.build(_new("r", list(range(10, 20)), 0, 64))      # R1 chunk 1: block 0 (pages 10, 11)
        if rolled_back:
            _write_adapter(path, b"v2")                                 # vLLM computes chunk 1 with v2
            _write_adapter(path, b"v1")                                 # v1's bytes back
        worker.save(first)
        r2 = _request("s", 320, _lora("x", 1, path, load_inplace=True))
        r2.block_hashes = r1.block_hashes                               # the same prompt
        sched.num_new_matched_tokens(r2, 64)                            # R1's chunk-1 pages, local
        second = sched.build(_admit_beside("s", [10, 11] + list(range(30, 38)), 64, "r", 64, 256))
        worker.save(second)
        assert worker.flush(10)
        v1 = first.saves[0].adapter
        if rolled_back:
            assert [job for job in second.saves if job.req_id == "s"] == [], "R1's v2 pages planned under v1's keys"
            assert _stored_under(engine, store, r2, v1) == 0, "R1's v2 pages stored under v1's keys"
        else:
            assert _stored_under(engine, store, r2, v1) == 5
    finally:
        store.close(flush_timeout_s=0)


@pytest.mark.parametrize("rolled_back", [True, False], ids=["rolled back", "control: untouched"])
def test_a_request_served_a_page_computed_while_the_running_one_completed_no_block_saves_none(
        engine, tmp_path, rolled_back):
    """R1 computes page 2 (tokens 64..95, no block completes: nothing to save, nothing checked)
    while v2 stands, then decodes inside block 1 for a while. R2, admitted later with pages 0..2
    from vLLM's prefix cache, saved block 1 (R1's v2 page 2 and its own page 3) under v1's keys:
    R1 is checked again only when it completes a block, or finishes."""
    path, sched, r1, store = _one_lora_request(engine, tmp_path, load_inplace=True)
    try:
        worker, _ = filled_worker(engine, store)
        s0 = sched.build(_new("r", list(range(10, 20)), 0, 64))         # R1: block 0 with v1, saved
        worker.save(s0)
        sched.update(set(), set(), step=0)
        s1 = sched.build(_next_chunk("r", 64, 32))                      # R1: page 2, no block
        if rolled_back:
            _write_adapter(path, b"v2")
            _write_adapter(path, b"v1")
        worker.save(s1)
        sched.update(set(), set(), step=1)
        assert not s1.saves
        r2 = _request("s", 320, _lora("x", 1, path, load_inplace=True))
        r2.block_hashes = r1.block_hashes
        sched.num_new_matched_tokens(r2, 96)                            # pages 0..2 from vLLM's cache
        s2 = sched.build(_new("s", [10, 11, 12] + list(range(30, 37)), 96, 224))
        worker.save(s2)
        assert worker.flush(10)
        planned = [t.index for job in s2.saves for t in job.blocks]
        assert planned == ([] if rolled_back else [0, 1, 2, 3, 4]), "R1's v2 page saved under v1's keys"
    finally:
        store.close(flush_timeout_s=0)
