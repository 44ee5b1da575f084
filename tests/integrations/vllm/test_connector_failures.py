"""The connector when a load fails, a request is preempted, a client sends odd transfer params, or
the worker's lookups hang: no KV computed on unfilled pages is saved, recomputed blocks are saved
and announced only once they are, a failure is charged to the request it was of, and vLLM's
scheduler never raises or waits out a timeout per request.

Both sides are driven as vLLM drives them, without an engine (the fakes of the scheduler-side
and worker-load tests); the worker side on real tensors and a real store.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from tests.integrations.vllm.harness import skip_without_vllm

skip_without_vllm()

import torch  # noqa: E402

from kvtier.integrations.vllm.config import ConnectorConfig  # noqa: E402
from kvtier.integrations.vllm.lookup_service import LookupClient  # noqa: E402
from kvtier.integrations.vllm.scheduler_side import SchedulerSide  # noqa: E402
from kvtier.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvtier.tiers.base import Status  # noqa: E402
from tests.integrations.vllm.test_scheduler_side import FakeStore, output, request, side  # noqa: E402
from tests.integrations.vllm.test_scheduler_side import engine as sched_engine  # noqa: E402,F401
from tests.integrations.vllm.test_worker_loads import LAYERS, PAGE_SHAPE, PAGES  # noqa: E402
from tests.integrations.vllm.test_worker_loads import engine, store  # noqa: E402,F401

BLOCK = 64


def _sync_load_step(engine, store, held: int):
    """One step of a 640-token request (10 blocks): the lookup saw 6 blocks, ``held`` of them are
    still in the store when the worker loads; the step loads blocks 0-5 synchronously, computes
    tokens 384..639 and saves blocks 6-9. Returns the worker, the step's metadata, pages, keys."""
    req = request("r", 640)
    keys = engine.keys(engine.block_hashes(req.block_hashes, req.num_tokens))
    rng = np.random.default_rng(0)
    for i in range(held):
        data = rng.standard_normal(engine.layout.block_nbytes // 4).astype(np.float32).view(np.uint8)
        assert store.tiers[0].put(keys[i], data) is Status.OK
    sched = SchedulerSide(ConnectorConfig(block_tokens=BLOCK, async_load=False), engine, lambda ks: 6,
                          loads=True, saves=True)
    assert sched.num_new_matched_tokens(req, 0) == (384, False)
    pages = list(range(10, 30))
    sched.after_alloc(req, pages, 384)
    meta = sched.build(output([SimpleNamespace(req_id="r", block_ids=(pages,), num_computed_tokens=384,
                                               scheduled=256)]))
    assert meta.loads and [t.index for job in meta.saves for t in job.blocks] == [6, 7, 8, 9]
    worker = WorkerSide(engine, store, poison=True)
    worker.register({f"model.layers.{i}.self_attn.attn": torch.zeros(PAGES, *PAGE_SHAPE) for i in range(LAYERS)})
    worker.start_loads(meta)     # start_load_kv, before the forward
    worker.save(meta)            # wait_for_save, after it
    assert worker.flush(10)
    return worker, pages, keys


def test_a_step_whose_synchronous_load_failed_saves_nothing(engine, store):
    """Blocks 3-5 were evicted between the lookup and the load. vLLM runs the step's forward
    anyway (it learns of the failure from this step's report, then recomputes): blocks 6-9 were
    computed attending to pages the load never filled, and were saved under their real keys, to
    be served to every later request whose prefix reached them."""
    worker, pages, keys = _sync_load_step(engine, store, held=3)
    assert worker.take_load_errors() == set(pages[6:12]), "the load of blocks 3-5 failed"
    assert [i for i in range(6, 10) if store.lookup([keys[i]]).hit_blocks] == []
    assert worker.stats.saves_dropped == 4


def test_a_step_whose_synchronous_load_succeeded_saves_its_blocks(engine, store):
    """Control: the same step with every block still held saves blocks 6-9."""
    worker, _, keys = _sync_load_step(engine, store, held=6)
    assert worker.take_load_errors() == set()
    assert [i for i in range(6, 10) if store.lookup([keys[i]]).hit_blocks] == [6, 7, 8, 9]
    assert worker.stats.saves_dropped == 0


def _async_load(sched_engine, fails: bool):
    """A 10-block request whose asynchronous load of 6 blocks is planned; the worker reports it
    ended, with pages 106..111 (blocks 3-5) unfilled if ``fails``."""
    store, req = FakeStore(), request("d", 640)
    store.hold(sched_engine, req, 6)
    sched = side(sched_engine, store)
    assert sched.num_new_matched_tokens(req, 0) == (384, True)
    pages = list(range(100, 120))
    sched.after_alloc(req, pages, 384)
    sched.build(output(total=0))
    sched.update({"d"}, set(pages[6:12]) if fails else set())
    return sched, req, pages


def test_blocks_recomputed_after_a_failed_load_are_saved_and_announced_only_then(sched_engine):
    """The lookup had moved the save cursor (and what a decode instance is told) past blocks 3-5;
    after their load failed vLLM recomputed them, and they were never saved, while the request
    announced 10 blocks stored (a decode instance then waits ``pd_wait_s`` for nothing)."""
    sched, req, pages = _async_load(sched_engine, fails=True)
    assert sched._requests["d"].announced_blocks == 3
    sched.after_alloc(req, pages, 0)    # rescheduled after the failed load: nothing external
    meta = sched.build(output([SimpleNamespace(req_id="d", block_ids=(pages,), num_computed_tokens=192,
                                               scheduled=448)]))
    assert sorted(t.index for job in meta.saves for t in job.blocks) == [3, 4, 5, 6, 7, 8, 9]
    assert sched.finished(req)[1]["kvtier_blocks"] == 10   # now queued for saving


def test_a_load_that_succeeded_saves_only_past_it(sched_engine):
    """Control: a load that ended well moves the save cursor past what it loaded."""
    sched, req, pages = _async_load(sched_engine, fails=False)
    meta = sched.build(output([SimpleNamespace(req_id="d", block_ids=(pages,), num_computed_tokens=384,
                                               scheduled=256)]))
    assert sorted(t.index for job in meta.saves for t in job.blocks) == [6, 7, 8, 9]


def test_a_failed_load_is_charged_to_its_own_request_not_to_one_preempted_from_those_pages(sched_engine):
    """vLLM frees a preempted request's pages without telling the connector, and gives them to
    another request: a failure of that one's load into them marked the preempted request
    failed, and it never had a kvtier hit again."""
    store, a, b = FakeStore(), request("a", 640), request("b", 640)
    store.hold(sched_engine, a, 10)
    store.hold(sched_engine, b, 10)
    sched = side(sched_engine, store)
    pages = list(range(10, 31))
    assert sched.num_new_matched_tokens(a, 0) == (608, True)
    sched.after_alloc(a, pages, 608)
    sched.build(output(total=0))
    sched.update({"a"}, set())          # a's load ended well; a runs, then is preempted
    assert sched.num_new_matched_tokens(b, 0) == (608, True)
    sched.after_alloc(b, pages, 608)     # b gets a's pages
    sched.build(output(total=0))
    sched.update({"b"}, {15})            # b's load into page 15 failed
    assert sched.num_new_matched_tokens(a, 0) == (608, True)
    # control: the request whose load it was is charged (vLLM recomputes it, no kvtier load again)
    assert sched.num_new_matched_tokens(b, 0) == (0, False)


@pytest.mark.parametrize("raw", ["1e400", "-1e400", '"7"', "2.5", "true", "null", "[3]", '{"n": 3}'])
def test_a_clients_odd_kv_transfer_params_never_raise_in_the_scheduler(sched_engine, raw):
    """``kv_transfer_params`` come from the API client: ``int()`` of JSON's 1e400 (infinity)
    raised OverflowError inside vLLM's scheduler, which took the engine down for every request.
    Anything but a whole number announces nothing: the request is looked up as any other."""
    store, req = FakeStore(), request("p", 640, params=json.loads('{"kvtier_blocks": %s}' % raw))
    store.hold(sched_engine, req, 4)
    assert side(sched_engine, store).num_new_matched_tokens(req, 0) == (256, True)


def test_transfer_params_that_are_not_a_mapping_never_raise(sched_engine):
    store, req = FakeStore(), request("p", 640, params=["kvtier_blocks", 3])
    store.hold(sched_engine, req, 4)
    assert side(sched_engine, store).num_new_matched_tokens(req, 0) == (256, True)


def test_an_announced_whole_number_is_waited_for(sched_engine):
    """Control: a decode instance told 6 blocks waits while the store shows only 4."""
    store, req = FakeStore(), request("p", 640, params={"kvtier_blocks": 6})
    store.hold(sched_engine, req, 4)
    assert side(sched_engine, store).num_new_matched_tokens(req, 0) == (None, False)


class _SilentServer:
    """A lookup socket that accepts and reads but answers only once ``answering`` is set (a
    worker whose lookup is stuck on a hung tier, until it is not)."""

    def __init__(self, path: str) -> None:
        self.answering = threading.Event()
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(8)
        self._sock.settimeout(0.05)
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                head = conn.recv(4)
                if len(head) < 4:
                    return
                conn.recv(int.from_bytes(head, "little") * 32, socket.MSG_WAITALL)
                self.answering.wait()
                conn.sendall((1).to_bytes(4, "little"))
        except OSError:
            return

    def close(self) -> None:
        self._stop.set()
        self.answering.set()
        for conn in self._conns:
            conn.close()
        self._sock.close()


def test_a_stuck_lookup_costs_the_scheduler_one_timeout_then_fails_fast_until_it_answers(tmp_path):
    """Each call to a worker whose lookup was stuck cost vLLM's scheduler thread the whole timeout
    (2 s), for every waiting request on every step. After one timeout the client fails at once
    for a while (a miss), then asks again; once the worker answers, lookups hit again."""
    server = _SilentServer(str(tmp_path / "lookup.sock"))
    client = LookupClient(str(tmp_path / "lookup.sock"), timeout_s=0.3, backoff_s=0.5)
    try:
        spent = []
        for _ in range(4):
            start = time.monotonic()
            with pytest.raises(OSError):
                client.lookup([b"k" * 32])
            spent.append(time.monotonic() - start)
        assert spent[0] >= 0.25 and sum(spent[1:]) < 0.1, spent
        server.answering.set()
        deadline = time.monotonic() + 5
        while True:   # the control: past the backoff, a worker that answers is asked again
            try:
                assert client.lookup([b"k" * 32]) == 1
                break
            except OSError:
                assert time.monotonic() < deadline, "the client never asked again"
                time.sleep(0.05)
    finally:
        client.close()
        server.close()
