"""Admission at the router (kvtier.router.admission): a worker is sent about one prefill step of
tokens; the rest wait in the router and go soonest-finishing first. Unit tests of the queue, and
the real router over real sockets with a stand-in worker that answers when the test says so."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import ClientSession, web

from kvtier.errors import ConfigError
from kvtier.router.admission import AdmissionQueue, AsyncAdmission
from kvtier.router.config import RouterConfig, WorkerSpec

from tests.router.test_http import free_port, run, start_router


def test_held_requests_go_soonest_finishing_first_once_the_queue_shortens():
    q = AdmissionQueue(cap_tokens=100)
    assert q.offer(60, key=0.0, item="first")          # an idle worker: sent at once
    assert not q.offer(50, key=1.0, item="large")      # 60 + 50 > 100: held
    # fits beside the first (60 + 10 <= 100) but must not overtake what is held
    assert not q.offer(10, key=0.5, item="small")
    assert len(q) == 2 and q.sent_tokens == 60
    assert q.done(60) == ["small", "large"]            # key order, both fit now
    assert q.sent_tokens == 60 and len(q) == 0


def test_positive_control_cap_zero_sends_everything_at_once_in_arrival_order():
    q = AdmissionQueue(cap_tokens=0)
    assert all(q.offer(n, key=-n, item=n) for n in (5000, 3000, 10))
    assert len(q) == 0 and q.done(5000) == []


def test_a_request_larger_than_the_cap_goes_alone_and_is_not_starved():
    q = AdmissionQueue(cap_tokens=100)
    assert q.offer(500, key=0.0, item="huge")          # alone on an idle worker
    assert not q.offer(400, key=1.0, item="big")       # waits for the worker to be empty
    assert not q.offer(10, key=5.0, item="late small")  # arrived long after: its virtual finish is later
    assert q.done(500) == ["big"]                      # 400 > cap, but the worker is empty: alone
    assert q.done(400) == ["late small"]


def test_withdraw_drops_a_held_request():
    q = AdmissionQueue(cap_tokens=10)
    assert q.offer(10, 0.0, "a")
    assert not q.offer(5, 1.0, "b") and not q.offer(5, 2.0, "c")
    assert q.withdraw("b") and not q.withdraw("b")
    assert q.done(10) == ["c"]


def test_cancelled_waiters_neither_leak_nor_block():
    async def main():
        adm = AsyncAdmission(cap_tokens=10)
        await adm.admit(10, 0.0)
        waiting = asyncio.ensure_future(adm.admit(8, 1.0))
        await asyncio.sleep(0)
        assert adm.held == 1
        waiting.cancel()                 # the client went away while held
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert adm.held == 0
        # released and cancelled in the same moment: its tokens are given back
        racing = asyncio.ensure_future(adm.admit(8, 2.0))
        await asyncio.sleep(0)
        adm.done(10)                     # releases it (sent 8) ...
        racing.cancel()                  # ... before it could run
        with pytest.raises(asyncio.CancelledError):
            await racing
        assert adm.queue.sent_tokens == 0
        await asyncio.wait_for(adm.admit(10, 3.0), 1)   # nothing blocks the next one
    run(main())


def test_config_rejects_a_negative_admission_cap_and_defaults_to_off():
    assert RouterConfig(workers=[WorkerSpec("http://w")]).check().admission_cap == 0
    assert RouterConfig(workers=[WorkerSpec("http://w")], admission_tokens=2048).check().admission_cap == 2048
    with pytest.raises(ConfigError, match="admission_tokens"):
        RouterConfig(workers=[WorkerSpec("http://w")], admission_tokens=-1).check()


class GatedWorker:
    """A stand-in worker that records the order requests reach it and sends each first byte
    only when the test opens that request's gate (the prompt's first word names it)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.order: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def health(self, request):
        return web.Response()

    async def complete(self, request):
        body = await request.json()
        name = body["prompt"].split()[0]
        self.order.append(name)
        await self.gates.setdefault(name, asyncio.Event()).wait()
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(f"data: {json.dumps({'choices': [{'text': 'x'}]})}\n\ndata: [DONE]\n\n".encode())
        return resp


async def _burst(admission_tokens: int, stream: bool = True) -> list[str]:
    """A long request occupies the worker; a medium one, then a short one, arrive while it
    prefills; the order in which the worker receives them."""
    w = GatedWorker()
    await w.start()
    # 10 tokens/s: 6 tokens are 0.6 s of prefill, 2 tokens 0.2 s (the short one arrives 0.05 s later)
    router, runner, url = await start_router([w], policy="round-robin", admission_tokens=admission_tokens,
                                             prefill_tokens_per_s=10.0)
    try:
        async with ClientSession() as s:
            async def send(name, words):
                body = {"prompt": " ".join([name] + ["w"] * (words - 1)), "stream": stream}
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
            tasks = [asyncio.ensure_future(send("long", 8))]
            await asyncio.sleep(0.1)
            tasks.append(asyncio.ensure_future(send("medium", 6)))
            await asyncio.sleep(0.05)
            tasks.append(asyncio.ensure_future(send("short", 2)))
            await asyncio.sleep(0.2)
            w.gates.setdefault("long", asyncio.Event()).set()
            await asyncio.sleep(0.2)
            for name in ("short", "medium"):
                w.gates.setdefault(name, asyncio.Event()).set()
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
        if admission_tokens:
            assert router._admission(router.workers[0]).queue.sent_tokens == 0   # nothing leaked
        return w.order
    finally:
        await runner.cleanup()
        await w.runner.cleanup()


def test_router_holds_a_busy_workers_requests_and_sends_the_shortest_first():
    assert run(_burst(admission_tokens=10)) == ["long", "short", "medium"]


def test_positive_control_without_admission_the_worker_gets_them_in_arrival_order():
    assert run(_burst(admission_tokens=0)) == ["long", "medium", "short"]


def test_non_streamed_requests_are_not_held():
    # a non-streamed answer comes whole after its decode: holding on it would throttle the worker
    assert run(_burst(admission_tokens=10, stream=False)) == ["long", "medium", "short"]
