"""A worker the router gives up on (silent past ``request_timeout_s``, cut off mid-answer, a
gateway's 504, ejected while it decodes) may decode on for nobody: vLLM does not always notice a
closed connection (vllm-project/vllm#54947, router/abort.py). The router aborts the request there
by name before it goes elsewhere (audit s31 a4 D3). A whole answer's long decode is no failure:
its first byte comes only once it is over. Real sockets, the real ``Router`` app, the stand-in
workers of test_http.py (which name and abort requests as vLLM does); no vLLM."""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import ClientSession, ClientTimeout, web

from tests.router.test_http import Deaf, distinct, run, start_router, until


class FirstOfGroup(Deaf):
    """A Deaf worker of a group (``group``: shared by them) whose first request anywhere in the
    group goes wrong by ``fault``: "silent" (its engine decodes it, its API server sends nothing
    for 2 s), "hangs" (it stops answering health checks and decodes on), "long" (a long decode,
    healthy), "504" (a gateway before it times out while it decodes on)."""

    def __init__(self, name: str, group: list, fault: str, **kw) -> None:
        super().__init__(name, **kw)
        self.group, self.fault = group, fault

    async def complete(self, request):
        if self.group:   # not the first: answers as a Deaf worker does
            return await super().complete(request)
        self.group.append(self)
        if self.fault == "silent":
            return await self.silent(request)
        if self.fault == "hangs":   # (5 s of decoding)
            self.down, self.steps = True, 100
        elif self.fault == "long":   # (5 s of decoding, healthy)
            self.steps = 100
        elif self.fault == "504":
            await request.read()   # (kept: the decode below reads it after this answer)
            asyncio.ensure_future(super().complete(request))
            return web.json_response({"error": "gateway timeout"}, status=504)
        return await super().complete(request)

    async def silent(self, request):
        """A completion named and run as vLLM runs one, nothing sent for 2 s (its first byte
        comes late: a long queue, a long prefill), deaf to its connection closing meanwhile."""
        rid = request.headers["X-Request-Id"]   # (the router names it)
        ids = [f"cmpl-{rid}-0"]
        self.named.append(ids)
        self.requests += 1
        stop = asyncio.Event()
        self.running.update({i: stop for i in ids})
        for _ in range(20):
            if stop.is_set():
                self.aborted += 1
                return web.Response(status=499)
            await asyncio.sleep(0.1)
        self.finished += 1
        return web.Response(status=200)


async def pair(fault: str, **kw):
    """Two workers, the first request's going wrong by ``fault``, behind a real router."""
    group: list = []
    workers = [FirstOfGroup(f"w{i}", group, fault, steps=10, gap_s=0.05)
               for i in range(2)]
    for w in workers:
        await w.start()
    router, runner, url = await start_router(workers, **kw)
    return group, workers, router, runner, url


async def stop(runner, workers) -> None:
    await runner.cleanup()
    for w in workers:
        await w.stop()


def test_a_whole_answer_decoded_longer_than_the_request_timeout_is_waited_for():
    """A non-streamed answer's first byte comes after its whole decode (3 s here, over the 1 s
    ``request_timeout_s``): the router waits for it on the worker that has it. Before, the
    silence was taken for a dead worker: charged a failure, the request decoded again on the
    next worker, then a 503, both generations left decoding for nobody."""
    async def main():
        workers = [Deaf(f"w{i}", steps=30, gap_s=0.1) for i in range(2)]
        for w in workers:
            await w.start()
        router, runner, url = await start_router(workers, request_timeout_s=1.0, max_attempts=2)
        try:
            async with ClientSession() as s:
                async with s.post(url + "/v1/completions", json={"prompt": "a b"}) as r:
                    status, answer = r.status, await r.json()
            assert status == 200 and answer["choices"][0]["text"] == "done", answer
            assert sorted(w.requests for w in workers) == [0, 1] and sum(w.finished for w in workers) == 1
            assert [w.failures for w in router.workers] == [0, 0] and all(w.healthy for w in router.workers)
            assert [w.abort_posts for w in workers] == [[], []]
        finally:
            await stop(runner, workers)
    run(main())


