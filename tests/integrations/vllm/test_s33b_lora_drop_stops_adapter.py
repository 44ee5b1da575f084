"""A drop report stops every live request of the adapter's name and path (s33 r7 D1).

With async scheduling R2 is looked up before the report of R1's dropped step (the adapter's link
flipped away and back, which only the worker saw) and is served R1's pages of that step from vLLM's
prefix cache; it completes no block before the report, so nothing names it there. Its later saves
would store the other version's page under this version's keys: the report stops them too."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

from kvtier.integrations.vllm.lora_digest import AdapterKeys  # noqa: E402
from kvtier.store.config import StoreConfig, build_store  # noqa: E402
from tests.integrations.vllm import test_lora_adapter_versions as versions  # noqa: E402
from tests.integrations.vllm.test_lora_adapter_versions import SETTINGS, _lora, _scheduler, _write_adapter  # noqa: E402
from tests.integrations.vllm.test_lora_keys import _new, _next_chunk, _request  # noqa: E402
from tests.integrations.vllm.test_s33_lora_drops_reported import _point  # noqa: E402
from tests.integrations.vllm.test_worker_saves import filled_worker  # noqa: E402

engine = versions.engine   # 32-token pages, 64-token blocks


def _new_and_running(new_id, new_pages, new_computed, new_sched, run_id, run_computed, run_sched):
    """A step scheduling a new request ``new_id`` and the running ``run_id``."""
    new = SimpleNamespace(req_id=new_id, block_ids=(new_pages,), num_computed_tokens=new_computed)
    running = SimpleNamespace(req_ids=[run_id], resumed_req_ids=set(), new_block_ids=[None],
                              num_computed_tokens=[run_computed])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=running,
                           num_scheduled_tokens={new_id: new_sched, run_id: run_sched},
                           total_num_scheduled_tokens=new_sched + run_sched)


@pytest.mark.parametrize("flipped", [True, False], ids=["flipped", "untouched"])
def test_request_served_dropped_pages_before_the_report_saves_nothing(engine, tmp_path, flipped):
    _write_adapter(tmp_path / "v1", b"v1")
    _write_adapter(tmp_path / "v2", b"v2")
    link = tmp_path / "current"
    os.symlink(tmp_path / "v1", link)
    store = build_store(StoreConfig(host_bytes="8MiB"), engine.layout)
    sched = _scheduler(engine, AdapterKeys(SETTINGS), lookup=store.lookup)
    r1 = _request("r", 320, _lora("x", 1, link, load_inplace=True))
    sched.num_new_matched_tokens(r1, 0)
    worker, _ = filled_worker(engine, store)

    def take_report(step):
        sched.update(set(), set(), step, adapter_dropped=worker.report().adapter_dropped)

    try:
        s0 = sched.build(_new("r", list(range(10, 20)), 0, 64))      # block 0, files untouched
        worker.save(s0)
        assert worker.flush(10)
        take_report(0)
        s1 = sched.build(_next_chunk("r", 64, 96))                   # block 1 and page 14
        if flipped:
            _point(link, tmp_path / "v2")                             # vLLM computes step 1 with v2
        worker.save(s1)
        if flipped:
            _point(link, tmp_path / "v1")
        # async scheduling: step 2 is built before step 1's report; R2 shares R1's pages 10..12
        r2 = _request("s", 320, _lora("x", 1, link, load_inplace=True))
        r2.block_hashes = r1.block_hashes[:3] + r2.block_hashes[3:]
        sched.num_new_matched_tokens(r2, 96)
        s2 = sched.build(_new_and_running("s", [10, 11, 12, 30, 31, 32, 33, 34, 35, 36], 96, 16, "r", 160, 16))
        assert not [job for job in s2.saves if job.req_id == "s"]   # no block of R2 completes in step 2
        worker.save(s2)
        take_report(1)
        take_report(2)
        s3 = sched.build(_new_and_running("q", [40], 0, 0, "s", 112, 208))   # R2 runs the rest
        r2_jobs = [job for job in s3.saves if job.req_id == "s"]
        worker.save(s3)
        assert worker.flush(10)
        keys = engine.keys(engine.block_hashes(r2.block_hashes, 320), "", s0.saves[0].adapter)
        stored = store.lookup(keys[1:2]).hit_blocks   # page 12 is R1's step-1 page
        if flipped:
            assert not r2_jobs and stored == 0
        else:
            assert stored == 1
    finally:
        store.close(flush_timeout_s=0)
