"""A worker on another host stops vouching for an adapter id whose copy it saw name another version,
not for every id of that directory for the rest of its life (s33 r10 D3).

Without ``load_inplace`` vLLM keeps the version it read under a ``lora_int_id``: once the worker's
copy named another version than the scheduler's, that id stays disowned, fixed files or not. But
once ops fix the copy and load the adapter again under a new id (same path), vLLM reads the fixed
files for it, and the worker's usual rule (files seen unwritten before the request began) vouches
for that id's requests again. The pairs it disowns are bounded (``MAX_ADAPTERS``): one forgotten
past it makes the worker vouch for no other host's copy, rather than for a forgotten stale id.

Scheduler side and one worker, without an engine; each side sees its own host's files
(``test_s33_lora_other_node_worker``)."""
from __future__ import annotations

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

from kvtier.integrations.vllm import lora_digest  # noqa: E402
from tests.integrations.vllm.test_lora_adapter_versions import _lora, _one_lora_request, _write_adapter  # noqa: E402
from tests.integrations.vllm.test_lora_keys import _new, _request  # noqa: E402
from tests.integrations.vllm import test_s33_lora_other_node_worker as other_node  # noqa: E402
from tests.integrations.vllm.test_s33_lora_other_node_worker import (  # noqa: E402
    _copy_for_the_workers_host, _from_the_schedulers_host, _on_the_workers_host, _settle, _stored)
from tests.integrations.vllm.test_worker_saves import filled_worker  # noqa: E402

engine = other_node.engine
short_margin = other_node.short_margin   # autouse: the worker's start margin, shortened


def _run(sched, worker, req_id: str, first_page: int, lora, path) -> tuple:
    """Look up and run a new 320-token request of ``lora`` in one step on the worker's host (its 10
    pages from ``first_page``, of the worker's 40), the scheduler taking the step's report; returns
    the request, the step's metadata and its drops."""
    request = _request(req_id, 320, lora)
    sched.num_new_matched_tokens(request, 0)
    meta = sched.build(_new(req_id, list(range(first_page, first_page + 10)), 0, 320))
    with _on_the_workers_host(path):
        worker.save(_from_the_schedulers_host(meta))
    drops = worker.report().adapter_dropped
    sched.update(set(), set(), meta.step, adapter_dropped=drops)
    sched.finished(request)
    return request, meta, drops


def _stale_copy_seen(engine, tmp_path, stale_ids=()):
    """The scheduler's host holds v1, the worker's host a stale v0, under which the first request
    (id 1) and one request of each of ``stale_ids`` ran (vLLM there holds v0 under each); then the
    worker's copy is fixed. Returns the adapter's path, the scheduler, the worker and the store."""
    path, sched, first, store = _one_lora_request(engine, tmp_path)
    _copy_for_the_workers_host(path, b"v0")
    _settle()
    worker, _ = filled_worker(engine, store)
    meta = sched.build(_new("r", list(range(10, 20)), 0, 320))
    with _on_the_workers_host(path):
        worker.save(_from_the_schedulers_host(meta))
    drops = worker.report().adapter_dropped
    assert drops == {"r": 0}, "the stale copy was vouched for"
    sched.update(set(), set(), meta.step, adapter_dropped=drops)
    sched.finished(first)
    for lora_id in stale_ids:
        assert _run(sched, worker, f"s{lora_id}", 20, _lora(f"x{lora_id}", lora_id, path), path)[2]
    with _on_the_workers_host(path):
        _write_adapter(path, b"v1")   # the copy fixed: ids vLLM loads from now on read v1
    _settle()
    return path, sched, worker, store


def _stored_per_request(engine, worker, store, runs) -> list[int]:
    assert worker.flush(10)
    return [_stored(engine, store, request, meta.saves[0].adapter) for request, meta, _ in runs]


def test_an_adapter_loaded_again_under_a_new_id_from_the_fixed_copy_is_saved_again(engine, tmp_path):
    path, sched, worker, store = _stale_copy_seen(engine, tmp_path)
    try:
        fresh = _lora("x-reloaded", 7, path)
        runs = [_run(sched, worker, f"n{i}", 20 + 10 * (i % 2), fresh, path) for i in range(4)]
        stored = _stored_per_request(engine, worker, store, runs)
        # the first began before the worker saw the fixed files (it saw them at that request's save)
        assert stored == [0, 5, 5, 5], f"v1 loaded afresh under a new id never saved: {stored}"
    finally:
        store.close(flush_timeout_s=0)


def test_the_id_vllm_loaded_from_the_stale_copy_stays_disowned_beside_a_new_one(engine, tmp_path):
    path, sched, worker, store = _stale_copy_seen(engine, tmp_path)
    try:
        fresh, stale = _lora("x-reloaded", 7, path), _lora("x", 1, path)
        runs = [_run(sched, worker, "n0", 20, fresh, path), _run(sched, worker, "o0", 30, stale, path),
                _run(sched, worker, "n1", 20, fresh, path), _run(sched, worker, "o1", 30, stale, path)]
        stored = _stored_per_request(engine, worker, store, runs)
        assert stored[1] == stored[3] == 0, "the id vLLM holds v0 under was vouched for once the copy was fixed"
        assert runs[3][2] == {"o1": 0}
        assert stored[2] == 5, "the new id, loaded from the fixed copy, was not saved beside the stale one"
    finally:
        store.close(flush_timeout_s=0)


def test_past_max_adapters_disowned_ids_no_other_hosts_copy_is_vouched_for(engine, tmp_path, monkeypatch):
    """Three ids disowned, two remembered: the forgotten one may be any, so none is vouched for."""
    monkeypatch.setattr(lora_digest, "MAX_ADAPTERS", 2)
    path, sched, worker, store = _stale_copy_seen(engine, tmp_path, stale_ids=(2, 3))
    try:
        forgotten, fresh = _lora("x", 1, path), _lora("x-reloaded", 7, path)
        runs = [_run(sched, worker, f"n{i}", 20 + 10 * (i % 2), fresh, path) for i in range(3)]
        runs.append(_run(sched, worker, "o", 30, forgotten, path))
        assert _stored_per_request(engine, worker, store, runs) == [0, 0, 0, 0]
        assert runs[-1][2] == {"o": 0}, "a stale id forgotten past MAX_ADAPTERS was vouched for again"
    finally:
        store.close(flush_timeout_s=0)