def test_a_stream_silent_past_the_request_timeout_is_aborted_there_before_its_retry():
    """A stream's first byte ends its prefill: a worker silent past ``request_timeout_s`` before
    it is given up on and the request goes to another worker. The first worker, which had the
    request and decodes on, is told to abort it by name: it stops there. Before, it decoded to
    its end for nobody."""
    async def main():
        group, workers, router, runner, url = await pair("silent", request_timeout_s=1.0, abort_again_s=())
        try:
            async with ClientSession() as s:
                async with s.post(url + "/v1/completions", json={"prompt": "a b", "stream": True}) as r:
                    status, raw = r.status, await r.read()
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw
            silent, other = group[0], next(w for w in workers if w is not group[0])
            assert other.finished == 1
            await until(lambda: silent.aborted + silent.finished == 1, timeout_s=5)
            assert (silent.aborted, silent.finished) == (1, 0), (silent.aborted, silent.finished)
            assert {tuple(p["request_ids"]) for p in distinct(silent.abort_posts)} == {tuple(silent.named[0])}
            assert other.abort_posts == []
        finally:
            await stop(runner, workers)
    run(main())


def test_a_stream_whose_worker_falls_silent_mid_answer_is_aborted_there():
    """A worker silent past ``request_timeout_s`` after the client had part of its stream: the
    client's stream ends with an error event (as before) and the worker is told to abort the
    request by name. Before, it decoded on for nobody."""
    async def main():
        w = Deaf("w0", steps=4, gap_s=1.5)   # a chunk, then 1.5 s of silence before each next
        await w.start()
        router, runner, url = await start_router([w], request_timeout_s=1.0, abort_again_s=())
        try:
            async with ClientSession() as s:
                async with s.post(url + "/v1/completions", json={"prompt": "a b", "stream": True}) as r:
                    raw = (await r.read()).decode()
            events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
            assert json.loads(events[0])["choices"][0]["text"] == "0"
            assert "went silent" in json.loads(events[1])["error"]["message"] and events[2:] == ["[DONE]"]
            await until(lambda: w.aborted + w.finished == 1, timeout_s=8)
            assert (w.aborted, w.finished) == (1, 0) and w.abort_posts[0]["request_ids"] == w.named[0]
        finally:
            await stop(runner, [w])
    run(main())


def test_a_gateways_504_is_aborted_behind_it_before_the_retry():
    """A 504 is a gateway between the router and the worker that stopped waiting: the worker
    behind it may decode on. The request goes to another worker (as before) and the first is
    told to abort it by name. Before, it decoded to its end for nobody."""
    async def main():
        group, workers, router, runner, url = await pair("504", abort_again_s=(0.5,))
        try:
            async with ClientSession() as s:
                async with s.post(url + "/v1/completions", json={"prompt": "a b"}) as r:
                    status, answer = r.status, await r.json()
            assert status == 200 and answer["choices"][0]["text"] == "done"
            behind, other = group[0], next(w for w in workers if w is not group[0])
            assert other.finished == 1
            await until(lambda: behind.aborted + behind.finished == 1, timeout_s=5)
            assert (behind.aborted, behind.finished) == (1, 0), (behind.aborted, behind.finished)
        finally:
            await stop(runner, workers)
    run(main())


def test_a_whole_answer_on_a_worker_ejected_while_it_decodes_is_aborted_and_sent_elsewhere():
    """No silence bound before a whole answer's first byte: whether its worker lives is for its
    health checks to say. One that fails them while it decodes (hung: 5 s of decoding, no health)
    is given up on once ejected and still silent ``request_timeout_s`` (1 s) after (audit s31 r7
    D1, D2: not at once), told to abort the request by name, and the request goes to another
    worker: answered within about the ejection's time and that bound. Before, the client waited for
    the hung worker (here its whole decode; a real hung one, for ever, audit s31 r3 D1)."""
    async def main():
        group, workers, router, runner, url = await pair("hangs", eject_after=2, abort_again_s=(0.5,),
                                                         request_timeout_s=1.0)
        try:
            async with ClientSession() as s:
                t0 = time.monotonic()
                async with s.post(url + "/v1/completions", json={"prompt": "a b"},
                                  timeout=ClientTimeout(total=20)) as r:
                    status, answer = r.status, await r.json()
                took = time.monotonic() - t0
            assert status == 200 and answer["choices"][0]["text"] == "done"
            hung, other = group[0], next(w for w in workers if w is not group[0])
            assert other.finished == 1 and took < 3.5, took
            await until(lambda: hung.aborted + hung.finished == 1, timeout_s=8)
            assert (hung.aborted, hung.finished) == (1, 0), (hung.aborted, hung.finished)
        finally:
            await stop(runner, workers)
    run(main())


