"""What an abort by name may cost the router (kvtier/router/abort.py; audit s31 a4 D2): each of its
ids repeats the request's name, and a 250 KB body ``request_id`` on a batch of 1,024 prompts made
a 256 MB abort, built and JSON-encoded on the event loop and posted to the worker. Now an abort
whose ids would take more than ``MAX_ABORT_BYTES`` (1 MiB: a full batch under a client's long id
fits, audit s31 r3 D3; one over 64 KiB is built on a thread) is not sent (counted ``too_many``;
its closed connection tells the worker), a body ``request_id`` too long to keep leaves the request unnamed
(nothing of it held for the whole decode), and a failed abort logs its count, not its ids.
Real sockets, the real ``Router`` app, stand-in workers as in test_http.py; no vLLM."""

from __future__ import annotations

import asyncio
import json
import logging
import tracemalloc

import pytest
from aiohttp import ClientSession, web

from kvtier.router.abort import MAX_ABORT_BYTES, MAX_KEPT_ID_CHARS, EngineIds
from tests.router.test_http import Deaf, distinct, leave_early, run, start_router, until
from tests.router.test_openai_conformance import NamingDeaf


def counted(router, worker, result: str) -> float:
    return router.metrics.aborts.labels(worker.url, result)._value.get()


@pytest.mark.parametrize("rid, count", [("a" * 32, 1), ("r" * 4000, 64), ("x", 5000), ("réq \"1\"\n", 1000),
                                        ("\U0001f600" * 300, 3), ("c" * 36, 1024)])
@pytest.mark.parametrize("numbered", [True, False])
def test_an_aborts_size_is_known_before_its_ids_are_built(rid, count, numbered):
    """``abort_bytes`` is never below the body aiohttp sends (``json.dumps``, characters escaped),
    and close to it: the bound is on what is sent."""
    engine = EngineIds("cmpl-" if numbered else "chatcmpl-", rid, count if numbered else 1, numbered)
    sent = len(engine.encoded())
    assert json.loads(engine.encoded()) == {"request_ids": engine.ids()} and engine.first() == engine.ids()[0]
    assert sent <= engine.abort_bytes() <= sent * 1.1 + 16


@pytest.mark.parametrize("rid, sent", [("r" * 8000, False), ("r" * 40, True)], ids=["8000", "control-40"])
def test_an_abort_whose_ids_exceed_its_byte_bound_is_counted_not_sent(rid, sent):
    """A batch of 200 prompts named by an 8,000-character body ``request_id`` (kept: under
    ``MAX_KEPT_ID_CHARS``): its abort would be ~1.6 MB (200 ids of ~8,000 characters), over
    ``MAX_ABORT_BYTES``, so none is posted; ``too_many`` counts it. Before: posted whole. Control:
    the same batch under a 40-character id is aborted, all 200 named."""
    assert 200 * len(rid) > MAX_ABORT_BYTES if not sent else 200 * (len(rid) + 10) < MAX_ABORT_BYTES
    assert len(rid) <= MAX_KEPT_ID_CHARS

    async def main():
        w = Deaf("w0", steps=100, gap_s=0.05)
        await w.start()
        router, runner, url = await start_router([w], abort_again_s=())
        try:
            async with ClientSession() as s:
                await leave_early(s, url, "/v1/completions", {"prompt": ["abc"] * 200, "request_id": rid}, worker=w)
                await until(lambda: counted(router, w, "too_many") + counted(router, w, "ok") >= 1, timeout_s=10)
                if sent:
                    await until(lambda: w.aborted == 1, timeout_s=10)
                    assert [len(p["request_ids"]) for p in distinct(w.abort_posts)] == [200]
                    assert w.aborted == 1 and counted(router, w, "too_many") == 0
                else:
                    assert w.abort_posts == [], f"an abort of {len(json.dumps(w.abort_posts[0]))} bytes was sent"
                    assert counted(router, w, "too_many") == 1 and counted(router, w, "ok") == 0
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


@pytest.mark.parametrize("rid", ["f" * 64, "k" * 560], ids=["64-hex-like", "560"])
def test_a_full_batch_under_a_clients_long_id_is_aborted_by_name(rid):
    """A batch of ``MAX_ABORT_IDS`` (1,024) prompts under a client's own ``X-Request-Id`` of 64
    characters (a 64-hex trace id or idempotency key: an abort of ~80 KiB) or 560 (~590 KB, built
    and encoded on a thread): its client leaves, and every engine request is aborted by name.
    Before, over the 64 KiB bound, none was (``too_many``), and the whole batch decoded on for
    nobody on a vLLM that misses the closed connection (audit s31 r3 D3)."""
    async def main():
        w = Deaf("w0", steps=100, gap_s=0.05)
        await w.start()
        router, runner, url = await start_router([w], abort_again_s=())
        try:
            async with ClientSession() as s:
                await leave_early(s, url, "/v1/completions", {"prompt": ["a b"] * 1024, "max_tokens": 5},
                                  headers={"X-Request-Id": rid}, worker=w)
                await until(lambda: w.aborted + w.finished == 1, timeout_s=10)
            assert (w.aborted, w.finished) == (1, 0), (w.aborted, w.finished, counted(router, w, "too_many"))
            assert [p["request_ids"] for p in distinct(w.abort_posts)] == [[f"cmpl-{rid}-{i}" for i in range(1024)]]
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


