"""A worker on another host never vouches again for a directory whose files it saw name another
version than a job's (s33 r7 D2).

Without ``load_inplace`` vLLM loads an adapter id once and keeps it in its LoRA cache. The worker
node's copy was stale (v0) when vLLM loaded it; ops then copy v1 over it. vLLM there still computes
with v0, so the requests that begin after the worker hashed the fixed copy must not be saved under
v1's keys."""
from __future__ import annotations

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

from tests.integrations.vllm.test_lora_adapter_versions import _lora, _one_lora_request, _write_adapter  # noqa: E402
from tests.integrations.vllm.test_lora_keys import _new, _request  # noqa: E402
from tests.integrations.vllm import test_s33_lora_other_node_worker as other_node  # noqa: E402
from tests.integrations.vllm.test_s33_lora_other_node_worker import (  # noqa: E402
    _copy_for_the_workers_host, _from_the_schedulers_host, _on_the_workers_host, _settle, _stored)
from tests.integrations.vllm.test_worker_saves import filled_worker  # noqa: E402

engine = other_node.engine
short_margin = other_node.short_margin   # autouse: the worker's start margin, shortened


def _run_new_request(sched, worker, req_id, pages, path):
    """Look up and run a new 320-token request of the adapter at ``path`` in one step, on the
    worker's host; returns the request and the step's metadata."""
    request = _request(req_id, 320, _lora("x", 1, path))
    sched.num_new_matched_tokens(request, 0)
    meta = sched.build(_new(req_id, pages, 0, 320))
    with _on_the_workers_host(path):
        worker.save(_from_the_schedulers_host(meta))
    sched.update(set(), set(), meta.step, adapter_dropped=worker.report().adapter_dropped)
    return request, meta


def test_copy_fixed_after_vllm_cached_the_stale_one_is_never_vouched_for(engine, tmp_path):
    path, sched, r0, store = _one_lora_request(engine, tmp_path)      # scheduler's host: v1, no load_inplace
    try:
        _copy_for_the_workers_host(path, b"v0")                        # worker's host: a stale copy
        _settle()
        worker, _ = filled_worker(engine, store)
        s0 = sched.build(_new("r", list(range(10, 20)), 0, 320))       # vLLM there loads v0 and keeps it
        with _on_the_workers_host(path):
            worker.save(_from_the_schedulers_host(s0))
        assert worker.report().adapter_dropped == {"r": 0}
        sched.update(set(), set(), 0)
        sched.finished(r0)
        with _on_the_workers_host(path):
            _write_adapter(path, b"v1")                                # the copy fixed; vLLM keeps v0
        _run_new_request(sched, worker, "a", list(range(20, 30)), path)
        r2, s2 = _run_new_request(sched, worker, "b", list(range(30, 40)), path)
        assert worker.flush(10)
        assert _stored(engine, store, r2, s2.saves[0].adapter) == 0
    finally:
        store.close(flush_timeout_s=0)