def test_a_whole_answer_sent_to_a_worker_ejected_before_it_keeps_the_silence_bound():
    """A worker ejected before the request was sent (the only one: ``decide()``'s last resort) and
    ejected still: silent for ``request_timeout_s`` (1 s) after its health checks were seen failing,
    it is given up on, told to abort the request by name, and the client gets its 503. Before, the
    client waited for the whole decode (10 s here; a hung worker's: for ever, audit s31 r3 D1)."""
    async def main():
        w = Deaf("w0", steps=100, gap_s=0.1)   # 10 s of decoding, /health failing
        w.down = True
        await w.start()
        router, runner, url = await start_router([w], request_timeout_s=1.0, max_attempts=2, abort_again_s=())
        try:
            await until(lambda: not router.workers[0].healthy, timeout_s=5)
            assert not router.workers[0].healthy
            async with ClientSession() as s:
                t0 = time.monotonic()
                async with s.post(url + "/v1/completions", json={"prompt": "a b"},
                                  timeout=ClientTimeout(total=20)) as r:
                    status, answer = r.status, await r.json()
                took = time.monotonic() - t0
            assert status == 503 and took < 4, (status, took, answer)
            assert "sent nothing for 1 s" in answer["error"]["message"], answer
            await until(lambda: w.aborted + w.finished == 1, timeout_s=5)
            assert (w.aborted, w.finished) == (1, 0), (w.aborted, w.finished)
        finally:
            await stop(runner, [w])
    run(main())


def test_a_whole_answer_sent_during_a_short_health_outage_is_waited_for():
    """The only worker fails its health checks, is ejected, and gets a whole answer to decode (3 s)
    as ``decide()``'s last resort; it passes them again a moment later and is re-admitted. Its
    health checks say it lives, so its decode, longer than ``request_timeout_s`` (1 s), is waited
    for: 200, decoded once, no failure charged. Before, a request sent while its worker was ejected
    kept the silence bound whatever became of the worker: the decode was taken for a dead worker,
    aborted, and the client got a 503 (audit s32 a1 D3)."""
    async def main():
        w = Deaf("w0", steps=30, gap_s=0.1)
        await w.start()
        router, runner, url = await start_router([w], request_timeout_s=1.0, eject_after=1, abort_again_s=())
        try:
            async with ClientSession() as s:
                w.down = True
                await until(lambda: not router.workers[0].healthy, timeout_s=5)
                ask = asyncio.ensure_future(s.post(url + "/v1/completions", json={"prompt": "a b"},
                                                   timeout=ClientTimeout(total=20)))
                await until(lambda: w.requests == 1, timeout_s=5)
                w.down = False
                await until(lambda: router.workers[0].healthy, timeout_s=5)
                assert router.workers[0].healthy and not ask.done()
                r = await ask
                status, answer = r.status, await r.json()
                r.release()
            assert status == 200 and answer["choices"][0]["text"] == "done", (status, answer)
            assert (w.requests, w.finished, w.aborted) == (1, 1, 0), (w.requests, w.finished, w.aborted)
            assert router.workers[0].failures == 0 and not w.abort_posts, w.abort_posts
        finally:
            await stop(runner, [w])
    run(main())


def test_a_whole_answer_on_a_worker_removed_while_it_decodes_is_aborted_and_sent_elsewhere():
    """A worker force-removed (admin ``DELETE … force``, as a planner replacing it does) is no
    longer health-checked: a whole answer waiting on it with no silence bound is given up on once
    it has sent nothing for ``request_timeout_s`` (1 s) after the removal was seen, the worker told
    to abort it by name, and the request goes to another worker. Before, the client waited on the
    removed worker (its whole decode here; a hung one's: for ever, audit s31 r3 D1)."""
    async def main():
        group, workers, router, runner, url = await pair("long", abort_again_s=(), request_timeout_s=1.0)
        try:
            async with ClientSession() as s:
                t0 = time.monotonic()
                ask = asyncio.ensure_future(s.post(url + "/v1/completions", json={"prompt": "a b"},
                                                   timeout=ClientTimeout(total=20)))
                removed = await drain_and_remove_the_first(s, url, group)
                r = await ask
                status, answer, took = r.status, await r.json(), time.monotonic() - t0
                r.release()
            other = next(w for w in workers if w is not removed)
            assert status == 200 and answer["choices"][0]["text"] == "done" and other.finished == 1
            assert took < 4, took
            await until(lambda: removed.aborted + removed.finished == 1, timeout_s=8)
            assert (removed.aborted, removed.finished) == (1, 0), (removed.aborted, removed.finished)
        finally:
            await stop(runner, workers)
    run(main())


