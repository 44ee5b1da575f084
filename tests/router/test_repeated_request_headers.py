"""A header the client sent more than once reaches the worker as every one of its lines, in order
(kvtier/router/relay.py ``forwarded_headers``; audit s31 a4 D1): collapsed to its last value, a
request with two ``X-Request-Id`` lines (a client's, then one an ingress appended) ran on the
worker under the last while the router, reading the first as vLLM does, named and aborted it by
the first, and missed. Real sockets, the real ``Router`` app, stand-in workers as in
test_http.py; no vLLM."""

from __future__ import annotations

from aiohttp import ClientSession, web
from multidict import CIMultiDict

from tests.router.test_http import Deaf, StandIn, distinct, leave_early, run, start_router, until
from tests.router.test_openai_conformance import NamingDeaf


def test_a_request_id_sent_twice_is_run_and_aborted_under_the_first():
    """The worker reads the first ``X-Request-Id`` line (vLLM: Starlette's ``headers.get``), and
    so does the router: the request runs as ``cmpl-client-id-0`` and the abort sent when its
    client leaves names that id and stops it. Before: the worker was sent only ``ingress-id``."""
    async def main():
        w = NamingDeaf("w0")
        w.steps, w.gap_s = 100, 0.05   # 5 s of decoding unless aborted
        await w.start()
        router, runner, url = await start_router([w], abort_again_s=())
        try:
            async with ClientSession() as s:
                twice = CIMultiDict([("X-Request-Id", "client-id"), ("X-Request-Id", "ingress-id")])
                await leave_early(s, url, "/v1/completions", {"prompt": "a b"}, headers=twice, worker=w)
                await until(lambda: w.aborted == 1, timeout_s=10)
                assert w.named == [["cmpl-client-id-0"]], w.named
                assert [p["request_ids"] for p in distinct(w.abort_posts)] == [["cmpl-client-id-0"]]
                assert w.aborted == 1 and w.finished == 0
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


class AllLines(StandIn):
    """A worker that answers with every line of each header it was sent, in order."""

    async def other(self, request):
        await request.read()
        lines: dict[str, list[str]] = {}
        for name, value in request.headers.items():
            lines.setdefault(name.lower(), []).append(value)
        return web.json_response(lines)


def test_every_line_of_a_repeated_header_reaches_the_worker_in_order():
    """``X-Forwarded-For`` lines appended by two proxies, two ``Cookie`` lines, two ``X-Request-Id``:
    each forwarded whole and in order (an ingress behind the router reads the chain it was sent).
    Control: a header sent once is sent once; ``Accept-Encoding`` is still replaced by one
    ``identity`` and a hop-by-hop header still dropped."""
    async def main():
        w = AllLines("w0")
        await w.start()
        router, runner, url = await start_router([w])
        try:
            async with ClientSession() as s:
                sent = CIMultiDict([("X-Forwarded-For", "10.0.0.1"), ("X-Request-Id", "first"),
                                    ("Cookie", "a=1"), ("X-Forwarded-For", "10.0.0.2"), ("X-Tenant", "t1"),
                                    ("Cookie", "b=2"), ("X-Request-Id", "second"), ("Accept-Encoding", "gzip"),
                                    ("Accept-Encoding", "br"), ("TE", "trailers")])
                async with s.post(url + "/v1/embeddings", json={"input": "a"}, headers=sent) as r:
                    assert r.status == 200, await r.text()
                    got = await r.json()
            assert got["x-forwarded-for"] == ["10.0.0.1", "10.0.0.2"]
            assert got["cookie"] == ["a=1", "b=2"]
            assert got["x-request-id"] == ["first", "second"]
            assert got["x-tenant"] == ["t1"]
            assert got["accept-encoding"] == ["identity"] and "te" not in got
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def test_a_client_that_names_its_request_once_is_aborted_by_that_name():
    """Control: one ``X-Request-Id`` line, as before."""
    async def main():
        w = Deaf("w0", steps=100, gap_s=0.05)
        await w.start()
        router, runner, url = await start_router([w], abort_again_s=())
        try:
            async with ClientSession() as s:
                await leave_early(s, url, "/v1/completions", {"prompt": "a b"},
                                  headers={"X-Request-Id": "client-id"}, worker=w)
                await until(lambda: w.aborted == 1, timeout_s=10)
                assert w.named == [["cmpl-client-id-0"]] and w.aborted == 1
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())
