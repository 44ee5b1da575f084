"""The router's admin API over real sockets (kvtier/router/admin.py): a worker added at run time gets
requests; a drained one gets none while its in-flight stream finishes whole; it can be removed
only once idle; tokens are checked. Engine stand-ins as in test_http.py (real vLLM:
tests/integrations/vllm/test_planner_live.py)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import ClientSession

from kvtier.router.admin import TOKEN_ENV, _loopback
from kvtier.router.view import LiveView
from tests.router.test_http import Deaf, StandIn, run, standin_router, start_router


async def _admin(s: ClientSession, method: str, url: str, body: dict | None = None, token: str | None = None):
    """``method`` DRAIN means POST /admin/workers/drain."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    path, verb = ("/admin/workers/drain", "POST") if method == "DRAIN" else ("/admin/workers", method)
    async with s.request(verb, url + path, json=body, headers=headers) as r:
        return r.status, await r.json()


async def _until(condition, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Wait for ``condition()`` (a fixed sleep was a race on a loaded machine: the stream's request
    had not reached its worker within 0.1 s)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def _complete(s: ClientSession, url: str, prompt: str, stream: bool = False) -> tuple[int, str]:
    async with s.post(url + "/v1/completions", json={"prompt": prompt, "stream": stream}) as r:
        body = await r.read()
        return r.status, r.headers.get("X-Kvtier-Worker", "") + ("" if not stream or b"[DONE]" in body else "!torn")


def test_a_worker_added_under_a_freed_id_inherits_nothing_of_the_removed_one():
    """Worker ids are reused: one added after a removal takes the freed id. What the router kept
    per id must go with the removed worker: its admission queue (else the newcomer starts with
    the old one's tokens in flight) and the blocks the approximate tree says were sent to it
    (else, with events down, the newcomer is priced as holding the old one's cache). Control:
    both were there before the removal, and the other worker's blocks stay."""
    async def main():
        async with standin_router(["a", "b"], policy="round-robin") as ((a, b), router, url, s):
            sent_to = lambda wid: sum(1 for owner in router.approx._owner.values() if owner == wid)
            # (the stand-ins' token ids are word lengths: the prompts differ from their first block)
            got = [await _complete(s, url, ("x" * (i + 1) + " aaaa bbb cc d ") * 4, stream=True) for i in range(2)]
            assert sorted(got) == sorted([(200, a.url), (200, b.url)]), got
            a_id, b_id = (next(w.id for w in router.workers if w.url == x.url) for x in (a, b))
            assert b_id in router.admission and sent_to(b_id) > 0 and sent_to(a_id) > 0   # control
            assert (await _admin(s, "DRAIN", url, {"url": b.url}))[0] == 200
            assert (await _admin(s, "DELETE", url, {"url": b.url}))[0] == 200
            assert b_id not in router.admission and sent_to(b_id) == 0
            assert sent_to(a_id) > 0
            status, again = await _admin(s, "POST", url, {"url": b.url})
            assert status == 201 and again["id"] == b_id and sent_to(b_id) == 0
    run(main())


def test_a_request_retried_after_a_rolling_replacement_goes_to_the_worker_that_took_a_tried_ones_id():
    """A planner replaces workers while a whole answer decodes on A (id 0, 4 s): C is added, A is
    drained and force-removed, D is added (and takes id 0), C is drained and removed. Silent for
    ``request_timeout_s`` after its removal, A's answer is given up on, and the request goes to D,
    the one worker left: 200. Before, the request remembered the workers it tried by their ids, D's
    among them, and answered 503 with D healthy in the pool (audit s32 a1 D1)."""
    async def main():
        a, c, d = Deaf("A", steps=40, gap_s=0.1), StandIn("C"), StandIn("D")
        for w in (a, c, d):
            await w.start()
        router, runner, url = await start_router([a], request_timeout_s=1.0, abort_again_s=())
        try:
            async with ClientSession() as s:
                ask = asyncio.ensure_future(_complete(s, url, "a b"))
                await _until(lambda: a.requests == 1, what="A has the request")
                a_id = router.workers[0].id
                assert (await _admin(s, "POST", url, {"url": c.url}))[0] == 201
                assert (await _admin(s, "DRAIN", url, {"url": a.url}))[0] == 200
                assert (await _admin(s, "DELETE", url, {"url": a.url, "force": True}))[0] == 200
                status, added = await _admin(s, "POST", url, {"url": d.url})
                assert status == 201 and added["id"] == a_id   # (the freed id, as admin.py gives it)
                assert (await _admin(s, "DRAIN", url, {"url": c.url}))[0] == 200
                assert (await _admin(s, "DELETE", url, {"url": c.url}))[0] == 200
                assert await asyncio.wait_for(ask, 15) == (200, d.url)
            assert (c.requests, d.requests) == (0, 1)
        finally:
            await runner.cleanup()
            for w in (a, c, d):
                await w.stop()
    run(main())


class Continues(StandIn):
    """A Responses API worker noting every ``/v1/responses`` it is sent; with ``cut`` set, it holds
    the next one until ``cut`` is set, then closes its connection unanswered (a crash)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.responses_sent = 0
        self.cut: asyncio.Event | None = None

    async def respond(self, request):
        self.responses_sent += 1
        if self.cut is not None:
            await self.cut.wait()
            request.transport.close()
            await asyncio.sleep(1)
        return await super().respond(request)


def test_a_continued_response_goes_to_no_worker_added_while_it_was_under_way():
    """A continuation of a response stored on A is pinned to A. A worker B is added while A has it,
    then A drops it: no other worker holds the response, so the router answers 503, and B is never
    sent it, as when B was there from the start. Before, the workers pinned out were those listed
    when the request came (by id), so B, added since, was tried (audit s32 a1 D1)."""
    async def main():
        a, b = Continues("A"), Continues("B")
        for w in (a, b):
            await w.start()
        router, runner, url = await start_router([a])
        try:
            async with ClientSession() as s:
                async with s.post(url + "/v1/responses", json={"model": "tiny", "input": "hi"}) as r:
                    assert r.status == 200
                    stored = (await r.json())["id"]
                a.cut = asyncio.Event()
                ask = asyncio.ensure_future(s.post(url + "/v1/responses", json={
                    "model": "tiny", "input": "go on", "previous_response_id": stored}))
                await _until(lambda: a.responses_sent == 2, what="A has the continuation")
                assert (await _admin(s, "POST", url, {"url": b.url}))[0] == 201
                a.cut.set()
                r = await asyncio.wait_for(ask, 15)
                status = r.status
                r.release()
            assert status == 503 and b.responses_sent == 0, (status, b.responses_sent)
        finally:
            await runner.cleanup()
            for w in (a, b):
                await w.stop()
    run(main())


def test_a_removed_worker_leaves_no_metric_series_even_with_a_health_check_under_way():
    """A health check of a worker that was removed while the check waited for its answer put
    the worker's ``kvtier_router_worker_healthy`` series back (a CI run saw it after the
    DELETE). Its present-state series all go with it: health, events, indexed blocks,
    measured speeds. Control: before the removal, /metrics lists them."""
    async def main():
        async with standin_router(["a", "b"], policy="round-robin") as ((a, b), router, url, s):
            series = [f'kvtier_router_worker_{name}{{worker="{b.url}"}}'
                      for name in ("healthy", "indexed_blocks", "prefill_tokens_per_s", "decode_step_seconds")]
            text = await (await s.get(url + "/metrics")).text()
            assert all(line in text for line in series), text          # control
            b.health_delay_s = 1.0
            checks = b.health_checks
            await _until(lambda: b.health_checks > checks, what="a health check of b under way")
            assert (await _admin(s, "DRAIN", url, {"url": b.url}))[0] == 200
            assert (await _admin(s, "DELETE", url, {"url": b.url}))[0] == 200
            await asyncio.sleep(1.5)        # the check's answer arrives after the removal
            text = await (await s.get(url + "/metrics")).text()
            assert not [line for line in series if line in text], text
            assert f'kvtier_router_worker_healthy{{worker="{a.url}"}} 1.0' in text
    run(main())


def test_added_worker_gets_requests_and_a_drained_one_finishes_its_stream_and_gets_none():
    async def main():
        a, b = StandIn("a"), StandIn("b")
        await a.start()
        await b.start()
        router, runner, url = await start_router([a], policy="round-robin")
        try:
            async with ClientSession() as s:
                status, added = await _admin(s, "POST", url, {"url": b.url})
                assert status == 201 and added["state"] == "serving" and added["id"] == 1, added
                assert (await _admin(s, "POST", url, {"url": b.url + "/"}))[0] == 200    # idempotent
                got = [await _complete(s, url, f"p {i}") for i in range(6)]
                assert {w for _, w in got} == {a.url, b.url}, got          # round-robin reaches the new one
                # a stream in flight on b (3 tokens 0.2 s apart) while b is drained
                before_b = b.requests
                streams = [asyncio.ensure_future(_complete(s, url, f"s {i}", stream=True)) for i in range(2)]
                await _until(lambda: b.requests == before_b + 1, what="one of the two streams on b")
                status, drained = await _admin(s, "DRAIN", url, {"url": b.url})
                assert status == 200 and drained["state"] == "draining" and drained["inflight"] == 1, drained
                status, refused = await _admin(s, "DELETE", url, {"url": b.url})
                assert status == 409 and "in flight" in refused["error"]["message"], refused
                got = [await _complete(s, url, f"q {i}") for i in range(6)]
                assert {w for _, w in got} == {a.url}, got                 # nothing new goes to b
                assert b.requests == before_b + 1
                assert sorted(await asyncio.gather(*streams)) == sorted([(200, a.url), (200, b.url)])
                listed = (await _admin(s, "GET", url))[1]["workers"]
                assert [(w["url"], w["state"], w["inflight"]) for w in listed] == \
                    [(a.url, "serving", 0), (b.url, "draining", 0)], listed
                status, removed = await _admin(s, "DELETE", url, {"url": b.url})
                assert status == 200 and removed["state"] == "removed", removed
                assert [w.url for w in router.workers] == [a.url]
                text = await (await s.get(url + "/metrics")).text()
                assert f'kvtier_router_worker_healthy{{worker="{b.url}"}}' not in text
                # back again: it takes the freed id, and gets requests
                status, again = await _admin(s, "POST", url, {"url": b.url})
                assert status == 201 and again["id"] == 1
                got = [await _complete(s, url, f"r {i}") for i in range(4)]
                assert {w for _, w in got} == {a.url, b.url}
        finally:
            await runner.cleanup()
            await a.stop()
            await b.stop()
    run(main())


def test_the_last_routable_worker_cannot_be_drained_and_unknown_ones_are_404():
    async def main():
        a = StandIn("a")
        await a.start()
        router, runner, url = await start_router([a])
        try:
            async with ClientSession() as s:
                status, body = await _admin(s, "DRAIN", url, {"url": a.url})
                assert status == 409 and "last healthy routable" in body["error"]["message"], body
                # a peer that is ejected does not count: draining a would leave nothing to serve
                assert (await _admin(s, "POST", url, {"url": "http://127.0.0.1:1"}))[0] == 201
                await _until(lambda: not router.workers[1].healthy, what="health checks ejecting the dead peer")
                assert (await _admin(s, "DRAIN", url, {"url": a.url}))[0] == 409
                assert (await _admin(s, "DRAIN", url, {"url": "http://127.0.0.1:1"}))[0] == 200
                assert (await _admin(s, "DELETE", url, {"url": "http://127.0.0.1:1"}))[0] == 200
                assert (await _admin(s, "DRAIN", url, {"url": "http://127.0.0.1:2"}))[0] == 404
                assert (await _admin(s, "DELETE", url, {"url": a.url}))[0] == 409      # serving: drain first
                assert (await _admin(s, "POST", url, {"url": "ftp://x"}))[0] == 400
                assert (await _admin(s, "POST", url, {"nope": 1}))[0] == 400
                assert (await _complete(s, url, "still served"))[0] == 200
        finally:
            await runner.cleanup()
            await a.stop()
    run(main())


def test_a_set_token_is_required_and_without_one_only_loopback_may_call(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "s3cret")

    async def main():
        a, b = StandIn("a"), StandIn("b")
        await a.start()
        await b.start()
        router, runner, url = await start_router([a])
        try:
            async with ClientSession() as s:
                assert (await _admin(s, "GET", url))[0] == 401
                assert (await _admin(s, "POST", url, {"url": b.url}, token="wrong"))[0] == 401
                assert len(router.workers) == 1
                assert (await _admin(s, "POST", url, {"url": b.url}, token="s3cret"))[0] == 201
                assert len(router.workers) == 2
        finally:
            await runner.cleanup()
            await a.stop()
            await b.stop()
    run(main())
    assert _loopback("127.0.0.1") and _loopback("::1")
    assert not _loopback("10.0.0.5") and not _loopback(None) and not _loopback("garbage")


def test_an_added_worker_backlog_is_priced_at_the_fleets_measured_speed():
    async def main():
        a, b, c = StandIn("a"), StandIn("b"), StandIn("c")
        for w in (a, b, c):
            await w.start()
        router, runner, url = await start_router([a], policy="round-robin")
        try:
            async with ClientSession() as s:
                assert (await _admin(s, "POST", url, {"url": b.url}))[0] == 201
                assert router.speed.tokens_per_s is None        # nothing measured yet: default
                for i in range(4):   # streamed: a stream's first byte is what measures the prefill
                    assert (await _complete(s, url, " ".join(["word"] * 40) + f" {i}", stream=True))[0] == 200
                measured = router.speed.tokens_per_s
                assert measured and measured != router.config.prefill_tokens_per_s
                assert (await _admin(s, "POST", url, {"url": c.url}))[0] == 201
                new = router.workers[2]
                assert new.prefill_tokens_per_s is None                # not measured itself
                new.start(1000, 4)
                view = LiveView(router.service, router.workers, router.index, [], measured, 0.0)
                assert view.backlog_s(2) == pytest.approx(1000 / measured)   # priced at the fleet's speed
        finally:
            await runner.cleanup()
            for w in (a, b, c):
                await w.stop()
    run(main())


class _Call:
    """A loopback admin call, without a server (for what races the event loop)."""
    remote = "127.0.0.1"
    headers: dict = {"Content-Type": "application/json"}   # as the planner's launcher sends it

    def __init__(self, body: dict) -> None:
        self._body = body

    async def json(self) -> dict:
        return self._body


def _bare_router(events: list[bool]):
    import os

    from kvtier.router.app import Router
    from kvtier.router.config import RouterConfig, WorkerSpec
    from tests.router.test_http import WordTokenizer
    specs = [WorkerSpec(f"http://127.0.0.1:{9 + i}", f"ipc:///tmp/kvtier-test-admin-{os.getpid()}-{i}" if e else None)
             for i, e in enumerate(events)]
    router = Router(RouterConfig(workers=specs, block_tokens=4, kv_bytes_per_token=4096), WordTokenizer())
    router._refresh_models_soon = lambda: None       # no HTTP session here
    return router


def test_an_add_while_a_removal_stops_its_listener_keeps_the_new_workers_state():
    """The removal took the worker out of the list, awaited its listener's stop, then cleaned up
    per id: an add in that window took the freed id, and the cleanup wiped the newcomer's
    admission queue, index entries, approximate-tree blocks and (same URL) metric series."""
    from kvtier.router.admin import WorkerAdmin

    async def main():
        router = _bare_router([False, True])
        _, old = router.workers
        router.listen(old)
        router.index.stored(old.id, [7], None, [2] * 4, 4)
        await asyncio.sleep(0.2)                          # the listener waits in its poll
        old.draining = True
        admin = WorkerAdmin(router)
        remove = asyncio.create_task(admin.remove_worker(_Call({"url": old.url})))
        add = asyncio.create_task(admin.add_worker(_Call({"url": old.url})))
        await add
        new = next(w for w in router.workers if w.url == old.url)
        assert new is not old and new.id == old.id        # the freed id, taken mid-removal
        assert router.index.worker_blocks(new.id) == 0    # control: nothing of the old one's
        queue = router._admission(new)                    # a stream routed to it meanwhile
        router.index.stored(new.id, [11], None, [1] * 4, 4)   # its first events
        router.approx.record([123], new.id)
        await remove
        assert router.admission.get(new.id) is queue
        assert router.index.worker_blocks(new.id) == 1 and len(router.approx) == 1
        assert f'kvtier_router_worker_healthy{{worker="{new.url}"}}' in router.metrics.render().decode()
        for listener in router.listeners:
            await listener.stop()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_worker_added_at_run_time_counts_its_resyncs_and_ignored_events():
    """Its listener was built without the metrics' callbacks: its resyncs and ignored blocks (a
    block-size mismatch: the one loud sign it is never predicted a hit) never reached /metrics."""
    import os
    import struct

    import msgpack

    from kvtier.router.admin import WorkerAdmin

    async def main():
        router = _bare_router([False, False])
        url = "http://127.0.0.1:20"
        call = _Call({"url": url, "events": f"ipc:///tmp/kvtier-test-admin-{os.getpid()}-x"})
        assert (await WorkerAdmin(router).add_worker(call)).status == 201
        listener = router.listeners[-1]
        wrong = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                 "token_ids": list(range(2 * 16)), "block_size": 16, "medium": "GPU"}
        listener.handle([b"", struct.pack(">Q", 0), msgpack.packb([1.0, [wrong], None])])
        listener.handle([b"", struct.pack(">Q", 5), msgpack.packb([1.0, [], None])])       # a gap
        await listener.stop()
        text = router.metrics.render().decode()
        assert f'kvtier_router_event_blocks_ignored_total{{reason="block_size",worker="{url}"}} 2.0' in text
        assert f'kvtier_router_event_resyncs_total{{reason="gap",worker="{url}"}} 1.0' in text

    asyncio.run(main())


def test_a_draining_worker_whose_events_dropped_leaves_the_pool_in_event_mode():
    """A planner drains a worker and stops its engine: its events drop at once, its health checks
    eject it only later, and meanwhile every request of the pool was routed approximately."""
    from kvtier.router.admin import WorkerAdmin

    async def main():
        router = _bare_router([False, False])
        a, b = router.workers
        a.events_up = b.events_up = True
        router._update_mode()
        assert not router.approximate_mode
        b.events_up = False
        router._update_mode()
        assert router.approximate_mode            # control: a serving worker's events count
        assert (await WorkerAdmin(router).drain_worker(_Call({"url": b.url}))).status == 200
        assert not router.approximate_mode
        assert "kvtier_router_approximate_mode 0.0" in router.metrics.render().decode()

    asyncio.run(main())
