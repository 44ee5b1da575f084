"""A client that leaves and sends its request again under the same ``X-Request-Id`` (an
idempotency key): vLLM aborts every request of an id when its API server gets to the abort, which
beside a decoding engine is seconds after it arrived. The retry waits for the abort's answer
before it goes to that worker, so that abort no longer kills it (audit s31 a4 D7). Real sockets,
the real ``Router`` app, test_http.py's stand-in worker; no vLLM."""

from __future__ import annotations

import asyncio
import time

from aiohttp import ClientSession, ClientTimeout, web

from kvtier.router import app as router_app
from tests.router.test_http import Deaf, StandIn, leave_early, run, start_router, until


class LateAborts(Deaf):
    """A worker whose API server takes an abort ``late_s`` after it arrives, then ends every
    request of the ids it names (as vLLM does) and answers; it notes when each request arrived
    and when each abort was answered."""

    def __init__(self, name: str, late_s: float, **kw) -> None:
        super().__init__(name, **kw)
        self.late_s = late_s
        self.arrived: list[tuple[str | None, float]] = []   # (X-Request-Id, when)
        self.answered: list[float] = []

    async def complete(self, request):
        self.arrived.append((request.headers.get("X-Request-Id"), time.monotonic()))
        return await super().complete(request)

    async def abort(self, request):
        self.abort_posts.append(await request.json())
        await asyncio.sleep(self.late_s)
        for rid in self.abort_posts[-1]["request_ids"]:
            if rid in self.running:
                self.running[rid].set()
        self.answered.append(time.monotonic())
        return web.Response(status=200)


async def left_then_retried(w: LateAborts, url: str, s: ClientSession, other: dict | None = None):
    """The client of ``job-7`` leaves before its answer, then sends it again once the abort is on
    its way (and ``other``, a request of another id, at the same time); returns the answers."""
    same = {"X-Request-Id": "job-7"}
    await leave_early(s, url, "/v1/completions", {"prompt": "a b"}, headers=same, worker=w)
    await until(lambda: w.abort_posts, timeout_s=5)

    async def ask(headers):
        async with s.post(url + "/v1/completions", json={"prompt": "a b"}, headers=headers) as r:
            return r.status, await r.text()
    return await asyncio.gather(ask(same), *([ask(other)] if other else []))


def test_a_retry_under_the_id_of_an_aborted_request_waits_for_the_aborts_answer():
    """The retry reaches the worker only once the abort of its first attempt is answered, and
    runs whole; the first attempt is aborted. A request of another id sent meanwhile does not
    wait. Before, the retry went at once and the late abort killed it too (a 499)."""
    async def main():
        w = LateAborts("w0", late_s=0.6, steps=20, gap_s=0.05)   # 1 s of decoding
        await w.start()
        router, runner, url = await start_router([w], abort_again_s=())
        try:
            async with ClientSession() as s:
                (status, text), (other_status, _) = await left_then_retried(w, url, s, {"X-Request-Id": "job-8"})
            assert status == 200 and "done" in text, (status, text)
            assert (w.aborted, w.finished) == (1, 2), (w.aborted, w.finished)
            retry_at = [t for rid, t in w.arrived if rid == "job-7"][1]
            other_at = next(t for rid, t in w.arrived if rid == "job-8")
            assert retry_at >= w.answered[0] > other_at and other_status == 200
            assert router._unanswered_aborts == {} and router._named_on == {}
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_a_retry_waits_for_an_unanswered_abort_no_longer_than_the_aborts_own_bound(monkeypatch):
    """An abort the worker does not answer holds a retry of its id at most the abort's own bound
    (``ABORT_TIMEOUT_S``; 1 s here), then the retry goes."""
    monkeypatch.setattr(router_app, "ABORT_TIMEOUT_S", 1.0)

    async def main():
        w = LateAborts("w0", late_s=4.0, steps=10, gap_s=0.05)
        await w.start()
        router, runner, url = await start_router([w], abort_again_s=())
        try:
            async with ClientSession() as s:
                t0 = time.monotonic()
                [(status, text)] = await left_then_retried(w, url, s)
                took = time.monotonic() - t0
            assert status == 200 and "done" in text and w.answered == []
            assert 1.0 <= took < 5.0, took
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


class Hung(StandIn):
    """A hung worker: it takes requests and answers none, nor the aborts of them, until released."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.release = asyncio.Event()

    async def complete(self, request):
        await request.read()
        self.requests += 1
        await self.release.wait()
        return web.Response(status=499)

    async def abort(self, request):
        self.abort_posts.append(await request.json())
        await self.release.wait()
        return web.Response()


def test_a_retry_waiting_for_an_abort_on_a_worker_ejected_meanwhile_goes_elsewhere_at_once(monkeypatch):
    """A client leaves a stream on a hung worker A and sends it again under its id; A's abort is
    never answered, so the retry waits for it (``ABORT_TIMEOUT_S``, 5 s here). A fails its health
    checks meanwhile and is ejected: the wait ends, and the retry is decided again, to B, which
    answers it within about the ejection's time. Before, it waited the whole bound, was then sent
    to the ejected A all the same, and reached B only after ``request_timeout_s`` (4 s) more of
    silence (600 s by default: audit s32 a1 D5)."""
    monkeypatch.setattr(router_app, "ABORT_TIMEOUT_S", 5.0)

    async def main():
        a, b = Hung("A"), StandIn("B")
        for w in (a, b):
            await w.start()
        router, runner, url = await start_router([a], request_timeout_s=4.0, abort_again_s=())
        body, same = {"prompt": "one two three four five six seven eight", "stream": True}, {"X-Request-Id": "job-9"}
        try:
            async with ClientSession() as s:
                await leave_early(s, url, "/v1/completions", body, headers=same, worker=a)
                await until(lambda: a.abort_posts, timeout_s=5)
                async with s.post(url + "/admin/workers", json={"url": b.url}) as r:
                    assert r.status == 201
                t0 = time.monotonic()

                async def retry():
                    async with s.post(url + "/v1/completions", json=body, headers=same,
                                      timeout=ClientTimeout(total=30)) as r:
                        return r.status, r.headers.get("X-Kvtier-Worker"), await r.text()
                answer = asyncio.ensure_future(retry())
                await asyncio.sleep(0.2)
                assert not answer.done() and router._unanswered_aborts   # (waiting for A's abort)
                a.down = True
                status, worker, text = await answer
                took = time.monotonic() - t0
            assert status == 200 and worker == b.url and "[DONE]" in text, (status, worker, text[-80:])
            assert a.requests == 1 and took < 3.0, (a.requests, took)
        finally:
            a.release.set()
            await runner.cleanup()
            for w in (a, b):
                await w.stop()
    run(main())
