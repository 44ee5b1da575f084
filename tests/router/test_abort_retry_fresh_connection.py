"""An abort that met "Server disconnected" (a pooled keep-alive connection the worker had just
closed) is sent once more on a connection of its own, never the pool's next (kvtier/router/abort.py;
audit s31 a4 D4): a worker closes the connections idle since one burst together (uvicorn's
keep-alive timer), and the second attempt, taking the next stale pooled one, lost the abort, and
the generation decoded on. Real sockets, the real ``Router`` app, stand-in workers as in
test_http.py; no vLLM."""

from __future__ import annotations

import asyncio

from aiohttp import ClientSession, web

from tests.router.test_http import Deaf, leave_early, run, start_router, until


class ClosesKeptAliveConnections(Deaf):
    """A worker whose keep-alive timer fires on every idle connection as an abort arrives on one:
    an abort on a connection that served a request before is dropped unanswered; one on a new
    connection is answered. Connections are told apart by the router's port (unique while open)."""

    def __init__(self, name: str, **kw) -> None:
        super().__init__(name, **kw)
        self.served: dict[tuple, int] = {}   # the router's (host, port) -> requests served on it
        self.dropped = 0

    def _serve(self, request) -> None:
        peer = request.transport.get_extra_info("peername")
        self.served[peer] = self.served.get(peer, 0) + 1

    async def health(self, request):
        self._serve(request)
        await asyncio.sleep(0.3)   # held, so that checks made together take a connection each
        return web.Response(status=200)

    async def complete(self, request):
        self._serve(request)
        return await super().complete(request)

    async def abort(self, request):
        if self.served.get(request.transport.get_extra_info("peername"), 0):
            self.dropped += 1
            request.transport.close()
            return web.Response(status=200)   # (never reaches the router)
        return await super().abort(request)


def test_an_abort_lost_to_a_stale_pooled_connection_is_sent_again_on_a_new_one():
    """Four kept-alive connections to the worker in the router's pool, all stale when the abort
    goes: the first attempt is dropped, the second, on a connection of its own, is answered and
    stops the generation (``ok``). Before: the second took another stale pooled connection and the
    abort was counted ``failed``."""
    async def main():
        w = ClosesKeptAliveConnections("w0", steps=200, gap_s=0.05)   # 10 s of decoding unless aborted
        await w.start()
        router, runner, url = await start_router([w], abort_again_s=())
        count = router.metrics.aborts.labels
        try:
            # idle keep-alive connections in the router's pool, as after a burst of requests
            for resp in await asyncio.gather(*(router.session.get(w.url + "/health") for _ in range(4))):
                resp.release()
            async with ClientSession() as s:
                await leave_early(s, url, "/v1/completions", {"prompt": "a b"}, worker=w)
                await until(lambda: count(w.url, "ok")._value.get() + count(w.url, "failed")._value.get() >= 1,
                            timeout_s=10)
                await until(lambda: w.aborted == 1, timeout_s=5)   # (the worker stops at its next step)
                got = {r: count(w.url, r)._value.get() for r in ("ok", "failed")}
                assert got == {"ok": 1, "failed": 0}, got
                assert w.dropped == 1 and w.aborted == 1 and w.finished == 0, (w.dropped, w.aborted, w.finished)
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())