async def drain_and_remove_the_first(s: ClientSession, url: str, group: list):
    """Drain and force-remove (the admin API, as a planner scaling down does) the worker that has
    the group's first request, once it has it; return it."""
    await until(lambda: bool(group), timeout_s=5)
    removed = group[0]
    for method, path, body in (("POST", "/admin/workers/drain", {"url": removed.url}),
                               ("DELETE", "/admin/workers", {"url": removed.url, "force": True})):
        async with s.request(method, url + path, json=body) as r:
            assert r.status == 200, (path, r.status, await r.text())
    return removed


def test_a_whole_answer_on_a_force_removed_worker_that_answers_within_the_bound_still_finishes():
    """A healthy worker drained and force-removed while it decodes a whole answer (5 s) that ends
    within ``request_timeout_s`` of the removal: its requests "still finish" (router/admin.py), so
    the answer is its own, not aborted, not decoded again elsewhere. Before, it was aborted at the
    next look and decoded again from scratch on the other worker (audit s31 r7 D1)."""
    async def main():
        group, workers, router, runner, url = await pair("long", abort_again_s=(), request_timeout_s=30.0)
        try:
            async with ClientSession() as s:
                ask = asyncio.ensure_future(s.post(url + "/v1/completions", json={"prompt": "a b"},
                                                   timeout=ClientTimeout(total=20)))
                removed = await drain_and_remove_the_first(s, url, group)
                r = await ask
                status, answer = r.status, await r.json()
                r.release()
            other = next(w for w in workers if w is not removed)
            assert status == 200 and answer["choices"][0]["text"] == "done", (status, answer)
            assert (removed.finished, removed.aborted, other.requests) == (1, 0, 0), \
                (removed.finished, removed.aborted, other.requests)
            assert not removed.abort_posts, removed.abort_posts
        finally:
            await stop(runner, workers)
    run(main())


def test_a_whole_answer_outlives_short_health_outages_of_its_only_worker():
    """The only worker is ejected twice, for about 1.2 s each, while it decodes a whole answer (6 s),
    and admitted again at its next passing check each time. Each outage is shorter than
    ``request_timeout_s`` (2 s), and a passing check lifts the bound (the two together are longer),
    so the answer is waited for: 200, decoded once, no abort. Before, the first ejection aborted
    the decode and the client got 503, the retry having no other worker (audit s31 r7 D2)."""
    async def main():
        w = Deaf("w0", steps=120, gap_s=0.05)
        await w.start()
        router, runner, url = await start_router([w], request_timeout_s=2.0, eject_after=2, max_attempts=2,
                                                 abort_again_s=())
        try:
            async with ClientSession() as s:
                ask = asyncio.ensure_future(s.post(url + "/v1/completions", json={"prompt": "a b"},
                                                   timeout=ClientTimeout(total=20)))
                ejections = 0
                for start_s in (0.3, 0.5):   # (the second starts 0.5 s after the first has ended)
                    await asyncio.sleep(start_s)
                    w.down = True
                    await until(lambda: not router.workers[0].healthy, timeout_s=5)
                    ejections += 1
                    await asyncio.sleep(1.2)
                    w.down = False
                    await until(lambda: router.workers[0].healthy, timeout_s=5)
                r = await ask
                status, answer = r.status, await r.json()
                r.release()
            assert ejections == 2
            assert status == 200 and answer["choices"][0]["text"] == "done", (status, answer)
            assert (w.requests, w.finished, w.aborted) == (1, 1, 0), (w.requests, w.finished, w.aborted)
            assert not w.abort_posts, w.abort_posts
        finally:
            await stop(runner, [w])
    run(main())
