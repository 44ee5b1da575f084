"""A LoRA save dropped under speculative decoding keeps its adapter's later saves dropped until the
scheduler has the drop (s33 r7 D3).

With a speculative config vLLM defers ``wait_for_save`` past ``build_connector_worker_meta``
(``defer_kv_connector_finalize``): a step's report is built before its save, so a drop at step N's
save goes out with step N+1's report. Step N+1 is built once step N's report is taken, and its saves
run over the dropped block (the link flipped away and back, which only the worker saw)."""
from __future__ import annotations

import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

from tests.integrations.vllm.test_lora_keys import _new, _next_chunk  # noqa: E402
from tests.integrations.vllm import test_s33_lora_drops_reported as drops  # noqa: E402
from tests.integrations.vllm.test_s33_lora_drops_reported import _point  # noqa: E402

engine = drops.engine
linked = drops.linked   # the fixture: an adapter behind a link, its request, a store and a worker


def _spec_decode_step(sched, worker, meta, flip=None):
    """One engine step in vLLM's order with speculative decoding: ``start_load_kv``, the forward,
    ``build_connector_worker_meta``, then the deferred ``wait_for_save``; the scheduler then takes
    the report. ``flip``: (before the forward, after the save)."""
    worker.start_loads(meta)
    if flip:
        flip[0]()
    report = worker.report()
    worker.save(meta)
    if flip:
        flip[1]()
    sched.update(set(), set(), report.step, adapter_dropped=report.adapter_dropped)


@pytest.mark.parametrize("flipped", [True, False], ids=["flipped", "untouched"])
def test_saves_over_a_block_dropped_a_report_late_are_dropped(engine, linked, flipped):
    tmp_path, link, sched, request, store, worker = linked
    flip = (lambda: _point(link, tmp_path / "v2"), lambda: _point(link, tmp_path / "v1")) if flipped else None
    first = sched.build(_new("r", list(range(10, 20)), 0, 64))          # block 0
    _spec_decode_step(sched, worker, first, flip)
    second = sched.build(_next_chunk("r", 64, 256))                     # blocks 1..4, over block 0
    _spec_decode_step(sched, worker, second)
    _spec_decode_step(sched, worker, sched.build(_next_chunk("r", 320, 0)))   # an idle step: its report
    assert worker.flush(10)
    keys = engine.keys(engine.block_hashes(request.block_hashes, 320), "", first.saves[0].adapter)
    stored = store.lookup(keys[1:]).hit_blocks
    _, params = sched.finished(request)
    if flipped:
        assert stored == 0 and params["kvtier_blocks"] == 0
    else:
        assert stored == 4 and params["kvtier_blocks"] == 5