def held_by_aborts() -> int:
    """Bytes allocated in router/abort.py and still alive (tracemalloc, which must be tracing)."""
    snapshot = tracemalloc.take_snapshot()
    return sum(stat.size for stat in snapshot.statistics("filename")
               if stat.traceback[0].filename.endswith("router/abort.py"))


def test_a_large_abort_body_is_held_only_while_it_is_posted():
    """Four clients each send a batch of 1,024 prompts under a 900-character ``X-Request-Id`` and
    leave before the first byte: each abort body is ~0.9 MiB. Between the first post and the post
    sent again (5 s later), the router holds none of them: each post builds its own (off the loop)
    and lets it go. Before, each body was kept for the post sent again, ~3.6 MiB here counted in no
    bound (one per departed client: audit s31 r7 D3); both posts still name every engine request."""
    rid = "q" * 900

    async def main():
        w = Deaf("w0", steps=400, gap_s=0.05)
        await w.start()
        router, runner, url = await start_router([w], abort_again_s=(5.0,))
        tracemalloc.start()
        try:
            async with ClientSession() as s:
                for i in range(4):
                    await leave_early(s, url, "/v1/completions", {"prompt": ["a b"] * 1024, "max_tokens": 5},
                                      headers={"X-Request-Id": f"{i}{rid}"}, worker=w)
                await until(lambda: len(w.abort_posts) == 4, timeout_s=10)
                await asyncio.sleep(0.5)   # (each post answered: the router is past it, waiting to post again)
                assert len(w.abort_posts) == 4 and len(router.aborts._waiting) == 4
                held = held_by_aborts()
            assert held < 512 * 1024, f"{held / 2**20:.1f} MiB held between an abort's posts"
            assert [len(p["request_ids"]) for p in w.abort_posts] == [1024] * 4
        finally:
            tracemalloc.stop()
            await runner.cleanup()
            await w.stop()
    run(main())


class AnswersAbortsWhenLet(Deaf):
    """A worker whose API server, beside a busy engine, answers no abort until let (up to the
    abort's ``ABORT_TIMEOUT_S`` of 30 s); it notes the aborts begun and the most bytes of their
    bodies it held unanswered at once."""

    def __init__(self, name: str, **kw) -> None:
        super().__init__(name, **kw)
        self.let = asyncio.Event()
        self.begun = self.unanswered_bytes = self.most_unanswered_bytes = 0

    async def abort(self, request):
        self.begun += 1
        size = len(await request.read())
        self.unanswered_bytes += size
        self.most_unanswered_bytes = max(self.most_unanswered_bytes, self.unanswered_bytes)
        await self.let.wait()
        self.unanswered_bytes -= size
        return await super().abort(request)


def test_the_abort_bodies_posted_at_once_are_bounded_and_those_over_the_bound_counted():
    """24 clients each send a batch of 120 empty prompts under an 8,000-character ``X-Request-Id``
    (~9 KB) and leave: each abort body is ~0.92 MiB, and the worker answers none for now. The router
    posts only those that fit its 16 MiB bound on the abort bodies posted at once (17); the other 7
    are not sent, counted ``over_budget`` (their closed connections tell the worker). Once the worker
    answers, the bound is free again: the next client that leaves is aborted by name. Before, all 24
    were posted and held, ~22 MiB counted in no bound, and N departures a second held ~N × 30 MiB
    (audit s32 a1 D2)."""
    n, budget, name = 24, 16 << 20, "x" * 7996
    fit = budget // EngineIds("cmpl-", "0000" + name, 120, True).abort_bytes()

    async def main():
        w = AnswersAbortsWhenLet("w0", steps=100, gap_s=0.1)
        await w.start()
        router, runner, url = await start_router([w], abort_again_s=())
        try:
            async with ClientSession() as s:
                async def ask(i: int) -> None:
                    async with s.post(url + "/v1/completions", json={"prompt": [""] * 120},
                                      headers={"X-Request-Id": f"{i:04d}{name}"}) as r:
                        await r.read()
                asks = [asyncio.ensure_future(ask(i)) for i in range(n)]
                await until(lambda: w.requests == n, timeout_s=10)
                for task in asks:   # every client leaves
                    task.cancel()
                await asyncio.gather(*asks, return_exceptions=True)
                await until(lambda: w.begun + counted(router, w, "over_budget") >= n, timeout_s=15)
                await asyncio.sleep(0.3)   # (none more comes)
                assert (w.begun, counted(router, w, "over_budget")) == (fit, n - fit), (w.begun, fit)
                assert w.most_unanswered_bytes <= budget and router.aborts.bytes_in_flight <= budget

                w.let.set()
                await until(lambda: counted(router, w, "ok") == fit and w.aborted == fit, timeout_s=10)
                assert router.aborts.bytes_in_flight == 0 and w.aborted == fit
                await leave_early(s, url, "/v1/completions", {"prompt": [""] * 120},
                                  headers={"X-Request-Id": f"last{name}"}, worker=w)
                await until(lambda: w.aborted == fit + 1, timeout_s=10)
                assert w.aborted == fit + 1 and counted(router, w, "over_budget") == n - fit
        finally:
            w.let.set()
            for stop in w.running.values():   # (the decodes no abort named end too)
                stop.set()
            await runner.cleanup()
            await w.stop()
    run(main())


