"""The admin API reads what a planner sends as the router's config does (audit s34 a4):
``DELETE /admin/workers``'s ``force`` is a JSON boolean (D4); a worker URL is its base, named one
way, so one worker spelt two ways is one worker (D2, D5). Real ``Router`` app over real sockets,
test_http.py's stand-in workers."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import ClientSession, web

from tests.router.test_http import StandIn, run, start_router, until


class Slow(StandIn):
    """Answers a completion after ``release`` is set: a request in flight for as long as a test needs."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.release = asyncio.Event()

    async def complete(self, request):
        await request.read()
        self.requests += 1
        await self.release.wait()
        return web.json_response({"choices": [{"text": "x"}]})


@pytest.mark.parametrize("force", ["false", "no", "0", "true", 0, 1, None, [], {}])
def test_remove_refuses_a_force_that_is_not_a_json_boolean(force):
    """Before: ``{"force": "false"}`` (a launcher's JSON built from environment strings) was read
    by truthiness: the worker was forgotten with a request in flight, the very case the 409
    guards. Control: without force, 409; ``"force": true``, removed."""
    async def main():
        a, b = Slow("a"), StandIn("b")
        for w in (a, b):
            await w.start()
        router, runner, url = await start_router([a, b])
        try:
            async with ClientSession() as s:
                router.workers[1].draining = True          # so that the request goes to a
                answer = asyncio.ensure_future(s.post(url + "/v1/completions", json={"prompt": "a b c d"}))
                await until(lambda: router.workers[0].inflight == 1)
                router.workers[1].draining = False
                async with s.post(url + "/admin/workers/drain", json={"url": a.url}) as r:
                    assert r.status == 200
                async with s.delete(url + "/admin/workers", json={"url": a.url, "force": force}) as r:
                    assert r.status == 400, r.status
                    assert (await r.json())["error"]["message"].startswith('"force" must be true or false')
                async with s.delete(url + "/admin/workers", json={"url": a.url}) as r:
                    assert r.status == 409                 # control: in flight, not forced
                assert [w.url for w in router.workers] == [a.url, b.url]
                async with s.delete(url + "/admin/workers", json={"url": a.url, "force": True}) as r:
                    assert r.status == 200                 # control: forced
                a.release.set()
                (await answer).close()
        finally:
            a.release.set()
            await runner.cleanup()
            await a.stop()
            await b.stop()
    run(main())


def test_a_worker_url_spelt_another_way_is_the_same_worker():
    """An add of a listed worker's URL in capitals or with a slash is that worker (200, listed
    once); a drain by that spelling drains it. Before, ``/`` was stripped but the case was not."""
    async def main():
        a, b = StandIn("a"), StandIn("b")
        for w in (a, b):
            await w.start()
        router, runner, url = await start_router([a, b])
        other = a.url.replace("http://", "HTTP://") + "/"
        try:
            async with ClientSession() as s:
                async with s.post(url + "/admin/workers", json={"url": other}) as r:
                    assert r.status == 200 and (await r.json())["id"] == 0
                assert [w.url for w in router.workers] == [a.url, b.url]
                async with s.post(url + "/admin/workers/drain", json={"url": other}) as r:
                    assert r.status == 200 and (await r.json())["url"] == a.url
                assert router.workers[0].draining
        finally:
            await runner.cleanup()
            await a.stop()
            await b.stop()
    run(main())


@pytest.mark.parametrize("suffix, says", [("/v1", "scheme://host:port, with no path"),
                                          ("/?x=1", "scheme://host:port, with no path"),
                                          ("@", "worker_api_key")])
def test_the_admin_api_refuses_a_worker_url_beyond_its_base(suffix, says):
    """``http://host:port/v1`` had each request sent to ``/v1/v1/...``; ``http://user:secret@host``
    had ``secret`` shown in X-Kvtier-Worker and the unauthenticated ``GET /health``."""
    async def main():
        a, b = StandIn("a"), StandIn("b")
        for w in (a, b):
            await w.start()
        router, runner, url = await start_router([a])
        given = b.url.replace("http://", "http://admin:secret@") if suffix == "@" else b.url + suffix
        try:
            async with ClientSession() as s:
                async with s.post(url + "/admin/workers", json={"url": given}) as r:
                    assert r.status == 400 and says in await r.text()
                async with s.get(url + "/health") as r:
                    assert "secret" not in await r.text()
                assert [w.url for w in router.workers] == [a.url]
                async with s.post(url + "/admin/workers", json={"url": b.url}) as r:
                    assert r.status == 201                 # control: its base URL is taken
        finally:
            await runner.cleanup()
            await a.stop()
            await b.stop()
    run(main())