@pytest.mark.parametrize("length, kept", [(MAX_KEPT_ID_CHARS + 1, False), (200_000, False),
                                          (MAX_KEPT_ID_CHARS, True)],
                         ids=["bound+1", "200000", "control-bound"])
def test_a_body_request_id_too_long_to_keep_leaves_the_request_unnamed(length, kept):
    """vLLM runs a request under its body's ``request_id`` whatever its length. One longer than
    ``MAX_KEPT_ID_CHARS`` is not kept by the router while the request lasts (before: held, uncounted,
    for a stream's whole decode, after its body was released), nor replaced by a header of the
    router's (that would rename the answer): the worker runs the request under the client's id,
    and no abort by name is sent when its client leaves (it could name no other id). Control: an
    id at the bound is kept and aborted by name."""
    rid = "r" * length

    async def main():
        w = SeesTheRoutersNames("w0")
        w.steps, w.gap_s = 100, 0.05
        await w.start()
        w.router, runner, url = await start_router([w], abort_again_s=())
        try:
            async with ClientSession() as s:
                await leave_early(s, url, "/v1/completions", {"prompt": "a b", "request_id": rid}, worker=w)
                assert w.headers == [None] and w.named == [[f"cmpl-{rid}-0"]]   # the client's id, no header added
                if kept:
                    assert w.names_held == [{rid: 1}]
                    await until(lambda: w.aborted == 1, timeout_s=10)
                    assert [p["request_ids"] for p in distinct(w.abort_posts)] == [[f"cmpl-{rid}-0"]]
                else:
                    assert w.names_held == [{}], "the router held the request's overlong id while it lasted"
                    await asyncio.sleep(1.0)   # (an abort is sent as the client leaves: abort_again_s=())
                    assert w.abort_posts == [] and w.router._names == {}
        finally:
            await runner.cleanup()
            await w.stop()
    run(main())


class SeesTheRoutersNames(NamingDeaf):
    """:class:`NamingDeaf`, noting as each request arrives the names its router holds."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.router = None
        self.names_held: list[dict[str, int]] = []

    async def complete(self, request):
        self.names_held.append(dict(self.router._names))
        return await super().complete(request)


class DropsEveryAbort(Deaf):
    """A worker that closes the connection of every abort without answering."""

    async def abort(self, request):
        request.transport.close()
        return web.Response(status=200)   # (never reaches the router)


def test_a_failed_abort_logs_its_count_not_its_ids(caplog):
    """An abort that failed was logged with its whole id list (up to MAX_ABORT_IDS ids, each
    repeating the request's name, on one line); now the count and the first id, shortened."""
    async def main():
        w = DropsEveryAbort("w0", steps=100, gap_s=0.05)
        await w.start()
        router, runner, url = await start_router([w], abort_again_s=())
        try:
            async with ClientSession() as s:
                await leave_early(s, url, "/v1/completions", {"prompt": ["abc"] * 50, "request_id": "q" * 100},
                                  worker=w)
                await until(lambda: counted(router, w, "failed") >= 1, timeout_s=10)
                assert counted(router, w, "failed") == 1
        finally:
            await runner.cleanup()
            await w.stop()
    with caplog.at_level(logging.INFO, logger="kvtier.router.abort"):
        run(main())
    failures = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1 and "aborting 50 engine request(s)" in failures[0], failures
    assert "-49" not in failures[0] and len(failures[0]) < 400, failures[0]
